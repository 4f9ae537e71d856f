"""What every kernel wrapper shares: TileLang detection, boundary checks, a build cache
and its parallel builds."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.util
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

log = logging.getLogger("ferry.kernels")

TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
ATTENTION_DTYPES = (torch.bfloat16, torch.float16)


def tilelang_available() -> bool:
    """True when TileLang can be imported (it needs no GPU to import)."""
    return importlib.util.find_spec("tilelang") is not None


def kernels_usable(device: torch.device | str) -> bool:
    """True when the TileLang kernels can run on ``device``: CUDA and TileLang present."""
    return torch.device(device).type == "cuda" and tilelang_available()


def tl_dtype(dtype: torch.dtype) -> str:
    try:
        return TL_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no TileLang kernel") from None


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    ndim: int,
    device: torch.device | None = None,
) -> None:
    """Raise ValueError unless ``t`` is contiguous, of ``dtype`` and rank ``ndim``.

    The kernels index raw pointers with the strides of a contiguous tensor, so a view
    with other strides would be read wrongly rather than fail: refuse it here.
    """
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype}, expected one of {dtypes}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected rank {ndim}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: strides {t.stride()} are not contiguous for {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")


def check_paged_cache(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, num_kv_heads: int,
) -> None:  # fmt: skip
    """Raise ValueError unless ``kv_cache`` is a paged cache of ``q``'s dtype and device,
    ``[blocks, block_size, 2 * num_kv_heads * D]`` for ``q``'s head dim D, with int32
    ``block_tables`` (rank 2) and ``seq_lens`` (rank 1) beside it."""
    check_tensor("kv_cache", kv_cache, dtype=q.dtype, ndim=3, device=q.device)
    check_tensor("block_tables", block_tables, dtype=torch.int32, ndim=2, device=q.device)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=q.device)
    dim = q.shape[-1]
    if kv_cache.shape[2] != 2 * num_kv_heads * dim:
        raise ValueError(f"kv_cache width {kv_cache.shape[2]} != 2 * {num_kv_heads} * {dim}")


def check_rows_contiguous(name: str, t: torch.Tensor, ndim: int) -> None:
    """Raise ValueError unless every dim but the first is packed (the first may stride)."""
    if t.dim() != ndim:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected rank {ndim}")
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            raise ValueError(f"{name}: strides {t.stride()} are not row-contiguous")
        expected *= size


def check_layer_cache(kv_cache: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
    """Raise ValueError unless a layer's cache has the shape and dtype a step planned for
    (its first layer's), packed: what a kernel prepared once per step checks per layer."""
    if kv_cache.shape != shape or kv_cache.dtype != dtype or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} differs from "
                         f"the step's {tuple(shape)} {dtype} or is not contiguous")


def output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where a kernel writes its ``[T, H, D]`` result: ``out`` once checked to be packed
    and shaped as ``q``, or a new tensor."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype}, expected q's shape "
                         f"{tuple(q.shape)} and dtype {q.dtype}, contiguous")
    return out


@dataclass(frozen=True)
class TileLangBuild:
    """How one kernel is built: ``program(*args)`` traced into its TIR function, then lowered
    and compiled by TileLang (which keeps it in its disk cache: a later build of the same
    function, in this process or another, loads it)."""

    program: Callable[..., Any]
    args: tuple
    fast_math: bool = False

    def build(self) -> Any:
        import tilelang

        configs = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True} if self.fast_math else None
        kernel = tilelang.jit(out_idx=None, pass_configs=configs)(self.program)(*self.args)
        mark = self._mark()
        if mark is not None:
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
        return kernel

    def built_before(self) -> bool:
        """Whether this kernel was built before on this machine, so that building it now
        loads it from TileLang's disk cache rather than compiling it: a mark left beside
        that cache by the build (in any process), keyed by the program's source file, its
        arguments and TileLang's version. Clearing the cache clears the marks."""
        mark = self._mark()
        return mark is not None and mark.exists()

    def _mark(self) -> Path | None:
        from tilelang import __version__
        from tilelang.env import env

        if not env.is_cache_enabled():
            return None
        identity = repr((self.program.__module__, self.program.__qualname__,
                         _source_digest(self.program.__module__), self.args, self.fast_math,
                         __version__, os.environ.get("TILELANG_DEFAULT_TARGET")))  # fmt: skip
        digest = hashlib.sha256(identity.encode()).hexdigest()[:32]
        return Path(env.TILELANG_CACHE_DIR) / "ferry-builds" / digest


@functools.cache
def _source_digest(module: str) -> str:
    """A digest of a module's source file: a kernel's program changes with it."""
    return hashlib.sha256(Path(sys.modules[module].__file__).read_bytes()).hexdigest()


