"""The sampler: one step's logits in, one token per row out.

Contract
--------
``Sampler.__call__(logits, rows, mask)`` takes float32 logits ``[N, V]`` (one row per request
sampled this step), the ``N`` matching ``SamplingRow``s and, when some rows are structured
output, the step's ``TokenMask`` (``engine.structured``), and returns one token id per row plus, for
rows whose ``params.logprobs`` is set, a ``TokenLogprob``. ``V`` may exceed ``vocab_size``:
columns at or past ``vocab_size`` are padding and are never chosen nor reported. The input
tensor is never modified. Token ids in rows must lie in ``[0, vocab_size)``.

Per row, in this order (what vLLM and OpenAI users expect):

1. ``logit_bias`` is added (ids outside the vocabulary are ignored).
2. While fewer than ``min_tokens`` tokens have been generated, the stop tokens (the row's EOS
   ids unless ``ignore_eos``, plus ``stop_token_ids``, as vLLM does) are set to -inf. Not for
   rows with a grammar: the grammar decides where their output may end.
3. Repetition penalty (HF/vLLM) over prompt + output tokens: positive logits are divided by
   it, negative ones multiplied.
4. Frequency and presence penalties (OpenAI) over output tokens:
   ``logit -= frequency * count + presence * (count > 0)``.
5. Rows with a grammar: tokens the mask forbids are set to -inf.
6. Greedy rows (``params.greedy``: temperature 0 or top_k 1) take the argmax; ties go to the
   lowest id.
7. Other rows: divide by temperature, then top-k, top-p, min-p, then one draw from what is left.

Logprobs are the raw model's, as vLLM reports them by default: ``log_softmax`` of the input
logits before any step above; the sampled token's plus the ``params.logprobs`` best tokens,
best first.

Verification (``Sampler.verify(logits, rows, mask, groups)``, speculative decoding): each
``DraftGroup`` is one request's ``k + 1`` consecutive rows, row ``j`` scoring the position
after its ``j``-th draft token, with a ``SamplingRow`` whose output history (or its
``PendingTokens``) holds the drafts before it (so steps 1-5 see what sampling there would
see; the mask row is the grammar's state after those drafts). Per row, steps 1-5 and then 6
(greedy: all mass on the argmax) or 7's filters give the target distribution ``q``. A draft
is a point mass (the drafter's one proposed token ``d``): draft ``j + 1`` is kept when
``u < q_j(d)`` for a fresh uniform ``u`` (greedy: iff ``d`` is the argmax), and the first
rejection stops the group; the token sampled at the first rejected row comes from the
residual ``q_j`` with ``d`` removed and renormalised, and after ``k`` kept drafts from
``q_k``. The tokens a group yields (kept drafts, then the sampled one) are therefore
distributed exactly as sampling one token at a time would give them. Logprobs are the raw
model's of each token yielded, at its row. Two uniforms per row (acceptance, then the draw),
from the row's generator when it has one; none when every row is greedy, whose
verification is an argmax and a comparison (a sampled row's distribution, one-hot, would
cost a few passes over [rows, V] on the device and some 25 more launches from the host).

Prompt logprobs (``Sampler.prompt_logprobs(logits, targets, k)``): the same raw logprobs of
*given* tokens, one per row (a prompt position's logits and the prompt token that follows
it), with each token's rank and the ``k`` best tokens; nothing is sampled.

History the device alone knows (``PendingTokens``: the tokens of a step still running,
drafts made on the device) counts in steps 2-4 like the rest: the penalties count each
row's ids on the device and min_tokens compares there.

No host-device synchronisation: on CUDA every host value (parameters, row indices, token ids)
reaches the device through a non-blocking copy from pinned memory, sizes that depend on the
data (top-p's candidate count) are replaced by fixed ones, and ``Sampler.sample`` returns
device tensors; ``SampledTokens.to_host`` is the step's one deliberate device-to-host copy.

Reproducibility: a row is sampled by inverse CDF from exactly one uniform number per step,
drawn from the row's own ``generator`` when it has one (else from the sampler's shared one),
and every tensor computed for a row depends on that row alone. A seeded request therefore gets
the same tokens alone or in any batch, at any row position. (An exponential race would need
``V`` random numbers per row; on CPU torch draws those at ~30 ns each, 25 ms for a
16 x 49152 batch, against ~1 ms for the cumulative sum used here.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.base import device_indices, host_to_device
from engine.messages import TokenLogprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured import TokenMask

NEG_INF = float("-inf")
MIN_TEMPERATURE = 1e-5  # smaller positive temperatures are raised to it: logits / t stays finite


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of the logits matrix.

    Token id sequences may be lists or 1-D int64 tensors; a tensor kept by the caller on
    the logits' device (``distinct_ids``) spares converting and copying a long prompt on
    every step when ``repetition_penalty`` is set.
    """

    params: SamplingParams
    generator: torch.Generator | None = None  # from Sampler.new_generator(seed); None: shared
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()  # generated so far
    eos_token_ids: tuple[int, ...] = ()

    def suppressed_stop_ids(self) -> tuple[int, ...]:
        """Ids forbidden this step because ``min_tokens`` has not been reached yet."""
        if len(self.output_token_ids) >= self.params.min_tokens or self.params.grammar:
            return ()
        eos = () if self.params.ignore_eos else tuple(self.eos_token_ids)
        return eos + tuple(self.params.stop_token_ids)

    def needs_processing(self) -> bool:
        """True when steps 1-4 of the module contract change this row's logits."""
        return bool(
            self.params.logit_bias or self.params.needs_penalties or self.suppressed_stop_ids()
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where params.logprobs is None


@dataclass
class SampledTokens:
    """A step's choices, still on the device: ``to_host`` copies them over (it waits for the
    device; everything before it only queues work)."""

    tokens: torch.Tensor  # [N] int64
    logprobs: _DeviceLogprobs | None = None
    _host: tuple[torch.Tensor, _DeviceLogprobs | None] | None = None
    _ready: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        """Queue the copy to the host right behind this step's work (on CUDA), so that
        ``to_host`` waits for this step only, not for a next step queued after it."""
        if self.tokens.is_cuda:
            self._host = (pinned_copy(self.tokens), _pinned_logprobs(self.logprobs))
            self._ready = _recorded()

    def to_host(self) -> SamplerOutput:
        tokens, logprobs = self.tokens, self.logprobs
        if self._host is not None:
            self._ready.synchronize()
            tokens, logprobs = self._host
        token_ids = tokens.tolist()
        if logprobs is None:
            return SamplerOutput(token_ids, [None] * len(token_ids))
        return SamplerOutput(token_ids, logprobs.to_host(len(token_ids)))


def pinned_copy(device: torch.Tensor) -> torch.Tensor:
    """A copy of ``device`` in pinned host memory, queued without waiting."""
    host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
    host.copy_(device, non_blocking=True)
    return host


def _pinned_logprobs(lp: _DeviceLogprobs | None) -> _DeviceLogprobs | None:
    if lp is None:
        return None
    return dataclasses.replace(
        lp, chosen=pinned_copy(lp.chosen), picked=pinned_copy(lp.picked),
        top_values=None if lp.top_values is None else pinned_copy(lp.top_values),
        top_ids=None if lp.top_ids is None else pinned_copy(lp.top_ids),
    )  # fmt: skip


class HostCopy:
    """Device tensors and, on CUDA, their copies to pinned host memory queued behind the
    work queued so far: ``lists`` waits for that work only, not for what is queued after."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._tensors, self._ready = tensors, None
        if tensors and tensors[0].is_cuda:
            self._tensors = tuple(pinned_copy(t) for t in tensors)
            self._ready = _recorded()

    def lists(self) -> list[list]:
        """Each tensor as a (nested) list (the one wait)."""
        if self._ready is not None:
            self._ready.synchronize()
        return [t.tolist() for t in self._tensors]


def _recorded() -> torch.cuda.Event:
    """An event recorded on the current stream: what the copies queued so far wait for."""
    event = torch.cuda.Event()
    event.record()
    return event


class Sampler:
    """Chooses the next token of every row; see the module docstring for the contract."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = self.new_generator(seed)

    def new_generator(self, seed: int) -> torch.Generator:
        """A generator on the sampler's device for a request's ``params.seed``; keep one per
        request for its whole life and pass it in every ``SamplingRow`` of that request."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], mask: TokenMask | None = None
    ) -> SamplerOutput:
        return self.sample(logits, rows, mask).to_host()

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], mask: TokenMask | None = None,
        pending: PendingTokens | None = None,
    ) -> SampledTokens:  # fmt: skip
        """The same choices as ``__call__``, left on the device (queued, never waited for);
        ``pending``: tokens of the rows' histories known on the device only."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {self.vocab_size}")
        if not rows:
            return SampledTokens(torch.empty(0, dtype=torch.long))
        raw = logits[:, : self.vocab_size]
        tokens = self._choose(apply_mask(process_logits(raw, rows, pending), raw, mask), rows)
        return SampledTokens(tokens, token_logprobs_on_device(raw, rows, tokens))

    def prompt_logprobs(
        self, logits: torch.Tensor, targets: torch.Tensor, k: int
    ) -> PromptLogprobs:
        """Raw logprobs of ``targets[i]`` under row ``i`` of ``logits``, left on the device."""
        return prompt_logprobs_on_device(logits[:, : self.vocab_size], targets, k)

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) == len(rows):
            return logits.argmax(-1)
        rest = [i for i, row in enumerate(rows) if not row.params.greedy]
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if greedy:
            tokens[_on(greedy, logits)] = _take(logits, greedy).argmax(-1)
        tokens[_on(rest, logits)] = self._sample(_take(logits, rest), [rows[i] for i in rest])
        return tokens

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Step 7 for rows that are all non-greedy; returns their token ids."""
        return sample_inverse_cdf(filtered_probs(logits, rows), self._uniforms(rows))

    def verify(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        mask: TokenMask | None,
        groups: Sequence[DraftGroup],
        drafts: torch.Tensor | None = None,
        pending: PendingTokens | None = None,
    ) -> VerifiedTokens:
        """Keep or reject each group's drafts and sample the token after the kept ones (the
        module docstring's verification); queued on the device, never waited for.
        ``drafts``: each row's next draft token on the device (-1 at a group's last row),
        in place of the groups' own (placeholders where the device alone knows them);
        ``pending``: tokens of the rows' histories known on the device only (the drafts
        before a row may be there instead of in its ``output_token_ids``)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if sum(g.num_rows for g in groups) != len(rows):
            raise ValueError("draft groups must cover the rows exactly")
        raw = logits[:, : self.vocab_size]
        processed = apply_mask(process_logits(raw, rows, pending), raw, mask)
        # per group, its rows from the first to the last (the group's last row again past
        # it: a row without a draft, never kept), its first row; per row, its group
        width = max(g.num_rows for g in groups)
        starts = np.array([g.row for g in groups], dtype=np.int64)
        sizes = np.array([g.num_draft for g in groups], dtype=np.int64)
        index = starts[:, None] + np.minimum(np.arange(width), sizes[:, None])
        owner = np.repeat(np.arange(len(groups)), sizes + 1)
        host = [index, starts, owner]
        if drafts is None:
            host.append([t for g in groups for t in (*g.draft_token_ids, -1)])
        index, first, owner, *given = device_indices(processed.device, *host)
        drafts = given[0] if given else drafts
        if all(row.params.greedy for row in rows):
            # all mass on the argmax: a draft is kept iff it is the argmax there, and each
            # row yields its argmax (a kept draft's, then the token after the kept ones)
            tokens = processed.argmax(-1)
            keep = drafts == tokens  # a group's last row (-1) never keeps
            kept = keep[index].long().cumprod(1).sum(1)  # [G]: the leading run of kept drafts
        else:
            probs = target_probs(processed, rows)
            has_draft = drafts >= 0
            safe = drafts.clamp(min=0).unsqueeze(1)
            q_draft = probs.gather(1, safe).squeeze(1)
            keep = has_draft & (self._uniforms(rows) < q_draft)
            residual = probs.scatter(1, safe, torch.zeros_like(q_draft).unsqueeze(1))
            residual = torch.where(has_draft.unsqueeze(1), residual, probs)
            empty = residual.sum(-1, keepdim=True) <= 0  # q(d) == 1: that row always keeps
            drawn = sample_inverse_cdf(torch.where(empty, probs, residual), self._uniforms(rows))
            # the yield of row j is its draft while j < kept, then the token drawn at row
            # ``kept``
            kept = keep[index].long().cumprod(1).sum(1)
            offset = torch.arange(len(rows), device=probs.device) - first[owner]
            tokens = torch.where(offset < kept[owner], drafts, drawn[first + kept][owner])
        logprobs = token_logprobs_on_device(raw, rows, tokens)
        return VerifiedTokens(list(groups), tokens, kept, logprobs)

    def _uniforms(self, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One uniform number in [0, 1) per row, from the row's own generator when it has one."""
        u = torch.empty(len(rows), device=self.device)
        shared = [i for i, row in enumerate(rows) if row.generator is None]
        if len(shared) == len(rows):
            return torch.rand(len(rows), device=self.device, generator=self.generator)
        if shared:
            drawn = torch.rand(len(shared), device=self.device, generator=self.generator)
            u[_on(shared, u)] = drawn
        for i, row in enumerate(rows):
            if row.generator is not None:
                u[i] = torch.rand(1, device=self.device, generator=row.generator)[0]
        return u


@dataclass(frozen=True)
class DraftGroup:
    """One request's rows in ``Sampler.verify``: rows ``row .. row + num_draft`` of the
    logits, the draft tokens they check (``draft_token_ids[j]`` follows row ``row + j``)."""

    row: int
    draft_token_ids: list[int]

    @property
    def num_draft(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_rows(self) -> int:
        return len(self.draft_token_ids) + 1


@dataclass
class VerifiedTokens:
    """``Sampler.verify``'s outcome, still on the device: per row the token it yields
    (meaningful up to each group's kept count), per group how many drafts were kept."""

    groups: list[DraftGroup]
    tokens: torch.Tensor  # [R]
    kept: torch.Tensor  # [G]
    logprobs: _DeviceLogprobs | None = None
    _host: tuple[torch.Tensor, torch.Tensor, _DeviceLogprobs | None] | None = None
    _ready: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        """As ``SampledTokens.start_copy``: ``to_host`` then waits for the verification
        only, not for the drafting queued after it."""
        if self.tokens.is_cuda:
            self._host = (pinned_copy(self.tokens), pinned_copy(self.kept),
                          _pinned_logprobs(self.logprobs))  # fmt: skip
            self._ready = _recorded()

    def to_host(self) -> list[tuple[list[int], list[TokenLogprob | None]]]:
        """Per group: the tokens it yields (kept drafts, then the sampled one) and their
        logprobs (None where not asked for)."""
        tokens, kept, logprobs = self.tokens, self.kept, self.logprobs
        if self._host is not None:
            self._ready.synchronize()
            tokens, kept, logprobs = self._host
        tokens, kept = tokens.tolist(), kept.tolist()
        lps = [None] * len(tokens) if logprobs is None else logprobs.to_host(len(tokens))
        out = []
        for g, n in zip(self.groups, kept):
            rows = slice(g.row, g.row + n + 1)
            out.append((tokens[rows], lps[rows]))
        return out


# -- steps 1-4: logits processing -------------------------------------------------------------


@dataclass(frozen=True)
class PendingTokens:
    """Tokens of each row's output history that only the device holds yet, after its
    ``output_token_ids``: ``tokens`` [rows, W] on the device, ``valid`` [rows, W] which of
    them are real. A step planned before the one before it was back has that step's
    tokens here, and a verify row the drafts before it (``engine.runner``)."""

    tokens: torch.Tensor
    valid: torch.Tensor


def process_logits(
    logits: torch.Tensor, rows: Sequence[SamplingRow], pending: PendingTokens | None = None
) -> torch.Tensor:
    """Apply logit bias, min_tokens stop suppression and penalties (steps 1-4), counting
    the ``pending`` tokens in each row's history.

    Returns ``logits`` itself when no row needs any of them, else a processed copy; the
    argument is never modified.
    """
    # a verify step repeats each request's row over its drafts: each one looked at once
    if not any(row.needs_processing() for row in {id(row): row for row in rows}.values()):
        return logits
    out = logits.clone(memory_format=torch.contiguous_format)
    apply_logit_bias(out, rows)
    suppress_stop_tokens(out, rows, pending)
    apply_penalties(out, rows, pending)
    return out


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's ``logit_bias`` in place; ids outside ``[0, V)`` are ignored."""
    vocab = logits.shape[1]
    entries = [
        (i, token, bias)
        for i, row in enumerate(rows)
        for token, bias in row.params.logit_bias.items()
        if 0 <= token < vocab
    ]
    if entries:
        row_ids, token_ids, biases = zip(*entries, strict=True)
        values = _on(biases, logits, logits.dtype)
        logits.index_put_(_index(row_ids, token_ids, logits.device), values, accumulate=True)


def suppress_stop_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], pending: PendingTokens | None = None
) -> None:
    """Set to -inf, in place, the stop ids of rows still short of ``min_tokens`` (counting
    their ``pending`` tokens, on the device)."""
    vocab = logits.shape[1]
    entries = [
        (i, token)
        for i, row in enumerate(rows)
        for token in row.suppressed_stop_ids()
        if 0 <= token < vocab
    ]
    if not entries:
        return
    row_ids, token_ids = zip(*entries, strict=True)
    index = _index(row_ids, token_ids, logits.device)
    # a tensor of -inf, not the float: a Python scalar would be copied over from the host
    fill = torch.full((len(entries),), NEG_INF, dtype=logits.dtype, device=logits.device)
    if pending is not None:
        left = [row.params.min_tokens - len(row.output_token_ids) for row in rows]
        short = _on(left, logits) > pending.valid.sum(1)
        fill = torch.where(short[index[0]], fill, logits[index])
    logits.index_put_(index, fill)


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], pending: PendingTokens | None = None
) -> None:
    """Apply repetition, then frequency and presence penalties, in place, over each row's
    history and its ``pending`` tokens.

    The rows with a penalty get a count of every vocabulary id in their outputs, built on
    the device (where pending tokens are known), and the prompt's ids are marked there for
    the repetition penalty; rows without one are not looked at.
    """
    index = [i for i, row in enumerate(rows) if row.params.needs_penalties]
    if not index:
        return
    vocab = logits.shape[1]
    chosen = [rows[i] for i in index]
    at = _on(index, logits)
    counts = torch.zeros(len(index), vocab, dtype=logits.dtype, device=logits.device)
    outputs = _flat_ids(chosen, vocab, logits)
    counts.view(-1).index_add_(0, outputs, torch.ones_like(outputs, dtype=logits.dtype))
    if pending is not None:
        tokens, valid = pending.tokens[at], pending.valid[at]
        base = torch.arange(len(index), device=logits.device).unsqueeze(1) * vocab
        counts.view(-1).index_add_(0, (base + tokens.clamp(0, vocab - 1)).view(-1),
                                   valid.view(-1).to(logits.dtype))  # fmt: skip
    values = logits[at]
    if any(row.params.repetition_penalty != 1.0 for row in chosen):
        seen = counts > 0
        prompts = _flat_ids(chosen, vocab, logits, outputs=False, prompt=True)
        seen.view(-1).index_fill_(0, prompts, True)
        penalty = _column([row.params.repetition_penalty for row in chosen], logits)
        values = torch.where(seen, torch.where(values > 0, values / penalty, values * penalty),
                             values)  # fmt: skip
    frequency = _column([row.params.frequency_penalty for row in chosen], logits)
    presence = _column([row.params.presence_penalty for row in chosen], logits)
    logits[at] = values - frequency * counts - presence * (counts > 0).to(logits.dtype)


