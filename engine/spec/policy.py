"""How many drafts each request gets verified in a step: one policy object, two policies.

``VerifyStep`` is the question: the step as scheduled so far (its tokens, prefill ones
included, and how many tokens its sampling chunks yield for sure: one each), and for each
request that could verify drafts its prefix-survival curve (``P_i``, the probability that
draft ``i`` is kept) as the latest statistics give it (``curve``, which ranks requests) and
as the statistics one step older give it (``budget_curve``, which sizes the total).

- ``FixedPolicy``: every request verifies up to K (as many as it has).
- ``DynamicPolicy`` (the source report's DSpark scheduler): with a step-cost model ready,
  ``best_total`` chooses how many drafts to verify in all — start from no draft (one
  token per request), add drafts by descending ``P`` and keep the total with the most
  expected tokens per second, ``(yield + sum of the P added) / time(tokens + drafts)`` —
  and ``allocate`` gives that many draft slots to the requests with the highest marginal
  gain (``P`` of their next draft). For a cost that depends only on the step's token
  count this is the best allocation there is: for each total, the largest ``P`` values
  are the most expected tokens, and a request's curve never rises, so they form a prefix
  of each request's drafts; every total is tried. Under overlap scheduling a step that
  verifies any draft also costs ``exposed_host_s``: the next step cannot be planned until
  its tokens are known, so the device waits for the host once (``SpecDecoding`` measures
  it). Until the cost model has samples of
  two step sizes it verifies every draft in one step and none in the next, so that it
  sees both sizes (prefill steps, whose tokens count, help too).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.spec.cost import StepCostModel


@dataclass(frozen=True)
class VerifyStep:
    """One step's question to a policy (module docstring)."""

    curves: list[list[float]]  # per candidate: survival P_i of its drafts (latest statistics)
    budget_curves: list[list[float]]  # the same from the statistics one step older
    base_tokens: int  # tokens the step runs without drafts (prefill chunks included)
    base_yield: int  # tokens it yields without drafts (one per sampling chunk)
    exposed_host_s: float = 0.0  # device idle time a step with drafts adds (overlap lost)


class VerifyPolicy(ABC):
    """Decides the drafts verified per request; learns from the steps that ran."""

    name = "policy"

    @abstractmethod
    def lengths(self, step: VerifyStep) -> list[int]:
        """Drafts to verify per candidate: ``0 <= lengths[i] <= len(step.curves[i])``."""

    def observe(self, tokens: int, forward_s: float, sample_s: float, draft_s: float) -> None:  # noqa: B027
        """A step of ``tokens`` tokens ran in these times."""

    def predicted_time(self, tokens: int) -> float | None:
        """The step time the policy expects for ``tokens`` tokens (None: no model)."""
        return None


class FixedPolicy(VerifyPolicy):
    name = "fixed"

    def lengths(self, step: VerifyStep) -> list[int]:
        return [len(c) for c in step.curves]


class DynamicPolicy(VerifyPolicy):
    name = "dynamic"

    def __init__(self, cost: StepCostModel | None = None) -> None:
        self.cost = cost or StepCostModel()
        self._explore = False

    def observe(self, tokens: int, forward_s: float, sample_s: float, draft_s: float) -> None:
        self.cost.add(tokens, forward_s, sample_s, draft_s)

    def predicted_time(self, tokens: int) -> float | None:
        return self.cost.time(tokens) if self.cost.ready else None

    def lengths(self, step: VerifyStep) -> list[int]:
        if not self.cost.ready:
            self._explore = not self._explore
            return [0 if self._explore else len(c) for c in step.curves]

        def time(n: int) -> float:
            return self.cost.time(step.base_tokens + n) + (step.exposed_host_s if n else 0.0)

        total = best_total(step.budget_curves, step.base_yield, time)
        return allocate(step.curves, total)


def best_total(
    curves: Sequence[Sequence[float]], base_yield: float, time: Callable[[int], float]
) -> int:
    """How many drafts to verify in all: the count ``n`` whose step yields the most
    expected tokens per second, ``(base_yield + the n largest P) / time(n)``, trying every
    ``n`` from 0 to all of them (the first best wins ties)."""
    values = sorted((p for curve in curves for p in curve), reverse=True)
    expected = float(base_yield)
    best_n, best_rate = 0, expected / time(0)
    for n, p in enumerate(values, start=1):
        expected += p
        rate = expected / time(n)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def allocate(curves: Sequence[Sequence[float]], total: int) -> list[int]:
    """Give ``total`` draft slots to the drafts with the highest ``P``: the ``total``
    largest values over every curve (ties: the earlier request, the earlier draft), which
    take a prefix of each request's drafts since a curve never rises."""
    slots = sorted(
        ((p, r, i) for r, curve in enumerate(curves) for i, p in enumerate(curve)),
        key=lambda s: (-s[0], s[1], s[2]),
    )
    lengths = [0] * len(curves)
    for _, r, _ in slots[:total]:
        lengths[r] += 1
    return lengths


POLICIES: dict[str, type[VerifyPolicy]] = {"fixed": FixedPolicy, "dynamic": DynamicPolicy}