class KernelCache:
    """Compiled kernels by configuration key; builds each key once (``make(key)``: its
    ``TileLangBuild``), thread-safe. ``build_seconds``: the time every cache of the process
    has spent building (compiling, or loading from TileLang's disk cache) so far."""

    build_seconds: ClassVar[float] = 0.0

    def __init__(self) -> None:
        self._kernels: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[Any], TileLangBuild]) -> Any:
        kernel = self._kernels.get(key)
        if kernel is None:
            batch = getattr(_BATCH, "current", None)
            if batch is not None:
                return batch.defer(self, key, make)
            with self._lock:
                kernel = self._kernels.get(key)
                if kernel is None:
                    started = time.perf_counter()
                    kernel = make(key).build()
                    KernelCache.build_seconds += time.perf_counter() - started
                    self._kernels[key] = kernel
        return kernel

    def __len__(self) -> int:
        return len(self._kernels)

    def kept(self, key: Hashable, make: Callable[[Any], TileLangBuild]) -> KeptKernel:
        """The kernel of ``key`` for something that keeps it past this call (a step's
        plan): inside ``parallel_builds`` a kernel not built yet is one that does nothing,
        which must not be kept once the section has built the real one."""
        return KeptKernel(self, key, make)


class KeptKernel:
    """A ``KernelCache`` kernel held by what calls it many times: the cache's kernel,
    looked up again while it is still the do-nothing stand-in of a ``parallel_builds``
    section (a decode graph captured after its dry run must run the built kernel)."""

    __slots__ = ("_cache", "_key", "_make", "_kernel")

    def __init__(self, cache: KernelCache, key: Hashable,
                 make: Callable[[Any], TileLangBuild]) -> None:  # fmt: skip
        self._cache, self._key, self._make = cache, key, make
        self._kernel = cache.get(key, make)

    def __call__(self, *args: Any) -> Any:
        if self._kernel is _skipped:
            self._kernel = self._cache.get(self._key, self._make)
        return self._kernel(*args)


def _skipped(*args: Any, **kwargs: Any) -> None:
    """What a kernel not built yet runs inside ``parallel_builds``: nothing."""


def _build_elsewhere(make: Callable[[Any], TileLangBuild], key: Hashable) -> None:
    """In a worker process: build one kernel, which leaves it in TileLang's disk cache."""
    make(key).build()


class _BuildBatch:
    """The builds a ``parallel_builds`` section asked for, in the order it asked."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pending: dict[tuple[int, Hashable], tuple[KernelCache, Hashable, Callable]] = {}

    def defer(self, cache: KernelCache, key: Hashable, make: Callable[[Any], TileLangBuild]):
        self._pending.setdefault((id(cache), key), (cache, key, make))
        return _skipped

    def finish(self) -> int:
        """Build every kernel asked for. Those never built on this machine before
        (``built_before``) are compiled first, on ``workers`` processes at once when there
        are several (TileLang's compiler is not safe to run in several threads of one
        process: layout inference failed); then each is built here, in the order asked,
        which loads it from the disk cache. A build that failed on a worker is built here
        again, where its error is raised. Returns how many."""
        todo = list(self._pending.values())
        fresh = [item for item in todo if not item[2](item[1]).built_before()]
        if len(fresh) > 1 and self.workers > 1:
            _compile_in_processes(fresh, self.workers)
        for cache, key, make in todo:
            cache.get(key, make)
        return len(todo)


def _compile_in_processes(todo: list[tuple[KernelCache, Hashable, Callable]], workers: int) -> None:
    started = time.perf_counter()
    workers = min(workers, len(todo))
    log.info(
        "compiling up to %d GPU kernels on %d processes (the first start with these shapes "
        "here; later starts load them from TileLang's cache)", len(todo), workers,
    )  # fmt: skip
    context = multiprocessing.get_context("spawn")  # the parent holds a CUDA context
    with concurrent.futures.ProcessPoolExecutor(workers, context) as pool:
        futures = [pool.submit(_build_elsewhere, make, key) for _, key, make in todo]
        concurrent.futures.wait(futures)
    failed = sum(f.exception() is not None for f in futures)
    log.info("GPU kernels compiled in %.1f s%s", time.perf_counter() - started,
             f" ({failed} failed there: built here again)" if failed else "")  # fmt: skip
    KernelCache.build_seconds += time.perf_counter() - started


_BATCH = threading.local()


@contextlib.contextmanager
def parallel_builds(workers: int | None = None) -> Iterator[None]:
    """Build the kernels that the code inside asks for all at once when they have to be
    compiled, on ``workers`` processes (default: one per core), instead of one after
    another as each is first called; leaving the section builds them (``_BuildBatch``).

    A kernel not built yet does *nothing* when called inside: its outputs keep whatever
    they held. So the section is for a dry run whose results are thrown away (the decode
    graphs' and the warm-up's forwards over padding, ``engine.cuda_graphs``,
    ``engine.runner``), over code in which no kernel's output decides what runs next or
    indexes memory. Built ones run as usual; sections do not nest (the outer one builds).
    Only calls from this thread are deferred."""
    if getattr(_BATCH, "current", None) is not None:
        yield
        return
    batch = _BuildBatch(workers or os.cpu_count() or 1)
    _BATCH.current = batch
    try:
        yield
    finally:
        _BATCH.current = None
    batch.finish()


def compile_seconds() -> float:
    """Seconds this process has spent building kernels (``KernelCache.build_seconds``)."""
    return KernelCache.build_seconds
