"""The engine core: schedule → execute → update, and the process that runs it.

``EngineCore`` is usable in-process (tests, benchmarks). ``python -m engine.core`` runs
it in its own process as the aggregated engine, a role of the worker shell
(``engine.worker``), so the frontend's HTTP handling, tokenization and detokenization
never compete with the step loop for the GIL.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from engine.attention import build_backend
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.cuda_graphs import CPU_BUCKETS, DEFAULT_BUCKETS
from engine.ep.experts import ExpertParallel
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.sizing import auto_kv_blocks
from engine.kv_cache.tiered import KVTiers
from engine.loader import load_image_processor, load_model, resolve_cpu_weights
from engine.media import MediaGate
from engine.messages import (
    ENGINE,
    Abort,
    EngineRequest,
    RequestOutput,
    WorkerReady,
    WorkerStats,
)
from engine.plan import StepPlan
from engine.request import Request
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.spec import build_drafter
from engine.spec.manager import SpecDecoding
from engine.structured import GrammarCompiler, GrammarGate
from engine.vision import MAX_DECODE_PIXELS, VisionEncoder
from engine.worker.config import WorkerConfig
from engine.worker.shell import Outbox, WorkerRole
from engine.worker.shell import main as worker_main
from kernels import compile_seconds, parallel_builds
from kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from kvstore.events import KVEvent
from kvstore.hashing import extra_keys
from kvstore.layout import KVCache, KVCacheLayout
from kvstore.transport.base import KVEndpoint

log = logging.getLogger("ferry.engine")

_GRAMMAR_POLL_S = 0.005  # with nothing to run but grammars compiling: how long a step waits

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_WARM_UP_TOKENS = 16


def warm_up_steps(
    device: str, sched: SchedulerConfig, max_model_len: int
) -> tuple[tuple[int, ...], ...]:
    """The steps an engine runs once before it serves (``ModelRunner.warm_up``), each as
    the lengths of its prompts. On CUDA, steps of 1 to ``GEMV_MAX_ROWS`` one-token
    prompts (the eager decode path, and the products of a few rows, whose kernels are
    built per row count: a first prefill of three prompts compiled the one for its three
    rows of logits, 2 s on the H200, and an eager decode of three sequences four more),
    then one prompt of a whole step's token budget: the largest activations a step
    allocates, so a budget that does not fit fails at start, and the kernels and library
    plans of the largest steps (the first request of deepseek-v3-4l waited 0.3-0.76 s
    before, bench/results/startup_h200_2aae27c.json). On the CPU a short prompt: the
    one-time costs of a first forward."""
    if torch.device(device).type != "cuda":
        return ((min(CPU_WARM_UP_TOKENS, max_model_len),),)
    rows = min(GEMV_MAX_ROWS, sched.max_num_seqs)
    few = tuple((1,) * n for n in range(1, rows + 1))
    return few + ((min(sched.max_num_batched_tokens, max_model_len),),)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        progress: bool = False,
        cache_factory: Callable[[KVCacheLayout, int, str], KVCache] = KVCache,
        scheduler_cls: type[Scheduler] = Scheduler,
        experts: ExpertParallel | None = None,
    ) -> None:
        """``cache_factory`` and ``scheduler_cls``: what a worker role needs instead of the
        defaults (a KV cache a transport can write into; ``engine.pd_scheduler``);
        ``experts``: this rank's share of an expert-parallel group's experts, which keeps
        only its own slots of the loaded model (``engine.ep``). Decode steps are captured
        into CUDA graphs only where its dispatcher can be.

        ``startup``: seconds the start took, by phase (``weights``: load, and keep this
        rank's experts; ``compile``: building kernels; ``warm_up``: the forwards of
        ``warm_up_steps``, so that the first request pays no first use; ``graphs``:
        capturing the decode graphs; the last two without their kernel builds)."""
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        dtype = _DTYPES[config.dtype]
        config = config.replace(cpu_weights=resolve_cpu_weights(config))
        started, compiled = time.perf_counter(), compile_seconds()
        loaded = load_model(config.model, config.device, dtype, progress,
                            weights=config.cpu_weights, vision=config.vision,
                            quantization=config.quantization)  # fmt: skip
        if experts is not None:
            experts.attach(loaded.model)
        self.startup = {"weights": time.perf_counter() - started}
        self.model_config = loaded.config
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = tuple(loaded.tokenizer.eos_token_ids) if loaded.tokenizer else ()
        so = config.structured  # its compiler builds beside the rest of the start-up
        self.grammars = GrammarGate(GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size,
                                                    so.grammar_cache_mb << 20,
                                                    so.compile_threads))  # fmt: skip
        speculative = config.speculative if scheduler_cls.drafts else SpeculativeConfig()
        drafter = build_drafter(config.speculative, loaded, config.device, dtype)
        if drafter is not None and not scheduler_cls.drafts and not drafter.kv_layers():
            drafter = None  # nothing decodes here, and it has no KV to carry to who does
        bs = config.cache.block_size
        layout = loaded.model.kv_layout(bs, dtype)
        extra_layers = drafter.kv_layers() if drafter is not None else 0
        if extra_layers:  # the drafter's KV travels in the target's blocks
            layout = dataclasses.replace(layout, num_layers=layout.num_layers + extra_layers)
        own_bytes = drafter.kv_bytes_per_block(bs) if drafter is not None else 0
        self.config = self._resolve(config, layout.bytes_per_block + own_bytes)
        cache_cfg = self.config.cache
        self.kv_cache = cache_factory(layout, cache_cfg.num_blocks, config.device)
        mc = loaded.config
        self.fingerprint = mc.fingerprint + (f"+kv{extra_layers}" if extra_layers else "")
        backend = build_backend(self.kv_cache, mc, loaded.model.attention_scale, config.device)
        pool = BlockPool(cache_cfg.num_blocks, cache_cfg.enable_prefix_caching)
        tiers = self._tiers(cache_cfg, self.fingerprint)
        self.kv = KVCacheManager(pool, cache_cfg.block_size, tiers)
        self.max_model_len = self.config.scheduler.max_model_len
        self.media = MediaGate(self._encoder(loaded.model))
        self.overlap = config.overlaps
        if drafter is not None:
            drafter.bind(self.kv_cache, cache_cfg.num_blocks, self.max_model_len)
        lookahead = drafter.kv_lookahead if drafter is not None else 0
        on_device = drafter is not None and drafter.on_device
        spec = SpecDecoding(speculative, lookahead, lagged=self.overlap, on_device=on_device)
        self.scheduler = scheduler_cls(self.config.scheduler, self.kv, self.max_model_len, spec)
        sampler = Sampler(mc.vocab_size, config.device, seed=config.seed)
        self.runner = ModelRunner(loaded.model, backend, sampler, cache_cfg.block_size, drafter,
                                  proposes=scheduler_cls.drafts,
                                  embeddings=self.media.get)  # fmt: skip
        self._inflight: tuple[StepPlan, Any] | None = None  # a step still running (overlap)
        self._warm_up(config, experts, spec)
        self.startup["compile"] = compile_seconds() - compiled
        self.hash_extra = extra_keys(self.fingerprint)  # what this model's block hashes mix in
        self.grammars.compiler.wait_built()

    def _warm_up(
        self, config: EngineConfig, experts: ExpertParallel | None, spec: SpecDecoding
    ) -> None:
        """Run the warm-up steps (``warm_up_steps``) and capture the decode graphs, after
        one dry run of both inside ``parallel_builds``: the kernels either needs and
        nothing built yet are compiled at once, in one pool of processes (two sections
        each waited for a pool and its slowest kernel: the MLA decode kernel's ~32 s on an
        H200). On the CPU the decode graphs are programs of the C kernels' calls
        (``engine.cuda_graphs``). An expert-parallel rank does not warm up (its forwards
        need its whole group), and its decode graphs only where its dispatcher can be
        captured (on the CPU, never)."""
        sched = self.config.scheduler
        steps = warm_up_steps(config.device, sched, self.max_model_len) if experts is None else ()
        graphs = pieces = drafts = None
        device = torch.device(config.device).type
        decodes = self.scheduler.decodes  # a prefill worker's steps are never decode steps
        if device == "cpu" and not config.enforce_eager and experts is None and decodes:
            graphs = self.runner.capture_decode_graphs(sched.max_num_seqs, self.max_model_len,
                                                       CPU_BUCKETS, capture=False)  # fmt: skip
        if device == "cuda" and not config.enforce_eager:
            if decodes and (experts is None or experts.dispatcher.capturable):
                graphs = self.runner.capture_decode_graphs(self._graph_rows(sched),
                                                           self.max_model_len, capture=False)
            elif decodes:
                log.info("decode steps run eagerly: the %s cannot be captured",
                         type(experts.dispatcher).__name__)  # fmt: skip
            drafter = self.runner.drafter
            if decodes and experts is None and drafter is not None:
                drafts = drafter.capture_graphs(self._draft_rows(sched), self.max_model_len,
                                                capture=False)  # fmt: skip
            tokens = min(config.piecewise_graph_tokens, sched.max_num_batched_tokens)
            if experts is None and tokens > 0:  # a group's exchange stays out of the pieces
                pieces = self.runner.capture_piecewise_graphs(tokens, capture=False)
        started, compiled = time.perf_counter(), compile_seconds()
        with parallel_builds():
            self.runner.warm_up_forwards(steps)
            for padded in (graphs, pieces, drafts):
                if padded is not None:
                    padded.dry_run()
        self.runner.warm_up_forwards(steps)
        self.startup["warm_up"] = time.perf_counter() - started - (compile_seconds() - compiled)
        captured, compiled = time.perf_counter(), compile_seconds()
        if graphs is not None:
            graphs.capture()
            spec.graphs(max(graphs.sizes))
        if pieces is not None:
            pieces.capture()
        if drafts is not None:
            drafts.capture()
        self.startup["graphs"] = time.perf_counter() - captured - (compile_seconds() - compiled)

    def _graph_rows(self, sched: SchedulerConfig) -> int:
        """The most rows a decode graph replays: a step of every sequence, and with
        speculation a verify step's drafts too (a row each), up to the largest bucket."""
        return max(sched.max_num_seqs, min(self._draft_rows(sched), sched.max_num_batched_tokens))

    def _draft_rows(self, sched: SchedulerConfig) -> int:
        """The most rows the drafter's graphs take: a verify step's, each request its
        token and every draft (the drafter's forward over the step it follows), within
        what the decode graphs hold."""
        return min(sched.max_num_seqs * (1 + self.scheduler.spec.max_draft), DEFAULT_BUCKETS[-1])

    def _encoder(self, model: torch.nn.Module) -> VisionEncoder | None:
        """The vision encoder of a model built with its tower (None: text only, or the
        images are encoded elsewhere)."""
        tower = getattr(model, "visual", None)
        if tower is None:
            return None
        processor = load_image_processor(self.config.model)
        assert processor is not None
        return VisionEncoder(tower, processor, MAX_DECODE_PIXELS)

    def _tiers(self, cache: CacheConfig, fingerprint: str) -> KVTiers | None:
        """Host and file tiers below the KV cache, as ``cache`` asks (none by default)."""
        if not cache.enable_prefix_caching:
            return None
        return KVTiers.build(
            self.kv_cache, fingerprint, int(cache.host_memory_gb * 2**30), cache.kv_dir,
            int(cache.file_capacity_gb * 2**30), cache.file_ttl_hours * 3600.0, cache.file_mode,
        )  # fmt: skip

    def _resolve(self, config: EngineConfig, bytes_per_block: int) -> EngineConfig:
        """Fill in what is only known now: block count (``bytes_per_block``: every KV
        cache's, a draft model's included) and context length (never past the model's
        own, which its RoPE table covers)."""
        cache = config.cache
        own = self.model_config.max_position_embeddings
        limit = min(config.scheduler.max_model_len or own, own)
        if cache.num_blocks == 0:
            if cache.memory_gb > 0:
                num_blocks = int(cache.memory_gb * 2**30) // bytes_per_block + 1
            else:
                num_blocks = auto_kv_blocks(limit, cache.block_size, bytes_per_block)
            cache = dataclasses.replace(cache, num_blocks=num_blocks)
        capacity = (cache.num_blocks - 1) * cache.block_size
        sched = dataclasses.replace(config.scheduler, max_model_len=min(limit, capacity))
        return config.replace(cache=cache, scheduler=sched)

    def add_request(
        self, msg: EngineRequest, embeddings: list[torch.Tensor] | None = None
    ) -> RequestOutput | None:
        """Queue a request; returns an error output instead if it cannot run.

        A request with images (``msg.media``) gets its embeddings one of three ways:
        ``embeddings`` (one tensor per image: a role received them from an encode
        worker); its items carry the image files, and this engine encodes them before it
        is scheduled (``MediaGate``); or neither, and it must not compute its image
        tokens here (a decode worker gets the prompt's KV; ``_drop_uncomputable``)."""
        problem = self._prompt_problem(msg) or self._media_problem(msg, embeddings)
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
            media=tuple(msg.media),
            trace_id=msg.trace_id,
        )
        if embeddings is not None:
            self.media.put(req.request_id, embeddings)
        elif msg.media and msg.media[0].data:
            self.media.add(req)  # enters the scheduler once its images are encoded
            return None
        self._admit(req)
        return None

    def _admit(self, req: Request) -> None:
        if req.sampling.grammar is None:
            self.scheduler.add(req)
        else:  # enters the scheduler once its grammar has compiled
            self.grammars.add(req)

    def _prompt_problem(self, msg: EngineRequest) -> str | None:
        n = len(msg.prompt_token_ids)
        if n == 0:
            return "the prompt is empty"
        if n + msg.sampling.max_tokens > self.max_model_len:
            return (f"prompt ({n} tokens) + max_tokens ({msg.sampling.max_tokens}) exceeds "
                    f"the context length ({self.max_model_len})")  # fmt: skip
        ids = msg.prompt_token_ids
        if max(ids) >= self.model_config.vocab_size or min(ids) < 0:
            return "prompt holds token ids outside the vocabulary"
        return None

    def _media_problem(
        self, msg: EngineRequest, embeddings: list[torch.Tensor] | None
    ) -> str | None:
        """Why the request's images cannot be served here, if they cannot."""
        if not msg.media:
            return None if embeddings is None else "embeddings given for a prompt without images"
        vision = self.model_config.vision
        if vision is None:
            return f"{self.model_name} takes no images"
        prompt, end = msg.prompt_token_ids, 0
        for item in msg.media:
            t, h, w = item.grid
            if item.offset < end or item.end > len(prompt) or item.length < 1:
                return "image placeholders overlap or lie outside the prompt"
            if t * h * w != item.length * vision.spatial_merge_size**2:
                return f"an image of grid {item.grid} does not take {item.length} tokens"
            if any(tok != vision.image_token_id for tok in prompt[item.offset : item.end]):
                return "an image's placeholder tokens are not the image token"
            end = item.end
        with_data = sum(1 for m in msg.media if m.data)
        if with_data not in (0, len(msg.media)) or (with_data and embeddings is not None):
            return "a request's images come with their files or their embeddings, not both"
        if with_data and self.media.encoder is None:
            return "this worker has no vision encoder (its images are encoded elsewhere)"
        if embeddings is not None:
            shapes = [(m.length, vision.out_hidden_size) for m in msg.media]
            if [tuple(e.shape) for e in embeddings] != shapes:
                return "the image embeddings do not fit the image placeholders"
        return None

    def _drop_uncomputable(self) -> list[RequestOutput]:
        """End the waiting requests that would compute image tokens whose embeddings this
        engine does not have (a decode worker whose cache lost a preempted request's image
        blocks): an error beats a wrong answer."""
        failed = []
        for req in list(self.scheduler.waiting):
            if not req.media or self.media.has(req.request_id):
                continue
            if self.kv.match_prefix(req).num_tokens < req.media_end:
                self.scheduler.abort([req.request_id])
                failed.append(RequestOutput(
                    req.request_id, [], "error",
                    error="its image tokens must be recomputed and this worker has no "
                          "embeddings for them",
                ))  # fmt: skip
        return failed

    def abort(self, request_ids: list[str]) -> None:
        self.media.abort(request_ids)
        self.grammars.abort(request_ids)
        self.scheduler.abort(request_ids)

    @property
    def has_work(self) -> bool:
        return (self.scheduler.has_work or bool(self.grammars) or bool(self.media)
                or self._inflight is not None)  # fmt: skip

    def step(self) -> list[RequestOutput]:
        """One engine step: plan, run, fold the sampled tokens back.

        With overlap scheduling the device never waits for the host between steps: a
        step whose requests can all go on before their tokens are known (not prefill-only;
        with drafts only as ``_can_run_on`` says; penalties and min_tokens count the tokens
        the device alone has: ``sampler.PendingTokens``; a structured request's sampling
        waits for them: ``ModelRunner.complete``) is left running, and the next ``step``
        plans and launches its successor — whose input tokens come from that step's output
        on the device — before it collects it. A request that the collected tokens end has
        then run one step too many; that step's tokens are dropped.
        """
        if self.grammars and not self.scheduler.has_work and self._inflight is None:
            self.grammars.wait(_GRAMMAR_POLL_S)
        outputs = []
        if self.media:
            encoded, failed = self.media.take_ready()
            for req in encoded:
                self._admit(req)
            outputs += failed
        ready, failed = self.grammars.take_ready()
        for req in ready:
            self.scheduler.add(req)
        outputs += failed
        outputs += self._drop_uncomputable()
        previous, self._inflight = self._inflight, None
        launched = None
        start = time.perf_counter()
        if self.scheduler.has_work:
            plan = self.scheduler.schedule()
            launched = (plan, self.runner.launch(plan))
        host_s = time.perf_counter() - start
        if previous is not None:
            result = self.runner.finish(previous[1])
            start = time.perf_counter()
            outputs += self.scheduler.update(previous[0], result)
            host_s += time.perf_counter() - start
        if launched is not None:
            # a step whose masks needed the tokens just collected samples now
            self.runner.complete(launched[1])
            if self.overlap and self._can_run_on(launched[0]):
                self.scheduler.assume_sampled(launched[0])
                self._inflight = launched
            else:
                plan, pending = launched
                result = self.runner.finish(pending)
                start = time.perf_counter()
                outputs += self.scheduler.update(plan, result)
                host_s += time.perf_counter() - start
                if result.timing is not None and self.runner.computes_in_launch:
                    host_s -= result.timing.forward_s + result.timing.sample_s
            self.scheduler.spec.host_time(host_s, launched[0])
        for out in outputs:
            if out.finish_reason is not None:
                self.media.release(out.request_id)
        return outputs

    def _can_run_on(self, plan: StepPlan) -> bool:
        """Whether the next step can be planned before ``plan``'s tokens are known. After a
        step that verifies drafts, only where its drafter drafts on the device: the device
        places the next rows of its requests after the tokens kept (``engine.runner``),
        whatever else the next step holds; a host drafter's drafts need the tokens on the
        host. (A structured request's next mask needs its grammar advanced by the tokens
        on the host: the runner samples that step once this one is collected.)"""
        if not self.scheduler.overlappable:
            return False
        return not plan.num_draft_tokens or self.scheduler.spec.on_device

    def drain_kv_events(self) -> list[KVEvent]:
        """What the KV cache and its tiers gained or lost since the last call."""
        return self.kv.pool.drain_events()

    def ready(self, role: str, endpoint: KVEndpoint | None = None,
              **group: Any) -> WorkerReady:  # fmt: skip
        """The ready message of a worker serving this engine as ``role`` (``group``: a
        rank's ``group``, ``rank`` and ``group_size``, and more ``startup`` phases)."""
        cache = self.config.cache
        startup = {**self.startup, **group.pop("startup", {})}
        return WorkerReady(role, cache.num_blocks, cache.block_size, self.max_model_len,
                           self.model_name, self.hash_extra, endpoint, self.config.device,
                           cache.num_blocks * self.kv_cache.layout.bytes_per_block,
                           startup=startup, encodes_images=self.media.encoder is not None,
                           **group)  # fmt: skip

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


