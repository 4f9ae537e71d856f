"""Prompt lookup: the continuation of the longest recent match, no weights.

For each request the drafter looks up the sequence's own last n tokens (``ngram_min`` ..
``ngram_max``, longest n first) among its earlier tokens and proposes the up to K tokens
that followed their most recent earlier occurrence: code being edited, a document being
quoted, a list being continued repeat themselves.

It drafts on the device (``Drafter.on_device``), right behind each step, so the step
after a verify step is planned before its outcome, as with the model drafters. Each
request has a row of a token table there: the step's rows write the token that follows
each (``LaunchStep.next_ids``, sampled and verified tokens included) at the position
after it, so the table holds the request's sequence up to the token after its kept
drafts; rows past those write past it, where later steps write again before a lookup
reads. A request the drafter has not seen yet (new, or a decode worker's) first gets its
context from the host's tokens. The lookup compares the sequence's last token with every
earlier position, then the one before it with every position before those, and so on:
the matches of each length n ending at each position, for every request at once
(R x L x ``ngram_max`` comparisons, no index to keep).

Confidence comes from match statistics kept online, on the host when the drafts are read
back: per draft position and match length, how often a draft at that position was kept
when verified (given the ones before it were), over all requests, as the prior of the
same count kept per request, whose weight decays so that a request that stops repeating
itself loses its confidence within a few steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.base import device_index, host_to_device
from engine.plan import NewRequest
from engine.sampler import HostCopy
from engine.spec.base import Drafter, Drafting, LaunchStep

PRIOR_WEIGHT = 4.0  # the global statistics count as this many observations of a request
DECAY = 0.8  # each update keeps this share of a request's older observations
NO_TOKEN = -1  # before a sequence's first position: matches no token


@dataclass
class _Counts:
    """Kept / tested counts of one position."""

    kept: float = 0.0
    tested: float = 0.0

    def rate(self, prior: float, weight: float) -> float:
        return (self.kept + weight * prior) / (self.tested + weight)


@dataclass
class _Request:
    """One request: its row of the token table and its own acceptance counts."""

    row: int
    counts: list[_Counts]
    fresh: bool = True  # its context is not in its row yet
    match_len: int = 0  # the match length of its latest proposal
    found: int = 0  # how many drafts its latest proposal had


@dataclass
class _NgramDrafting(Drafting):
    """``Drafting`` of a lookup: per drafting request its drafts on the device (``tokens``,
    a table, 0 past the last), and those, how many and the match length copied to the
    host behind them (``copy``); the confidences come from the drafter's statistics."""

    tokens: torch.Tensor | None = None  # [R, width]
    copy: HostCopy | None = None
    drafter: NgramDrafter | None = field(default=None, repr=False)

    def to_host(self) -> dict[str, tuple[list[int], list[float]]]:
        if self.copy is None:
            return {}
        tokens, counts, lengths = self.copy.lists()
        return {rid: self.drafter.found(rid, row[:c], n)
                for rid, row, c, n in zip(self.request_ids, tokens, counts, lengths)}  # fmt: skip

    def table(self, width: int) -> torch.Tensor:
        assert self.tokens is not None
        return F.pad(self.tokens, (0, width - self.tokens.shape[1]))