def _flat_ids(
    rows: Sequence[SamplingRow], vocab: int, like: torch.Tensor, outputs: bool = True,
    prompt: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``i * vocab + id`` for every output id (and prompt id if asked) of each row ``i``, on
    ``like``'s device, in a few batched operations whatever the number of rows: the host's
    lists are joined into one copy, tensors (a prompt's ids kept on the device by the
    caller) are joined where they are. The order of the ids is not kept (they are counted)."""
    host: list[int] = []
    host_rows: list[int] = []
    host_lengths: list[int] = []
    kept: list[torch.Tensor] = []
    kept_rows: list[int] = []
    for i, row in enumerate(rows):
        lists = ((row.prompt_token_ids,) if prompt else ()) + (
            (row.output_token_ids,) if outputs else ())  # fmt: skip
        for ids in lists:
            if isinstance(ids, torch.Tensor):
                kept.append(ids)
                kept_rows.append(i)
            elif ids:
                host.extend(ids)
                host_rows.append(i)
                host_lengths.append(len(ids))
    host_ids, starts, lengths = (
        torch.tensor(v, dtype=torch.long) for v in (host, host_rows, host_lengths)
    )
    flat = _on(host_ids + torch.repeat_interleave(starts * vocab, lengths), like)
    if not kept:
        return flat
    kept = [ids.to(like.device, non_blocking=True) for ids in kept]
    sizes = [ids.numel() for ids in kept]
    offsets = torch.repeat_interleave(
        _on(kept_rows, like) * vocab, _on(sizes, like), output_size=sum(sizes)
    )
    return torch.cat([flat, torch.cat(kept) + offsets])


def apply_mask(logits: torch.Tensor, raw: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    """Step 5: forbid what the grammar forbids. ``logits`` is the processed tensor, which may
    be ``raw`` itself: ``raw`` is copied before it is written."""
    if mask is None:
        return logits
    out = logits.clone(memory_format=torch.contiguous_format) if logits is raw else logits
    mask.apply(out)
    return out


# -- step 7: filters and the draw -------------------------------------------------------------


def filtered_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Step 7 without the draw, for non-greedy rows: the distribution that is sampled."""
    temperatures = [max(row.params.temperature, MIN_TEMPERATURE) for row in rows]
    scaled = logits / _column(temperatures, logits)
    apply_top_k(scaled, [row.params.top_k for row in rows])
    apply_top_p(scaled, [row.params.top_p for row in rows])
    apply_min_p(scaled, [row.params.min_p for row in rows])
    return scaled.softmax(-1)


def target_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution each row's token is drawn from, after steps 1-5 (``logits``):
    all mass on the argmax for greedy rows (step 6), step 7's filters for the others."""
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    rest = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not greedy:
        return filtered_probs(logits, rows)
    probs = torch.zeros_like(logits)
    best = _take(logits, greedy).argmax(-1, keepdim=True)
    one_hot = torch.zeros(len(greedy), logits.shape[1], dtype=logits.dtype, device=logits.device)
    _put(probs, greedy, one_hot.scatter_(1, best, 1.0))
    if rest:
        _put(probs, rest, filtered_probs(_take(logits, rest), [rows[i] for i in rest]))
    return probs


def apply_top_k(logits: torch.Tensor, top_k: Sequence[int]) -> None:
    """Keep each row's ``k`` largest logits (and any tied with the k-th), in place.

    ``k == 0`` or ``k >= V`` leaves the row alone.
    """
    index = [i for i, k in enumerate(top_k) if 0 < k < logits.shape[1]]
    if not index:
        return
    ks = [top_k[i] for i in index]
    x = _take(logits, index)
    kth = x.topk(max(ks)).values.gather(1, _on([k - 1 for k in ks], x).unsqueeze(1))
    x.masked_fill_(x < kth, NEG_INF)
    _put(logits, index, x)


def apply_top_p(logits: torch.Tensor, top_p: Sequence[float]) -> None:
    """Keep each row's nucleus, in place: the fewest most likely tokens whose probability mass
    reaches ``p`` (tokens tied with the least likely kept one stay too). ``p == 1``: off.

    Tokens below ``(1 - p) / V`` hold less than ``1 - p`` together, so each nucleus lies among
    the row's other tokens and only those are sorted (a few hundred for a peaked distribution).
    On CUDA the whole row is sorted instead: the candidate count is only known on the device,
    and reading it back would stall the step.
    """
    index = [i for i, p in enumerate(top_p) if p < 1.0]
    if not index:
        return
    x = _take(logits, index)
    probs = x.softmax(-1)
    p = _column([top_p[i] for i in index], probs)
    candidates = (probs >= (1.0 - p) / probs.shape[1]).sum(-1, keepdim=True)
    if probs.is_cuda:
        ordered = probs.sort(-1, descending=True).values
    else:
        ordered = probs.topk(int(candidates.max())).values
    last = (ordered.cumsum(-1) < p).sum(-1, keepdim=True).clamp(max=candidates - 1)
    x.masked_fill_(probs < ordered.gather(1, last), NEG_INF)
    _put(logits, index, x)


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> None:
    """Drop, in place, tokens whose probability is below ``min_p`` times the row's best.

    Done on logits: ``p_i < m * p_max`` iff ``x_i < x_max + log(m)``; renormalising after
    top-k/top-p does not change that ratio. ``min_p == 0``: off.
    """
    index = [i for i, m in enumerate(min_p) if m > 0.0]
    if not index:
        return
    x = _take(logits, index)
    floor = x.amax(-1, keepdim=True) + _column([math.log(min_p[i]) for i in index], x)
    x.masked_fill_(x < floor, NEG_INF)
    _put(logits, index, x)


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids drawn from each row of ``probs`` with the matching uniform in [0, 1).

    Picks the first id whose cumulative probability exceeds ``u * total``; the target is kept
    strictly below the total so that an id with zero probability is never picked.
    """
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


# -- logprobs ---------------------------------------------------------------------------------


@dataclass
class _DeviceLogprobs:
    """Logprobs of the rows ``index`` that asked for them, still on the device."""

    index: list[int]
    ks: list[int]  # alternatives each row asked for
    chosen: torch.Tensor  # [len(index)] the sampled token's logprob
    picked: torch.Tensor  # [len(index)] the sampled token
    top_values: torch.Tensor | None  # [len(index), max(ks)]
    top_ids: torch.Tensor | None

    def to_host(self, num_rows: int) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * num_rows
        chosen, picked = self.chosen.tolist(), self.picked.tolist()
        empty = [[]] * len(self.index)
        top_values = empty if self.top_values is None else self.top_values.tolist()
        top_ids = empty if self.top_ids is None else self.top_ids.tolist()
        for j, (i, k) in enumerate(zip(self.index, self.ks)):
            out[i] = TokenLogprob(picked[j], chosen[j], top_ids[j][:k], top_values[j][:k])
        return out


def token_logprobs_on_device(
    logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor
) -> _DeviceLogprobs | None:
    """Raw-model logprobs of the sampled tokens and of the top alternatives, for the rows
    that asked; None when none did."""
    index = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not index:
        return None
    logprobs = _take(logits, index).log_softmax(-1)
    picked = tokens[_on(index, tokens)] if len(index) < len(rows) else tokens
    chosen = logprobs.gather(1, picked.unsqueeze(1)).squeeze(1)
    ks = [rows[i].params.logprobs for i in index]
    top = logprobs.topk(max(ks)) if max(ks) else None
    return _DeviceLogprobs(index, ks, chosen, picked, top and top.values, top and top.indices)


@dataclass
class PromptLogprobs:
    """Logprobs of given tokens (a prompt's), still on the device; ``to_host`` copies them."""

    targets: torch.Tensor  # [M] the tokens
    chosen: torch.Tensor  # [M] their logprobs
    ranks: torch.Tensor  # [M] 1 + how many tokens are more likely
    top_values: torch.Tensor | None  # [M, k]
    top_ids: torch.Tensor | None

    def to_host(self) -> list[TokenLogprob]:
        targets, chosen, ranks = self.targets.tolist(), self.chosen.tolist(), self.ranks.tolist()
        empty = [[]] * len(targets)
        top_values = empty if self.top_values is None else self.top_values.tolist()
        top_ids = empty if self.top_ids is None else self.top_ids.tolist()
        return [
            TokenLogprob(t, lp, ids, values, rank)
            for t, lp, rank, ids, values in zip(targets, chosen, ranks, top_ids, top_values)
        ]


def prompt_logprobs_on_device(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> PromptLogprobs:
    """Raw-model logprobs of ``targets[i]`` under row ``i`` of ``logits``, their ranks and the
    ``k`` best tokens of each row."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(-1) + 1
    top = logprobs.topk(k) if k else None
    return PromptLogprobs(targets, chosen, ranks, top and top.values, top and top.indices)


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor
) -> list[TokenLogprob | None]:
    """Raw-model logprobs of the sampled tokens and of the top alternatives, per row."""
    lp = token_logprobs_on_device(logits, rows, tokens)
    return [None] * len(rows) if lp is None else lp.to_host(len(rows))


# -- helpers ----------------------------------------------------------------------------------


def _take(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """Rows ``index`` of ``x``: ``x`` itself when that is every row, else a copy."""
    return x if len(index) == x.shape[0] else x[_on(index, x)]


def _put(x: torch.Tensor, index: list[int], rows: torch.Tensor) -> None:
    """Write back rows taken with ``_take``."""
    if rows is x:
        return
    if len(index) == x.shape[0]:
        x.copy_(rows)
    else:
        x[_on(index, x)] = rows


def _on(
    values: Sequence[float] | torch.Tensor, like: torch.Tensor, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """Host values as a tensor on ``like``'s device, without waiting for the device: a CUDA
    copy goes from pinned memory, asynchronously (a plain host-to-device copy synchronises)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return host_to_device(host, like.device)


def distinct_ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``ids``' distinct values on ``device``: a prompt as its ``SamplingRow`` keeps it for
    the repetition penalty, converted and copied once rather than on every step."""
    return host_to_device(torch.tensor(ids, dtype=torch.long).unique(), device)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return _on(values, like, like.dtype).unsqueeze(1)


def _index(
    row_ids: Sequence[int], token_ids: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    like = torch.empty(0, device=device)
    return _on(row_ids, like), _on(token_ids, like)
