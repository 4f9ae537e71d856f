"""Structured output on xgrammar: grammars compiled off the step loop, token masks per step.

The pieces, in the order a constrained request meets them:

- ``check(spec)`` parses a ``GrammarSpec`` without the tokenizer (cheap: no token masks).
  The frontend runs it in a worker thread before it answers, so an invalid schema,
  regex or EBNF grammar becomes a 400 with xgrammar's reason.
- ``GrammarCompiler`` (engine process) compiles specs against the model's vocabulary in a
  thread pool: xgrammar releases the GIL while it compiles, so the step loop keeps
  running. Compiled grammars sit in xgrammar's cache, an LRU bounded in bytes
  (``StructuredOutputConfig.grammar_cache_mb``); equal specs compile once.
- ``GrammarGate`` holds requests whose grammar is still compiling. A request enters the
  scheduler only when its grammar is ready, so the scheduler never sees a request it
  cannot run and unconstrained requests are never held up by a compile.
- ``GrammarState`` is one request's matcher, kept by the runner for the request's whole
  life (preemption by recompute keeps the generated tokens, so the matcher stays valid).
  ``GrammarState.resume`` rebuilds it from the tokens generated so far, for a worker
  that takes over a request mid-generation (a decode worker after prefill).
- ``build_mask`` fills one bitmask row per constrained request of a step; the sampler
  applies it (``TokenMask.apply``) after its logits processing and before choosing.
- Speculative decoding: ``GrammarState.valid_prefix`` says how many of a proposal's drafts
  the grammar accepts (the rest are dropped before they are verified), and
  ``build_draft_mask`` fills a request's verify rows with the grammar's state after each
  draft; both roll the matcher back, so its state stays that of the tokens generated.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from engine.messages import RequestOutput
from engine.sampling_params import GrammarSpec

if TYPE_CHECKING:
    import torch
    import xgrammar

    from engine.request import Request

log = logging.getLogger("ferry.structured")

# JSON is generated compactly (", " and ": " separators, no free whitespace): a small model
# left free to choose whitespace can emit newlines forever instead of closing an object.
_JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False, "strict_mode": True}
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@cache
def _xgr() -> Any:
    """xgrammar, imported on first use (it takes ~1.5 s and loads transformers)."""
    import xgrammar

    return xgrammar


class GrammarError(ValueError):
    """A schema, regex or grammar that xgrammar cannot use; the message says why."""


def check(spec: GrammarSpec) -> None:
    """Raise ``GrammarError`` when ``spec`` cannot be compiled. Parses only: no tokenizer,
    no token masks, so it is cheap enough for the frontend (run it off the event loop)."""
    xgr = _xgr()
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.value, **_JSON_OPTIONS)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.value)
        else:
            xgr.Grammar.from_ebnf(spec.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(_reason(exc)) from exc


def _reason(exc: Exception) -> str:
    """xgrammar's message without its ``[time] /path/file.cc:line:`` prefix."""
    text = str(exc).strip()
    head, sep, tail = text.partition(": ")
    return tail.strip() if sep and ".cc:" in head else text


def json_spec(schema: dict[str, Any] | str) -> GrammarSpec:
    """A ``json`` spec from a schema (dict or JSON text), as compact JSON text so equal
    schemas share a cache entry. Key order is kept: properties are generated in it."""
    value = json.loads(schema) if isinstance(schema, str) else schema
    return GrammarSpec("json", json.dumps(value, separators=(",", ":")))


# ---- compiling -----------------------------------------------------------------------------


def tokenizer_info(tokenizer: Any, vocab_size: int) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the model's vocabulary (``vocab_size`` = logits width).

    Special tokens get an empty spelling, which xgrammar treats as never allowed inside a
    grammar; the tokenizer's EOS ids are the stop tokens a finished grammar allows. Ids
    past the tokenizer's vocabulary (padding) are never allowed either.
    """
    xgr = _xgr()
    special = set(tokenizer.all_special_ids)
    encoded = ["" if i in special else (tokenizer.id_to_piece(i) or "") for i in range(vocab_size)]
    if tokenizer.is_byte_level:
        vocab_type = xgr.VocabType.BYTE_LEVEL
    elif "<0x0A>" in encoded:
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgr.VocabType.RAW
    stop = [i for i in tokenizer.eos_token_ids if i < vocab_size]
    return xgr.TokenizerInfo(
        encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stop, add_prefix_space=False
    )


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one model in a thread pool, with a byte-bounded cache.

    Building the tokenizer info (and importing xgrammar) is the pool's first job, so it
    runs beside the rest of an engine's start-up, which then waits for it (``wait_built``).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, cache_bytes: int, threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max(threads, 1), thread_name_prefix="ferry-grammar")
        self._compiler: Future[Any] = self._pool.submit(
            self._build, tokenizer, vocab_size, cache_bytes
        )

    @staticmethod
    def _build(tokenizer: Any, vocab_size: int, cache_bytes: int) -> Any:
        info = tokenizer_info(tokenizer, vocab_size)
        return _xgr().GrammarCompiler(info, max_threads=1, cache_limit_bytes=cache_bytes)

    def wait_built(self) -> None:
        """Block until the compiler is built (xgrammar imported, the vocabulary read; an
        error in that is raised by the first compile). An engine waits before it serves:
        the ~2 s import, holding the interpreter, otherwise ran beside its first requests
        (the first request of a warm-started deepseek-v3-4l took 2.1 s on an H200 where the
        next took 0.27)."""
        wait([self._compiler])

    def submit(self, spec: GrammarSpec) -> Future[Any]:
        """Compile in the pool; the future holds an ``xgrammar.CompiledGrammar`` or raises
        ``GrammarError``."""
        return self._pool.submit(self.compile, spec)

    def compile(self, spec: GrammarSpec) -> Any:
        compiler = self._compiler.result()
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.value, **_JSON_OPTIONS)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            return compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_reason(exc)) from exc

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the cache of compiled grammars now."""
        return self._compiler.result().get_cache_size_bytes()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Compiling:
    request: Request
    future: Future[Any]


