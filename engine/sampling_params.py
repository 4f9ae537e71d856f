"""Per-request sampling settings, carried to the engine process as a msgspec Struct."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Literal

import msgspec

GrammarKind = Literal["json", "regex", "grammar"]


class GrammarSpec(msgspec.Struct, frozen=True):
    """A constraint on the generated text, compiled by the engine (``engine.structured``).

    ``json``: ``value`` is a JSON schema as JSON text; ``regex``: a regular expression;
    ``grammar``: an EBNF grammar (GBNF dialect, ``root`` rule). Equal specs share one
    compiled grammar.
    """

    kind: GrammarKind
    value: str


class SamplingError(ValueError):
    """Settings out of range, as ``(field, what is wrong)`` pairs; ``field`` is the first's."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        self.field = problems[0][0]
        super().__init__(self.describe())

    def describe(self, names: Mapping[str, str] | None = None) -> str:
        """Every problem in one line, each field called by ``names`` (else by its own)."""
        names = names or {}
        return "; ".join(f"{names.get(field, field)} {text}" for field, text in self.problems)


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How the next token is chosen and when generation stops.

    Stop *strings* are matched by the frontend on detokenized text; stop *token
    ids*, EOS and ``max_tokens`` are enforced by the engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the sampled token plus k top alternatives
    # None: off; k >= 0: each prompt token's logprob plus k top alternatives, computed in the
    # prefill (which then skips the prefix cache: every prompt position runs the model)
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None  # structured output: only text the grammar accepts
    speculative: bool = True  # False: never verify drafts for it (where speculation is on)

    def __post_init__(self) -> None:
        problems = list(self.problems())
        if problems:
            raise SamplingError(problems)

    def problems(self) -> Iterator[tuple[str, str]]:
        """Each setting out of range: its field and what is wrong with it."""
        if not 0.0 <= self.temperature <= 2.0:
            yield "temperature", f"must be in [0, 2], got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            yield "top_p", f"must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            yield "top_k", f"must be >= 0 (0 disables it), got {self.top_k}"
        if not 0.0 <= self.min_p <= 1.0:
            yield "min_p", f"must be in [0, 1], got {self.min_p}"
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                yield name, f"must be in [-2, 2], got {value}"
        if not 0.0 < self.repetition_penalty <= 2.0:
            yield "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}"
        if self.max_tokens < 1:
            yield "max_tokens", f"must be >= 1, got {self.max_tokens}"
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            yield "logprobs", f"must be in [0, 20], got {self.logprobs}"
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            yield "prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}"
        for token, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                yield "logit_bias", f"for token {token} must be in [-100, 100], got {bias}"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
