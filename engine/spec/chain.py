"""Drafting by running a small model forward one token at a time, for several requests.

``chain`` is what the model drafters share (``draft_model``, ``mtp``): from each request's
logits for its first draft, take the most likely token, its confidence (the model's own
probability of it at that position's calibration temperature), and feed it back for the
next, until the request has its drafts or runs out of KV slots. ``forward(active,
tokens, positions)`` is the model's one-token step for the requests still drafting; it
writes their KV at ``positions`` (slots the scheduler keeps for the lookahead) and
returns their logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

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
    forward: Callable[[list[int], torch.Tensor, torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> list[tuple[list[int], list[float]]]:
    """Per start: its draft tokens and their confidences (module docstring)."""
    out: list[tuple[list[int], list[float]]] = [([], []) for _ in starts]
    if not starts:
        return out
    device = first_logits.device
    logits = first_logits[torch.tensor([s.row for s in starts], device=device)][:, :vocab_size]
    active = list(range(len(starts)))
    for depth in range(max(s.room for s in starts)):
        tokens = logits.argmax(-1)
        conf = confidences(logits, tokens, config.temperature(depth)).tolist()
        for i, token, c in zip(active, tokens.tolist(), conf):
            out[i][0].append(token)
            out[i][1].append(min(max(c, 0.0), 1.0))
        position = [starts[i].position + depth for i in active]
        keep = [
            k for k, (i, p) in enumerate(zip(active, position))
            if depth + 1 < starts[i].room and p < starts[i].limit
        ]  # fmt: skip
        if not keep:
            break
        index = torch.tensor(keep, device=device)
        active = [active[k] for k in keep]
        positions = torch.tensor([position[k] for k in keep], dtype=torch.long, device=device)
        logits = forward(active, tokens[index], positions)[:, :vocab_size]
    return out