class GrammarGate:
    """Requests waiting for their grammar, outside the scheduler.

    ``add`` starts the compile; ``take_ready`` hands back, in arrival order, the
    requests whose grammar is ready (with ``request.grammar`` set) and an error output
    for each whose grammar failed.
    """

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._waiting: dict[str, _Compiling] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, request: Request) -> None:
        spec = request.sampling.grammar
        if spec is None:
            raise ValueError(f"request {request.request_id!r} has no grammar")
        self._waiting[request.request_id] = _Compiling(request, self.compiler.submit(spec))

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            entry = self._waiting.pop(rid, None)
            if entry is not None:
                entry.future.cancel()

    def take_ready(self) -> tuple[list[Request], list[RequestOutput]]:
        ready, failed = [], []
        for rid, entry in list(self._waiting.items()):
            if not entry.future.done():
                continue
            del self._waiting[rid]
            try:
                entry.request.grammar = entry.future.result()
                ready.append(entry.request)
            except Exception as exc:  # GrammarError, or a bug in the compiler
                failed.append(RequestOutput(rid, [], "error", error=f"grammar: {exc}"))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until some compile finishes or ``timeout`` seconds pass."""
        if self._waiting:
            wait([e.future for e in self._waiting.values()], timeout, FIRST_COMPLETED)


# ---- decoding --------------------------------------------------------------------------------


class GrammarState:
    """One request's position in its grammar: advanced by every token it generates."""

    def __init__(self, compiled: Any) -> None:
        self.matcher = _xgr().GrammarMatcher(compiled)
        self.num_accepted = 0

    @classmethod
    def resume(cls, compiled: Any, token_ids: Sequence[int]) -> GrammarState:
        """The state after ``token_ids`` (the tokens generated so far) were accepted."""
        state = cls(compiled)
        for token in token_ids:
            if not state.accept(token):
                raise GrammarError(
                    f"token {token} at output position {state.num_accepted} breaks the grammar"
                )
        return state

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False (state unchanged) if the grammar forbids it."""
        if not self.matcher.accept_token(token_id):
            return False
        self.num_accepted += 1
        return True

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts from here (none past the one
        that completes it); the state is left as it was."""
        n = 0
        for token in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def fill_ahead(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]) -> None:
        """Fill rows ``row .. row + len(drafts)``: row ``row + j`` with the state after the
        first ``j`` drafts (rows after a draft the grammar rejects stay all-allowed: no
        draft before them is kept); the state is left as it was."""
        accepted = 0
        for j in range(len(drafts) + 1):
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(bitmask, row + j)
            if j == len(drafts) or not self.matcher.accept_token(drafts[j]):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)


@dataclass(frozen=True)
class TokenMask:
    """The step's allowed tokens: ``bitmask`` has one row per sampled row (bit set =
    allowed); only ``rows`` are constrained, the other rows are left alone."""

    bitmask: torch.Tensor
    rows: list[int]
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> None:
        """Set forbidden logits of the constrained rows to -inf, in place."""
        from engine.attention.base import host_to_device  # (the frontend checks without torch)

        bitmask = host_to_device(self.bitmask, logits.device)
        rows = None if len(self.rows) == logits.shape[0] else self.rows
        # xgrammar's CPU kernel on CPU (here 2x faster than its torch_native path at
        # 16 rows); its default GPU kernel on CUDA.
        _xgr().apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=rows
        )


def build_draft_mask(
    groups: Sequence[tuple[GrammarState | None, Sequence[int]]], vocab_size: int
) -> TokenMask | None:
    """The mask of verify rows: per request its grammar state (or None) and drafts, which
    take ``len(drafts) + 1`` rows; None when no request is constrained."""
    if all(state is None for state, _ in groups):
        return None
    num_rows = sum(len(drafts) + 1 for _, drafts in groups)
    bitmask = _xgr().allocate_token_bitmask(num_rows, vocab_size)
    rows, row = [], 0
    for state, drafts in groups:
        if state is not None:
            state.fill_ahead(bitmask, row, drafts)
            rows += range(row, row + len(drafts) + 1)
        row += len(drafts) + 1
    return TokenMask(bitmask, rows, vocab_size)


# from this many constrained rows on, a step's masks are filled in one call, in xgrammar's
# own threads (a row took ~0.11 ms on an H200's host for a 128k vocabulary; 64 rows filled
# together took 5.4 ms there, one by one 7)
BATCH_FILL_ROWS = 4


@cache
def _batch_matcher() -> Any:
    return _xgr().BatchGrammarMatcher(max_threads="auto")


def build_mask(states: Sequence[GrammarState | None], vocab_size: int) -> TokenMask | None:
    """The mask for rows whose state is not None; None when no row is constrained."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return None
    bitmask = _xgr().allocate_token_bitmask(len(states), vocab_size)
    if len(rows) >= BATCH_FILL_ROWS:
        matchers = [states[i].matcher for i in rows]
        _batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, rows)
    else:
        for i in rows:
            states[i].fill(bitmask, i)
    return TokenMask(bitmask, rows, vocab_size)
