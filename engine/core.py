"""The engine core: schedule → execute → update, and the process that runs it.

``EngineCore`` is usable in-process (tests, benchmarks). ``python -m engine.core``
runs it in its own process behind the engine channel (``engine.messages``), so the
frontend's HTTP handling, tokenization and detokenization never compete with the step
loop for the GIL.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from engine import envs
from engine.attention import backend_for
from engine.config import CacheConfig, EngineConfig
from engine.ipc import worker_sockets
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.sizing import auto_kv_blocks
from engine.kv_cache.tiered import KVTiers
from engine.loader import load_model, resolve_cpu_weights
from engine.messages import (
    AbortRequests,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    RequestOutput,
    Shutdown,
    decode_input,
    encode,
)
from engine.plan import StepPlan
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.structured import GrammarCompiler, GrammarGate
from kvstore.hashing import extra_keys
from kvstore.layout import KVCache, KVCacheLayout

log = logging.getLogger("ferry.engine")

_IDLE_POLL_MS = 1000
_GRAMMAR_POLL_S = 0.005  # with nothing to run but grammars compiling: how long a step waits

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        progress: bool = False,
        cache_factory: Callable[[KVCacheLayout, int, str], KVCache] = KVCache,
        scheduler_cls: type[Scheduler] = Scheduler,
    ) -> None:
        """``cache_factory`` and ``scheduler_cls``: what a worker role needs instead of the
        defaults (a KV cache a transport can write into; ``engine.pd_scheduler``)."""
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        dtype = _DTYPES[config.dtype]
        config = config.replace(cpu_weights=resolve_cpu_weights(config))
        loaded = load_model(
            config.model, config.device, dtype, progress, weights=config.cpu_weights
        )
        self.model_config = loaded.config
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = tuple(loaded.tokenizer.eos_token_ids) if loaded.tokenizer else ()
        layout = loaded.model.kv_layout(config.cache.block_size, dtype)
        self.config = self._resolve(config, layout)
        cache_cfg = self.config.cache
        self.kv_cache = cache_factory(layout, cache_cfg.num_blocks, config.device)
        mc = loaded.config
        backend = backend_for(config.device)(
            self.kv_cache, mc.num_heads, mc.num_kv_heads, mc.head_dim, loaded.model.attention_scale
        )
        pool = BlockPool(cache_cfg.num_blocks, cache_cfg.enable_prefix_caching)
        self.kv = KVCacheManager(pool, cache_cfg.block_size, self._tiers(cache_cfg, mc.fingerprint))
        self.max_model_len = self.config.scheduler.max_model_len
        self.scheduler = scheduler_cls(self.config.scheduler, self.kv, self.max_model_len)
        sampler = Sampler(mc.vocab_size, config.device, seed=config.seed)
        self.runner = ModelRunner(loaded.model, backend, sampler, cache_cfg.block_size)
        self.overlap = config.overlaps
        self._inflight: tuple[StepPlan, Any] | None = None  # a step still running (overlap)
        if torch.device(config.device).type == "cuda" and not config.enforce_eager:
            sched = self.config.scheduler
            self.runner.capture_decode_graphs(sched.max_num_seqs, self.max_model_len)
        self.hash_extra = extra_keys(mc.fingerprint)  # what the block hashes of this model mix in
        so = config.structured
        self.grammars = GrammarGate(
            GrammarCompiler(
                loaded.tokenizer, mc.vocab_size, so.grammar_cache_mb << 20, so.compile_threads
            )
        )

    def _tiers(self, cache: CacheConfig, fingerprint: str) -> KVTiers | None:
        """Host and file tiers below the KV cache, as ``cache`` asks (none by default)."""
        if not cache.enable_prefix_caching:
            return None
        return KVTiers.build(
            self.kv_cache, fingerprint, int(cache.host_memory_gb * 2**30), cache.kv_dir,
            int(cache.file_capacity_gb * 2**30), cache.file_ttl_hours * 3600.0,
        )  # fmt: skip

    def _resolve(self, config: EngineConfig, layout: KVCacheLayout) -> EngineConfig:
        """Fill in what is only known now: block count and context length (never past
        the model's own, which its RoPE table covers)."""
        cache = config.cache
        own = self.model_config.max_position_embeddings
        limit = min(config.scheduler.max_model_len or own, own)
        if cache.num_blocks == 0:
            if cache.memory_gb > 0:
                num_blocks = int(cache.memory_gb * 2**30) // layout.bytes_per_block + 1
            else:
                num_blocks = auto_kv_blocks(limit, cache.block_size, layout.bytes_per_block)
            cache = dataclasses.replace(cache, num_blocks=num_blocks)
        capacity = (cache.num_blocks - 1) * cache.block_size
        sched = dataclasses.replace(config.scheduler, max_model_len=min(limit, capacity))
        return config.replace(cache=cache, scheduler=sched)

    def add_request(self, msg: EngineRequest) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it cannot run."""
        n = len(msg.prompt_token_ids)
        problem = None
        if n == 0:
            problem = "the prompt is empty"
        elif n + msg.sampling.max_tokens > self.max_model_len:
            problem = (
                f"prompt ({n} tokens) + max_tokens ({msg.sampling.max_tokens}) exceeds the "
                f"context length ({self.max_model_len})"
            )
        elif (
            max(msg.prompt_token_ids) >= self.model_config.vocab_size
            or min(msg.prompt_token_ids) < 0
        ):
            problem = "prompt holds token ids outside the vocabulary"
        if problem:
            return RequestOutput(msg.request_id, [], "error", error=problem)
        extra = self.hash_extra + (extra_keys(msg.cache_salt) if msg.cache_salt else b"")
        req = Request(
            msg.request_id,
            list(msg.prompt_token_ids),
            msg.sampling,
            eos_token_ids=self.eos_token_ids,
            arrival_time=msg.arrival_time,
            hash_extra=extra,
            output_token_ids=list(msg.output_token_ids),
        )
        if msg.sampling.grammar is None:
            self.scheduler.add(req)
        else:  # enters the scheduler once its grammar has compiled
            self.grammars.add(req)
        return None

    def abort(self, request_ids: list[str]) -> None:
        self.grammars.abort(request_ids)
        self.scheduler.abort(request_ids)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.grammars) or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """One engine step: plan, run, fold the sampled tokens back.

        With overlap scheduling the device never waits for the host between steps: a
        step whose requests can all go on before their tokens are known (no grammar, no
        penalty or min_tokens that reads the outputs, not prefill-only) is left running,
        and the next ``step`` plans and launches its successor — whose input tokens come
        from that step's output on the device — before it collects it. A request that
        the collected token ends has then run one step too many; that step's token is
        dropped.
        """
        if self.grammars and not self.scheduler.has_work and self._inflight is None:
            self.grammars.wait(_GRAMMAR_POLL_S)
        ready, failed = self.grammars.take_ready()
        for req in ready:
            self.scheduler.add(req)
        outputs = failed
        previous, self._inflight = self._inflight, None
        launched = None
        if self.scheduler.has_work:
            plan = self.scheduler.schedule()
            launched = (plan, self.runner.launch(plan))
        if previous is not None:
            outputs += self.scheduler.update(previous[0], self.runner.finish(previous[1]))
        if launched is not None:
            if self.overlap and self._can_run_on(launched[0]):
                self.scheduler.assume_sampled(launched[0])
                self._inflight = launched
            else:
                plan, pending = launched
                outputs += self.scheduler.update(plan, self.runner.finish(pending))
        return outputs

    def _can_run_on(self, plan: StepPlan) -> bool:
        """Whether the next step can be planned before ``plan``'s tokens are known."""
        if getattr(self.scheduler, "prefill_only", None):
            return False  # a prefill worker ships its blocks as soon as a request ends
        for chunk in plan.chunks:
            req = self.scheduler.requests.get(chunk.request_id)
            if req is None:
                continue
            sp = req.sampling
            if (req.grammar is not None or sp.min_tokens or sp.presence_penalty
                    or sp.frequency_penalty or sp.repetition_penalty != 1.0):  # fmt: skip
                return False
        return True

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


# -- the engine process ----------------------------------------------------------------------


def serve(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Run an EngineCore behind ZMQ sockets until told to shut down."""
    inbox, outbox = worker_sockets(input_addr, output_addr)
    try:
        core = EngineCore(config, progress=True)
    except Exception as exc:  # report why we could not start, then exit
        log.exception("engine failed to start")
        outbox.send(encode(EngineFailed(f"{type(exc).__name__}: {exc}")))
        return
    outbox.send(
        encode(
            EngineReady(
                core.config.cache.num_blocks,
                core.config.cache.block_size,
                core.max_model_len,
                core.model_name,
            )
        )
    )
    _loop(core, inbox, outbox)


def _loop(core: EngineCore, inbox, outbox) -> None:
    check = envs.DEBUG_INTEGRITY.get()
    parent = os.getppid()
    while True:
        errors: list[RequestOutput] = []
        if not core.has_work and not inbox.poll(_IDLE_POLL_MS):
            if os.getppid() != parent:  # the frontend died without telling us
                return
            continue
        while inbox.poll(0):
            msg = decode_input(inbox.recv())
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AbortRequests):
                core.abort(msg.request_ids)
            elif isinstance(msg, EngineRequest):
                err = core.add_request(msg)
                if err is not None:
                    errors.append(err)
        outputs = errors + (core.step() if core.has_work else [])
        outbox.send(encode(EngineOutputs(outputs, core.scheduler.stats(), time.time())))
        if check and not core.has_work:
            core.check_integrity()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.core")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=envs.LOG_LEVEL.get().upper(), stream=sys.stderr)
    serve(msgspec.json.decode(args.config, type=EngineConfig), args.input, args.output)


if __name__ == "__main__":
    main()
