"""Speculative decoding: drafters, the verify policy, and the scheduler's manager.

- ``base``: the ``Drafter`` contract and its ``Proposal`` (point-mass drafts with
  per-position confidences).
- Drafters, one file each, chosen through ``DRAFTERS`` by ``SpeculativeConfig.method``:
  ``ngram`` (prompt lookup), ``mtp`` (DeepSeek-V3's multi-token prediction layers),
  ``draft`` (a small model with the target's tokenizer).
- ``policy``: how many drafts each request verifies in a step (``fixed``, ``dynamic``).
- ``cost``: the online step-cost estimators the dynamic policy uses.
- ``guard``: the realized-gain guard, which keeps the dynamic policy's drafts off where
  they measured fewer tokens per second than no drafts.
- ``manager``: ``SpecDecoding``, the object the scheduler asks.

Verification itself is the sampler's (``engine.sampler``, ``Sampler.verify``); the runner
calls it and the drafter (``engine.runner``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.config import SpeculativeConfig
from engine.spec.base import Drafter, DraftRequest, DraftStep, Proposal
from engine.spec.ngram import NgramDrafter

if TYPE_CHECKING:
    from engine.loader import LoadedModel

# method -> factory(config, the loaded target, device, dtype) -> Drafter
DrafterFactory = Callable[[SpeculativeConfig, "LoadedModel", str, torch.dtype], Drafter]


def _ngram(config: SpeculativeConfig, target: LoadedModel, device: str, dtype: torch.dtype):
    return NgramDrafter(config.max_draft, config.ngram_min, config.ngram_max)


def _mtp(config: SpeculativeConfig, target: LoadedModel, device: str, dtype: torch.dtype):
    from engine.spec.mtp import MTPDrafter

    return MTPDrafter(config, target.model)


def _draft(config: SpeculativeConfig, target: LoadedModel, device: str, dtype: torch.dtype):
    from engine.spec.draft_model import DraftModelDrafter

    return DraftModelDrafter.load(config, target, device, dtype)


DRAFTERS: dict[str, DrafterFactory] = {"ngram": _ngram, "mtp": _mtp, "draft": _draft}


def register_drafter(method: str, factory: DrafterFactory) -> None:
    """Make ``method`` a ``SpeculativeConfig.method`` that ``factory`` builds."""
    DRAFTERS[method] = factory


def build_drafter(
    config: SpeculativeConfig, target: LoadedModel, device: str, dtype: torch.dtype
) -> Drafter | None:
    """The drafter ``config`` asks for (None without speculation)."""
    if not config.enabled:
        return None
    if config.method not in DRAFTERS:
        raise ValueError(f"no drafter {config.method!r}; known: {sorted(DRAFTERS)}")
    return DRAFTERS[config.method](config, target, device, dtype)


__all__ = [
    "DRAFTERS",
    "DraftRequest",
    "DraftStep",
    "Drafter",
    "Proposal",
    "build_drafter",
    "register_drafter",
]
