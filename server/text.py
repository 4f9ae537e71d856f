"""Incremental detokenization of one generated sequence, with stop strings.

``TextStream`` turns token ids into text and decides which text may be sent. With
stop strings it holds back any tail of the text that could be the start of one, so a
partial stop string is never sent; when a stop string completes, the text is cut
right before it (OpenAI semantics: the stop string is not part of the output).

Tokens are *released* together with text so that per-token data (logprobs, text
offsets) travels with the text it produced: while streaming, a token is released once
all of its text has been; at a stop string, the tokens that start before the cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class StepDecoder(Protocol):
    def step(self, token_id: int) -> str: ...


@dataclass(frozen=True)
class TextDelta:
    """Text released by one ``add``/``finish`` call and the tokens released with it.

    ``first_token`` indexes the sequence's generated tokens; ``offsets[j]`` is where
    token ``first_token + j`` starts in the sequence's text.
    """

    text: str
    first_token: int
    offsets: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.offsets)


class TextStream:
    """Detokenizes one sequence incrementally and applies ``stop`` strings.

    Contract: the concatenation of all released ``TextDelta.text`` equals ``text``
    once ``stopped`` or after ``finish()``; it never contains a stop string, and no
    released text is ever retracted.
    """

    def __init__(self, decoder: StepDecoder, stop: list[str] | None = None) -> None:
        self._decoder = decoder
        self._stops = [s for s in stop or [] if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""
        self.stopped = False
        self._sent = 0  # characters of ``text`` released
        self._ends: list[int] = []  # text length after each token
        self._released = 0  # tokens released

    def add(self, token_ids: list[int]) -> TextDelta:
        """Decode ``token_ids``; release what is safe to send (everything up to a stop)."""
        if self.stopped:
            raise RuntimeError("add() after a stop string")
        for token_id in token_ids:
            piece = self._decoder.step(token_id)
            search_from = max(0, len(self.text) - self._longest + 1)
            self.text += piece
            self._ends.append(len(self.text))
            cut = self._find_stop(search_from) if piece and self._stops else None
            if cut is not None:
                return self._stop_at(cut)
        return self._release(max(self._sent, len(self.text) - self._held()))

    def finish(self) -> TextDelta:
        """Release everything left (the sequence ended without a stop string)."""
        return self._release(len(self.text), len(self._ends))

    def _find_stop(self, start: int) -> int | None:
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _held(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def _stop_at(self, cut: int) -> TextDelta:
        self.text = self.text[:cut]
        self.stopped = True
        count = self._released
        while count < len(self._ends) and (self._ends[count - 1] if count else 0) < cut:
            count += 1
        return self._release(cut, count)

    def _release(self, end: int, count: int | None = None) -> TextDelta:
        """Release text up to ``end`` and the first ``count`` tokens (default: the tokens
        whose text lies entirely before ``end``)."""
        if count is None:
            count = self._released
            while count < len(self._ends) and self._ends[count] <= end:
                count += 1
        first = self._released
        offsets = [self._ends[i - 1] if i else 0 for i in range(first, count)]
        delta = TextDelta(self.text[self._sent : end], first, offsets)
        self._sent, self._released = end, count
        return delta
