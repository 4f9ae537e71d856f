"""Drafting by running a small model forward one token at a time, for several requests.

``chain`` is what the model drafters share (``draft_model``, ``mtp``): from each request's
logits for its first draft, take the most likely token, its confidence (the model's own
probability of it at that position's calibration temperature), and feed it back for the
next, until the request has its drafts or runs out of KV slots. ``forward(active,
tokens, positions)`` is the model's one-token step for the requests still drafting
(``tokens`` on the device, ``positions`` host ints); it writes their KV at ``positions``
(slots the scheduler keeps for the lookahead) and returns their logits.

Which requests go on at each depth depends only on their room and KV slots, known on
the host, so the chain never waits for the device between depths: the drafts and their
confidences come back in one copy at the end (each depth read back cost one wait for
the device, K - 1 of them a step for K drafts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import host_to_device
from engine.config import SpeculativeConfig


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


def chain(
    config: SpeculativeConfig,
    first_logits: torch.Tensor,
    starts: Sequence[ChainStart],
    forward: Callable[[list[int], torch.Tensor, list[int]], torch.Tensor],
    vocab_size: int,
) -> list[tuple[list[int], list[float]]]:
    """Per start: its draft tokens and their confidences (module docstring)."""
    out: list[tuple[list[int], list[float]]] = [([], []) for _ in starts]
    if not starts:
        return out
    device = first_logits.device

    def index(rows: list[int]) -> torch.Tensor:  # to the device without waiting
        return host_to_device(np.array(rows, dtype=np.int64), device)

    logits = first_logits[index([s.row for s in starts])][:, :vocab_size]
    active = list(range(len(starts)))
    depths: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (active, tokens, conf)
    for depth in range(max(s.room for s in starts)):
        tokens = logits.argmax(-1)
        conf = confidences(logits, tokens, config.temperature(depth)).clamp(0.0, 1.0)
        depths.append((active, tokens, conf))
        keep = [
            k for k, i in enumerate(active)
            if depth + 1 < starts[i].room and starts[i].position + depth < starts[i].limit
        ]  # fmt: skip
        if not keep:
            break
        positions = [starts[active[k]].position + depth for k in keep]
        active = [active[k] for k in keep]
        tokens = tokens[index(keep)]
        logits = forward(active, tokens, positions)[:, :vocab_size]
    all_tokens = torch.cat([t for _, t, _ in depths]).tolist()  # the one wait
    all_conf = torch.cat([c for _, _, c in depths]).tolist()
    at = 0
    for rows, _, _ in depths:
        for i in rows:
            out[i][0].append(all_tokens[at])
            out[i][1].append(all_conf[at])
            at += 1
    return out
