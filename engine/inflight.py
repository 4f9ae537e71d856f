"""What a launched step leaves on the device for the step planned after it.

Under overlap scheduling (``engine.core``) step N+1 is planned and launched before step N's
tokens reach the host. ``LeftBehind`` indexes what N left on the device: the tokens it
sampled, the tokens its verification yielded and how many drafts each request kept, the
drafts made behind it. From it the runner fills in N+1's inputs on the device
(``resolve``: placeholder tokens, rows moved back by rejected drafts) and gives the sampler
the history only the device has (``pending``: penalties and min_tokens count those
tokens). ``Clock`` marks a step's phases on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.base import (
    AttentionMetadata,
    device_indices,
    host_to_device,
    move_back,
)
from engine.request import UNRESOLVED, draft_index
from engine.sampler import PendingTokens, VerifiedTokens


class Clock:
    """Marks a step's phases: CUDA events on the GPU (read once the step is waited
    for), the host clock elsewhere (where the host runs the work itself)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list = []
        self._gaps: set[int] = set()  # spans that are not the step's (``gap``)
        self.mark()

    def gap(self) -> None:
        """Mark the end of a wait that is not the step's own work: the span up to here
        is left out of ``spans``."""
        self._gaps.add(len(self._marks) - 1)
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks (once the device has passed them)."""
        m = self._marks
        if self.cuda:
            m[-1].synchronize()
            spans = [a.elapsed_time(b) / 1e3 for a, b in zip(m, m[1:])]
        else:
            spans = [b - a for a, b in zip(m, m[1:])]
        return [span for i, span in enumerate(spans) if i not in self._gaps]


@dataclass
class LeftBehind:
    """What the last launch left on the device for the next one's inputs: the tokens it
    sampled (``plain``, by request), the tokens its verification yielded and how many
    drafts each group kept (``verify``: request -> group), and the drafts made behind it
    (``drafted``: request -> row of ``drafts`` [requests, K])."""

    plain: dict[str, int] = field(default_factory=dict)
    plain_tokens: torch.Tensor | None = None
    verify: dict[str, int] = field(default_factory=dict)
    verified: VerifiedTokens | None = None
    drafted: dict[str, int] = field(default_factory=dict)
    drafts: torch.Tensor | None = None

    def source(self, like: torch.Tensor) -> torch.Tensor:
        """Every token left on the device, as one flat tensor to index: the sampled ones,
        the verified ones (``verified_at``), the drafts (``_sources``), then a 0 (its last
        element: padding, or a draft the drafter had no room for, which any token
        verifies exactly)."""
        parts = [t.reshape(-1) for t in (self.plain_tokens, self.verified and self.verified.tokens,
                                         self.drafts) if t is not None]  # fmt: skip
        return torch.cat(parts + [like.new_zeros(1)])

    @property
    def _num_plain(self) -> int:
        return 0 if self.plain_tokens is None else self.plain_tokens.numel()

    def verified_at(self, request_id: str) -> int:
        """Where in ``source`` the first token the request's verification yielded is."""
        return self._num_plain + self.verified.groups[self.verify[request_id]].row

    def resolve(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        host_ids: np.ndarray, owners: list[str], block_size: int,
    ) -> torch.Tensor | None:  # fmt: skip
        """Fill in, in the device tensors of the next step (copies of its host values),
        what this launch left on the device (``owners[i]``: the request of row ``i``):

        - an UNRESOLVED token is the one that step sampled for its request, or the token
          its verification yielded after the drafts kept;
        - an ``unresolved_draft`` placeholder is that draft made behind it;
        - the rows of a request whose drafts that step verified move back by the drafts
          it rejected (the plan placed them as if all were kept): positions, context
          lengths and KV slots; returns how far each row moved (None: none did).

        Such a request's rows must be one-token sequences (``plan.one_token_rows``): only the
        device knows their lengths, which the attention backends read there for one-token
        sequences (``AttentionMetadata``)."""
        n = len(owners)
        where = np.flatnonzero(host_ids[:n] < 0)
        # planned before that step's outcome (its tokens are placeholders here)
        assumed = {owners[i] for i in where}
        moved = [i for i, rid in enumerate(owners) if rid in self.verify and rid in assumed]
        if not len(where) and not moved:
            return None
        verified = self.verified
        if len(where):
            flat = self.source(ids)
            source, follows = self._sources(host_ids[where], [owners[i] for i in where],
                                            flat.numel())  # fmt: skip
        else:
            source = follows = np.zeros(0, np.int64)
        # the sequence of each row (a CUDA graph's buffers hold more rows than the step)
        seq_of = np.repeat(np.arange(meta.num_seqs), meta.query_lens_cpu)[:n]
        if moved and (len(seq_of) < n or any(meta.query_lens_cpu[seq_of[i]] != 1 for i in moved)):
            raise RuntimeError("a request whose drafts are still being verified must run "
                               "one-token rows in the step after")  # fmt: skip
        groups = [self.verify[owners[i]] for i in moved]
        where, source, follows, moved, seqs, groups, drafts = device_indices(
            ids.device, where, source, follows, moved, seq_of[moved], groups,
            [verified.groups[g].num_draft for g in groups],
        )  # fmt: skip
        if len(where):
            if verified is not None:  # a 0 past the groups' counts: for those following none
                source = source + torch.cat((verified.kept, verified.kept.new_zeros(1)))[follows]
            ids[where] = flat[source]
        if not len(moved):
            return None
        rejected = drafts - verified.kept[groups]
        move_back(meta, positions, moved, seqs, rejected, block_size)
        shift = torch.zeros(n, dtype=torch.long, device=ids.device)
        shift[moved] = rejected
        return shift

    def _sources(self, placeholders: np.ndarray, owners: list[str],
                 size: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """Per placeholder (of request ``owners[j]``): where its token is in ``source``
        (``size`` elements), before the kept drafts of the group it follows, and that
        group (past the groups: it follows none)."""
        verified = self.verified
        num_groups = 0 if verified is None else len(verified.groups)
        plain = np.fromiter((self.plain.get(r, -1) for r in owners), np.int64, len(owners))
        group = np.fromiter((self.verify.get(r, -1) for r in owners), np.int64, len(owners))
        drafted = np.fromiter((self.drafted.get(r, -1) for r in owners), np.int64, len(owners))
        sampled = placeholders == UNRESOLVED
        follows = np.where(sampled & (plain < 0) & (group >= 0), group, num_groups)
        firsts = np.array([g.row for g in verified.groups] if verified else [0], np.int64)
        first = self._num_plain + firsts[group.clip(0, len(firsts) - 1)]
        source = np.where(plain >= 0, plain, first)  # + the kept count of the group
        # draft j made behind the step: the last element (a 0) where none was made
        width = 0 if self.drafts is None else self.drafts.shape[1]
        j = draft_index(placeholders)
        made = (drafted >= 0) & (j < width)
        verified_tokens = 0 if verified is None else verified.tokens.numel()
        at = np.where(made, self._num_plain + verified_tokens + drafted * width + j, size - 1)
        return np.where(sampled, source, at), follows

    def pending(self, request_ids: list[str], unresolved: frozenset[str], ids: torch.Tensor,
                before: list[list[int]] | None = None) -> PendingTokens | None:  # fmt: skip
        """Per row (of the next step's ``request_ids``), the tokens of its history that
        only the device holds: what this launch yielded for its request when the next step
        was planned before that was back (``unresolved``), then the input tokens of the
        next step's rows ``before`` it (a verify row's drafts), read from ``ids``, its input
        tokens on the device. None when there are none."""
        if unresolved.isdisjoint(request_ids) and not any(before or ()):
            return None
        device = ids.device
        verified = self.verified
        flat = self.source(ids)
        width = max((verified.groups[self.verify[r]].num_rows if r in self.verify else 1
                     for r in request_ids if r in unresolved), default=0)  # fmt: skip
        index = np.full((len(request_ids), max(width, 1)), flat.numel() - 1, np.int64)
        group = np.full(index.shape, -1, np.int64)  # real while ``j`` <= the group's kept
        real = np.zeros(index.shape, bool)
        for i, rid in enumerate(request_ids):
            if rid not in unresolved:
                continue
            if rid in self.plain:
                index[i, 0], real[i, 0] = self.plain[rid], True
            else:
                g = verified.groups[self.verify[rid]]
                index[i, : g.num_rows] = self.verified_at(rid) + np.arange(g.num_rows)
                group[i, : g.num_rows], real[i, : g.num_rows] = self.verify[rid], True
        tokens = flat[host_to_device(index, device)]
        valid = host_to_device(real, device)
        if verified is not None and (group >= 0).any():
            kept = verified.kept[host_to_device(np.maximum(group, 0), device)]
            j = torch.arange(index.shape[1], device=device)
            valid = valid & ((host_to_device(group, device) < 0) | (j <= kept))
        if before is not None and any(before):
            rows = np.zeros((len(before), max(map(len, before))), np.int64)
            mine = np.zeros(rows.shape, bool)
            for i, b in enumerate(before):
                rows[i, : len(b)], mine[i, : len(b)] = b, True
            tokens = torch.cat((tokens, ids[host_to_device(rows, device)]), 1)
            valid = torch.cat((valid, host_to_device(mine, device)), 1)
        return PendingTokens(tokens, valid)