class NgramDrafter(Drafter):
    name = "ngram"
    on_device = True

    def __init__(self, max_draft: int, ngram_min: int = 1, ngram_max: int = 4) -> None:
        super().__init__(max_draft)
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._requests: dict[str, _Request] = {}
        self._free: list[int] = []  # rows of the table no request holds
        self._table: torch.Tensor | None = None  # [rows, capacity] tokens, on the device
        # (match length, position) -> counts over every request
        self._global: dict[tuple[int, int], _Counts] = {}

    def add(self, new: NewRequest) -> None:
        row = self._free.pop() if self._free else len(self._requests)
        self._requests[new.request_id] = _Request(row, [_Counts() for _ in range(self.max_draft)])

    def drop(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._free.append(request.row)

    def reset(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            request.fresh = True

    def observe(self, request_id: str, num_verified: int, num_kept: int) -> None:
        request = self._requests.get(request_id)
        # a step planned before its drafts were known may verify more than were found
        num_verified = min(num_verified, request.found) if request is not None else 0
        if not num_verified:
            return
        for c in request.counts:
            c.kept *= DECAY
            c.tested *= DECAY
        for j in range(min(num_kept + 1, num_verified)):  # position j was tested
            kept = 1.0 if j < num_kept else 0.0
            request.counts[j].kept += kept
            request.counts[j].tested += 1.0
            g = self._global.setdefault((request.match_len, j), _Counts())
            g.kept += kept
            g.tested += 1.0

    def found(self, request_id: str, drafts: list[int], n: int) -> tuple[list[int], list[float]]:
        """The drafts a lookup found for the request (match length ``n``) and their
        confidences; remembered for ``observe``."""
        request = self._requests.get(request_id)
        if request is None:
            return [], []
        request.match_len, request.found = n, len(drafts)
        confidence = [request.counts[j].rate(self._prior(n, j), PRIOR_WEIGHT)
                      for j in range(len(drafts))]  # fmt: skip
        return drafts, confidence

    def _prior(self, n: int, j: int) -> float:
        g = self._global.get((n, j))
        return 0.5 if g is None else (g.kept + 1.0) / (g.tested + 2.0)

    def launch(self, step: LaunchStep) -> Drafting:
        """Write the step's tokens into the table, then look up the drafting requests'
        suffixes (module docstring), all queued."""
        chunks, rows = step.rows_of(lambda c: c.request_id in self._requests)
        if not chunks:
            return _NgramDrafting([])
        device = step.next_ids.device
        need = max(c.end_pos for c in step.chunks) + self.max_draft + 2
        table = self._grown(need, device)
        width = table.shape[1]
        for c in chunks:  # a context the table does not hold yet, from the host
            request = self._requests[c.request_id]
            if request.fresh:
                context = np.asarray(step.context(c.request_id)[: width - 1], dtype=np.int32)
                table[request.row, : len(context)] = host_to_device(context, device)
                request.fresh = False
        index = device_index(rows, device)
        positions, _ = step.row_positions(chunks, index)
        owners = np.repeat([self._requests[c.request_id].row for c in chunks],
                           [c.num_tokens for c in chunks])  # fmt: skip
        at = device_index(owners, device) * width + (positions + 1).clamp(max=width - 1)
        table.view(-1).index_copy_(0, at, step.next_ids[index].to(table.dtype))
        if not step.requests:
            return _NgramDrafting([])
        tokens, counts, match_len = self._lookup(step, table, device)
        return _NgramDrafting([r.request_id for r in step.requests], tokens=tokens,
                              copy=HostCopy(tokens, counts, match_len), drafter=self)  # fmt: skip

    def _lookup(
        self, step: LaunchStep, table: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per drafting request: the tokens after the most recent earlier occurrence of
        its longest matching suffix (``ngram_min`` .. ``ngram_max`` tokens), if any (a
        table [R, width], 0 past them), how many, and the match length."""
        requests = step.requests
        span = max(step.bounds) + 1  # every sequence is at most this long
        seqs = table[device_index([self._requests[r.request_id].row for r in requests], device),
                     :span]  # fmt: skip
        lengths = device_index(step.bounds, device) - step.back + 1  # [R]
        ends = torch.arange(span, device=device)
        # a match ends at e <= L - 2: before the sequence's last token
        matching = ends[None, :] <= (lengths - 2)[:, None]  # [R, span]
        last = torch.full((len(requests),), -1, dtype=torch.long, device=device)
        match_len = torch.zeros_like(last)
        for i in range(self.ngram_max):  # the suffix's i-th token from its end
            suffix = seqs.gather(1, (lengths - 1 - i).clamp(min=0)[:, None])  # [R, 1]
            shifted = F.pad(seqs, (i, 0), value=NO_TOKEN)[:, :span]  # token at e - i
            matching &= shifted == suffix
            n = i + 1
            if n >= self.ngram_min:
                end = torch.where(matching, ends, -1).amax(1)
                hit = end >= 0
                last, match_len = torch.where(hit, end, last), torch.where(hit, n, match_len)
        width = max(r.num_draft for r in requests)
        room = device_index([r.num_draft for r in requests], device)
        count = torch.where(last >= 0, torch.minimum(room, lengths - 1 - last), 0)
        j = torch.arange(width, device=device)
        tokens = seqs.gather(1, (last[:, None] + 1 + j).clamp(0, span - 1)).long()
        tokens = torch.where(j < count[:, None], tokens, 0)
        return tokens, count, match_len

    def _grown(self, capacity: int, device: torch.device) -> torch.Tensor:
        """The token table, with a row for every request and at least ``capacity``
        positions (grown by doubling)."""
        rows = len(self._requests) + len(self._free)  # every row handed out so far
        table = self._table
        if table is None or table.shape[0] < rows or table.shape[1] < capacity:
            old_rows, old_cap = (0, 0) if table is None else table.shape
            grown = torch.full((max(rows, 2 * old_rows, 8), max(capacity, 2 * old_cap, 256)),
                               NO_TOKEN, dtype=torch.int32, device=device)  # fmt: skip
            if table is not None:
                grown[:old_rows, :old_cap] = table
            self._table = table = grown
        return table
