"""Routing policies: which worker of a pool serves a request.

Each policy is one file with one ``select()``; the prefill, decode and encode pools each
get their own instance (``get_policy(name, role)``), so the choices are independent.
"""

from __future__ import annotations

from router.policies.base import POOLS, Candidate, Policy
from router.policies.cache_aware import CacheAware
from router.policies.load_aware import LoadAware
from router.policies.random import RandomChoice
from router.policies.round_robin import RoundRobin

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (CacheAware, LoadAware, RoundRobin, RandomChoice)
}


def get_policy(name: str, role: str, seed: int | None = None) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown router policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name](role, seed)


__all__ = ["POLICIES", "POOLS", "Candidate", "Policy", "get_policy"]
