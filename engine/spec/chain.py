"""Drafting by running a small model forward one token at a time, for several requests.

``launch_chain`` is what the model drafters share (``draft_model``, ``mtp``): from each
request's logits for its first draft, take the most likely token, its confidence (the
model's own probability of it at that position's calibration temperature), and feed it
back for the next, until the request has its drafts or runs out of KV slots.
``forward(active, tokens, positions)`` is the model's one-token step for the requests
still drafting (``tokens`` on the device, ``positions`` host ints, as planned: a drafter
moves them back on the device where its step was planned before the one before it was
known); it writes their KV there (slots the scheduler keeps for the lookahead) and
returns their logits.

Which requests go on at each depth depends only on their room and KV slots, known on
the host, so the chain never waits for the device between depths. It only queues work:
a drafter queues it behind the step whose outputs it drafts from, and the drafts and
their confidences come back in one copy once that step is collected (``Chained``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.attention.base import device_index
from engine.config import SpeculativeConfig
from engine.sampler import HostCopy


@dataclass(frozen=True)
class ChainStart:
    """One request about to draft: its first draft's logits are row ``row`` of the first
    logits; its next input goes at ``position``; ``room`` drafts at most; positions at or
    past ``limit`` have no KV slot."""

    row: int
    position: int
    room: int
    limit: int


def confidences(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """The probability of ``tokens`` under ``logits / temperature`` (one per row)."""
    probs = (logits.float() / temperature).softmax(-1)
    return probs.gather(1, tokens.unsqueeze(1)).squeeze(1)


@dataclass
class Chained:
    """A chain queued on the device: per depth, the starts still drafting and their
    tokens and confidences."""

    num_starts: int
    depths: list[tuple[list[int], torch.Tensor, torch.Tensor]]
    _copy: HostCopy | None = None
    _flat_tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of_flat(cls, num_starts: int, rows: list[list[int]], tokens: torch.Tensor,
                conf: torch.Tensor) -> Chained:  # fmt: skip
        """A chain from every depth's tokens and confidences in one tensor each, depth
        after depth (``rows[depth]``: the starts drafting at that depth)."""
        depths, at = [], 0
        for active in rows:
            depths.append((active, tokens[at : at + len(active)], conf[at : at + len(active)]))
            at += len(active)
        chained = cls(num_starts, depths)
        chained._flat_tensors = (tokens, conf)
        return chained

    def start_copy(self) -> None:
        """Queue the copy to the host behind the chain (on CUDA), so that ``to_host``
        waits for the chain only."""
        if self.depths:
            self._copy = HostCopy(*self._flat())

    def _flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every depth's tokens and confidences, depth after depth (made once)."""
        if self._flat_tensors is None:
            self._flat_tensors = (torch.cat([t for _, t, _ in self.depths]),
                                  torch.cat([c for _, _, c in self.depths]))  # fmt: skip
        return self._flat_tensors

    def as_table(self, width: int) -> torch.Tensor:
        """The drafts as a device table [starts, width], row ``i`` start ``i``'s (0 past
        its last draft)."""
        device = self.depths[0][1].device
        table = torch.zeros(self.num_starts * width, dtype=torch.long, device=device)
        at = [i * width + depth for depth, (rows, _, _) in enumerate(self.depths) for i in rows]
        table[device_index(at, device)] = self._flat()[0]
        return table.view(self.num_starts, width)

    def to_host(self) -> list[tuple[list[int], list[float]]]:
        """Per start: its draft tokens and their confidences (the one wait)."""
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in range(self.num_starts)]
        if not self.depths:
            return out
        all_tokens, all_conf = (self._copy or HostCopy(*self._flat())).lists()
        at = 0
        for rows, _, _ in self.depths:
            for i in rows:
                out[i][0].append(all_tokens[at])
                out[i][1].append(all_conf[at])
                at += 1
        return out


def launch_chain(
    config: SpeculativeConfig,
    first_logits: torch.Tensor,
    starts: Sequence[ChainStart],
    forward: Callable[[list[int], torch.Tensor, list[int]], torch.Tensor],
    vocab_size: int,
) -> Chained:
    """Queue the chain of every start (module docstring); nothing waits for the device.
    ``first_logits``' rows are the starts' (``ChainStart.row``)."""
    if not starts:
        return Chained(0, [])
    device = first_logits.device

    logits = first_logits[device_index([s.row for s in starts], device)][:, :vocab_size]
    active = list(range(len(starts)))
    depths: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (active, tokens, conf)
    for depth in range(max(s.room for s in starts)):
        tokens = logits.argmax(-1)
        conf = confidences(logits, tokens, config.temperature(depth))
        conf = conf.nan_to_num(0.0).clamp(0.0, 1.0)  # a draft of NaN logits: never kept
        depths.append((active, tokens, conf))
        keep = [
            k for k, i in enumerate(active)
            if depth + 1 < starts[i].room and starts[i].position + depth < starts[i].limit
        ]  # fmt: skip
        if not keep:
            break
        positions = [starts[active[k]].position + depth for k in keep]
        active = [active[k] for k in keep]
        tokens = tokens[device_index(keep, device)]
        logits = forward(active, tokens, positions)[:, :vocab_size]
    return Chained(len(starts), depths)

