"""Prompt lookup: the continuation of the longest recent match, no weights.

For each request the drafter indexes every n-gram (``ngram_min`` .. ``ngram_max`` tokens)
of prompt + output by where it last ended. To propose, it looks up the sequence's own
last n tokens, longest n first, and proposes the up to K tokens that followed their most
recent earlier occurrence: code being edited, a document being quoted, a list being
continued repeat themselves.

Confidence comes from match statistics kept online: per draft position and match length,
how often a draft at that position was kept when verified (given the ones before it
were), over all requests, as the prior of the same count kept per request, whose weight
decays so that a request that stops repeating itself loses its confidence within a few
steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.plan import NewRequest
from engine.spec.base import Drafter, DraftStep, Proposal

PRIOR_WEIGHT = 4.0  # the global statistics count as this many observations of a request
DECAY = 0.8  # each update keeps this share of a request's older observations


@dataclass
class _Counts:
    """Kept / tested counts of one position."""

    kept: float = 0.0
    tested: float = 0.0

    def rate(self, prior: float, weight: float) -> float:
        return (self.kept + weight * prior) / (self.tested + weight)


@dataclass
class _RequestIndex:
    """One request's n-gram index and its own acceptance counts."""

    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end index
    indexed: int = 0  # n-grams ending before this index are in ``last_end``
    counts: list[_Counts] = field(default_factory=list)
    match_len: int = 0  # the match length of its latest proposal


class NgramDrafter(Drafter):
    name = "ngram"
    sees_every_step = False  # a request's index catches up with its tokens when it proposes

    def __init__(self, max_draft: int, ngram_min: int = 1, ngram_max: int = 4) -> None:
        super().__init__(max_draft)
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._requests: dict[str, _RequestIndex] = {}
        # (match length, position) -> counts over every request
        self._global: dict[tuple[int, int], _Counts] = {}

    def add(self, new: NewRequest) -> None:
        self._requests[new.request_id] = _RequestIndex(
            counts=[_Counts() for _ in range(self.max_draft)]
        )

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def observe(self, request_id: str, num_verified: int, num_kept: int) -> None:
        index = self._requests.get(request_id)
        if index is None or not num_verified:
            return
        for c in index.counts:
            c.kept *= DECAY
            c.tested *= DECAY
        for j in range(min(num_kept + 1, num_verified)):  # position j was tested
            kept = 1.0 if j < num_kept else 0.0
            index.counts[j].kept += kept
            index.counts[j].tested += 1.0
            g = self._global.setdefault((index.match_len, j), _Counts())
            g.kept += kept
            g.tested += 1.0

    def propose(self, step: DraftStep) -> dict[str, Proposal]:
        out = {}
        for r in step.requests:
            index = self._requests.get(r.request_id)
            if index is None:
                continue
            tokens = list(r.token_ids)
            self._index(index, tokens)
            found = self._lookup(index, tokens, min(r.num_draft, self.max_draft))
            if found is None:
                continue
            n, drafts = found
            index.match_len = n
            confidence = [
                index.counts[j].rate(self._prior(n, j), PRIOR_WEIGHT) for j in range(len(drafts))
            ]
            out[r.request_id] = Proposal(len(tokens), drafts, confidence)
        return out

    def _prior(self, n: int, j: int) -> float:
        g = self._global.get((n, j))
        return 0.5 if g is None else (g.kept + 1.0) / (g.tested + 2.0)

    def _index(self, index: _RequestIndex, tokens: list[int]) -> None:
        """Add the n-grams that end before the sequence's last token (so a lookup of the
        sequence's suffix never finds the suffix itself)."""
        for end in range(index.indexed, len(tokens) - 1):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end - n + 1 < 0:
                    break
                index.last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        index.indexed = max(index.indexed, len(tokens) - 1)

    def _lookup(
        self, index: _RequestIndex, tokens: list[int], k: int
    ) -> tuple[int, list[int]] | None:
        """(match length, the tokens after the most recent earlier occurrence of the
        longest matching suffix), or None."""
        if k <= 0:
            return None
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            end = index.last_end.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return n, tokens[end + 1 : end + 1 + k]
        return None