# -- the engine process ----------------------------------------------------------------------


class EngineRole(WorkerRole):
    """The aggregated engine: every request prefilled and decoded here."""

    role = "engine"
    codec = ENGINE

    def __init__(self, config: WorkerConfig, secret: str) -> None:
        self.core = EngineCore(config.engine, progress=True)
        self._outbox = Outbox()

    def ready(self) -> WorkerReady:
        return self.core.ready(self.role)

    def handle(self, msg: msgspec.Struct) -> EngineRequest | None:
        if isinstance(msg, Abort):
            self.core.abort(msg.request_ids)
            self._outbox.ended += msg.request_ids
            return None
        err = self.core.add_request(msg)
        if err is not None:
            self._outbox.outputs.append(err)
        return msg

    @property
    def busy(self) -> bool:
        return self.core.has_work

    def step(self) -> Outbox:
        out, self._outbox = self._outbox, Outbox()
        if self.core.has_work:
            out.outputs += self.core.step()
        out.stats = self.stats()
        return out

    def stats(self) -> WorkerStats:
        return WorkerStats(self.core.scheduler.stats(), events=self.core.drain_kv_events(),
                           draining=self.draining)  # fmt: skip

    def check_integrity(self) -> None:
        self.core.check_integrity()


if __name__ == "__main__":
    worker_main(EngineRole)


