"""CPU kernels in C (``cpu.c``), compiled on first use and called through ctypes.

At decode on a 2-core CPU a SmolLM2-135M step is ~120 weight products and ~1,500 small
torch ops; each op costs a few microseconds of dispatch, together more than the
products. These kernels do a decoder layer's work in seven calls: the block-quantized
products (``qgemm``, formats and references in ``kernels.cpu_quant``), fused residual
add + RMSNorm (``rms_norm``, reference ``kernels.norm_rope_cache.rms_norm_ref``), RoPE in
place (``rope``, reference ``rotary_embedding_ref``), the KV store by slot (``store_kv``,
reference ``write_kv_cache_ref``) and paged decode attention (``decode_attention``,
reference ``kernels.paged_decode_attention.paged_decode_attention_ref``). All take
float32, contiguous where not said otherwise, on the CPU; the wrappers check that.

``load(build_dir)`` compiles ``cpu.c`` with the system C compiler (``-O3``, AVX2 + FMA
where the CPU has them, portable C elsewhere) into ``build_dir``, keyed by the source,
the flags and the compiler, and returns None with a warning when there is no compiler or
it fails; callers then stay on torch ops. OpenMP threads come from ``libgomp.so.1``, the
runtime torch's CPU wheel itself loads, so kernels and torch share one thread pool.

``record`` notes the calls made through it (and makes them); ``program`` turns them into
one ``ferry_replay`` call that makes them again with the same arguments, without Python in
between: a decode step's layers replayed (``engine.cuda_graphs``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.cpu_quant import QuantWeight

log = logging.getLogger("ferry.kernels")

_SOURCE = Path(__file__).with_name("cpu.c")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(t: torch.Tensor, dtype: torch.dtype, name: str, contiguous: bool = True) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or (contiguous and not t.is_contiguous()):
        raise ValueError(f"{name}: expected a contiguous {dtype} CPU tensor, got {t.dtype}")


class CpuKernels:
    """The compiled library. Every method checks its operands and runs on torch's thread
    count (``torch.get_num_threads()``)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        signatures = {
            "ferry_qgemm": [i32, ptr, i64, i64, i32, ptr, i64, ptr, ptr, i32],
            "ferry_dequantize": [i32, ptr, i64, i64, ptr, i32],
            "ferry_rms_norm": [ptr, ptr, ptr, f32, i64, i64, ptr],
            "ferry_rope": [ptr, i64, i64, i64, i64, ptr, ptr],
            "ferry_store_kv": [ptr, i64, i64, i64, ptr, ptr],
            "ferry_decode_attention": [
                ptr, i64, i64, i64, i64, i64, ptr, i64, ptr, i64, ptr, f32, ptr, i32,
            ],
        }  # fmt: skip
        for name, args in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
        lib.ferry_qgemm.restype = i32
        lib.ferry_simd.restype = i32
        lib.ferry_replay.argtypes, lib.ferry_replay.restype = [ptr, i64], i32
        self._lib = lib
        self._signatures = signatures
        self._recording: Recording | None = None
        self.path = path
        self.simd = "avx2" if lib.ferry_simd() == 2 else "portable"

    # ---- recording ----------------------------------------------------------------------

    def _call(self, name: str, *args: object) -> object:
        rec = self._recording
        if rec is not None and rec.active:
            if name in _REPLAYED:
                rec.calls.append((name, args))
            else:
                rec.refuse(f"{name} is not replayed")
        return getattr(self._lib, name)(*args)

    @contextlib.contextmanager
    def record(self) -> Iterator[Recording]:
        """Record the calls made from ``Recording.start`` on (they run as well) for
        ``program``. The recorded pointers must stay valid and hold the same kind of
        data at every replay: the caller keeps every tensor they point into."""
        rec = self._recording = Recording()
        try:
            yield rec
        finally:
            self._recording = None

    def program(self, rec: Recording) -> Program:
        """The recorded calls, replayed in one call."""
        calls = (_Call * len(rec.calls))()
        for call, (name, args) in zip(calls, rec.calls):
            ints = [0 if a is None else int(a) for a, t in zip(args, self._signatures[name])
                    if t is not ctypes.c_float]  # fmt: skip
            floats = [float(a) for a, t in zip(args, self._signatures[name]) if t is ctypes.c_float]
            call.fn = _REPLAYED[name]
            call.i[: len(ints)] = ints
            call.f[: len(floats)] = floats
        return Program(self._lib, calls)

    # ---- weight products ----------------------------------------------------------------

    def qgemm(
        self,
        x: torch.Tensor,
        weight: QuantWeight,
        bias: torch.Tensor | None = None,
        gated: bool = False,
    ) -> torch.Tensor:
        """``x [M, K] @ W.T (+ bias)`` → ``[M, n]``; with ``gated``, ``x`` is ``[M, 2K]``
        (gate | up) and the product takes ``silu(gate) * up``."""
        m, width = x.shape
        k = weight.k
        _check(x, torch.float32, "qgemm x")
        if width != (2 * k if gated else k):
            raise ValueError(f"qgemm: x {tuple(x.shape)} against k={k} (gated={gated})")
        if bias is not None:
            _check(bias, torch.float32, "qgemm bias")
        y = torch.empty(m, weight.n, dtype=torch.float32)
        failed = self._call(
            "ferry_qgemm",
            weight.kind, x.data_ptr(), m, k, int(gated), weight.data.data_ptr(), weight.n,
            _ptr(bias), y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"qgemm: no memory for {m} x {k} activations")
        return y

    def dequantize(self, weight: QuantWeight) -> torch.Tensor:
        """The weights as float32 ``[n, k]`` (the values of ``cpu_quant.dequantize_ref``)."""
        _check(weight.data, torch.uint8, "dequantize blocks")
        out = torch.empty(weight.n, weight.k, dtype=torch.float32)
        self._call(
            "ferry_dequantize",
            weight.kind, weight.data.data_ptr(), weight.n, weight.k, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    # ---- the rest of a decoder layer ----------------------------------------------------

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rmsnorm(x) * weight`` into a new tensor; with ``residual``: first
        ``residual += x`` in place, then the norm of that."""
        _check(x, torch.float32, "rms_norm x")
        _check(weight, torch.float32, "rms_norm weight")
        if residual is not None:
            _check(residual, torch.float32, "rms_norm residual")
            if residual.shape != x.shape:
                raise ValueError("rms_norm: residual and x differ in shape")
        d = x.shape[-1]
        out = torch.empty_like(x)
        self._call(
            "ferry_rms_norm",
            x.data_ptr(), _ptr(residual), weight.data_ptr(), eps, x.numel() // d, d,
            out.data_ptr(),
        )  # fmt: skip
        return out

    @staticmethod
    def rope_supported(x: torch.Tensor) -> bool:
        """Whether ``rope`` takes ``x`` as it is (float32, heads and D contiguous)."""
        return x.dim() == 3 and x.dtype == torch.float32 and x.stride(2) == 1 and (
            x.stride(1) == x.shape[2]
        )

    def rope(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """Rotate ``x [T, H, D]`` in place (rotate-half form) by ``cos_sin[positions]``.
        ``x`` may be a row slice of a wider matrix: heads and D contiguous, any row stride."""
        t, heads, d = x.shape
        if not self.rope_supported(x):
            raise ValueError("rope: x must be float32 [T, H, D] with contiguous heads")
        _check(positions, torch.int64, "rope positions")
        _check(cos_sin, torch.float32, "rope cos_sin")
        self._call(
            "ferry_rope",
            x.data_ptr(), t, x.stride(0), heads, d, positions.data_ptr(), cos_sin.data_ptr()
        )

    def store_kv(self, kv: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """``cache.view(-1, W)[slots] = kv`` for ``kv [T, W]`` (rows may be strided)."""
        t, width = kv.shape
        if kv.dtype != torch.float32 or kv.stride(1) != 1:
            raise ValueError("store_kv: kv must be float32 with contiguous rows")
        _check(cache, torch.float32, "store_kv cache")
        _check(slots, torch.int64, "store_kv slots")
        if cache.shape[-1] != width:
            raise ValueError(f"store_kv: cache rows of {cache.shape[-1]}, kv rows of {width}")
        self._call(
            "ferry_store_kv",
            kv.data_ptr(), t, kv.stride(0), width, cache.data_ptr(), slots.data_ptr()
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        num_kv_heads: int,
        scale: float,
    ) -> torch.Tensor:
        """One query per sequence, ``q [B, Hq, D]`` (heads contiguous, any row stride),
        over ``cache [blocks, block_size, 2 * Hkv * D]`` → float32 ``[B, Hq, D]``."""
        b, heads, d = q.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d:
            raise ValueError("decode_attention: q must be float32 [B, H, D], heads contiguous")
        _check(cache, torch.float32, "decode_attention cache")
        _check(block_tables, torch.int32, "decode_attention block_tables")
        _check(seq_lens, torch.int32, "decode_attention seq_lens")
        if cache.shape[-1] != 2 * num_kv_heads * d or heads % num_kv_heads:
            raise ValueError("decode_attention: cache rows do not match the heads")
        out = torch.empty(b, heads, d, dtype=torch.float32)
        self._call(
            "ferry_decode_attention",
            q.data_ptr(), q.stride(0), b, heads, num_kv_heads, d, cache.data_ptr(),
            cache.shape[1], block_tables.data_ptr(), block_tables.shape[1],
            seq_lens.data_ptr(), scale, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out


# the calls a program replays, by their id in cpu.c's ferry_replay
_REPLAYED = {"ferry_qgemm": 0, "ferry_rms_norm": 1, "ferry_rope": 2, "ferry_store_kv": 3,
             "ferry_decode_attention": 4}  # fmt: skip


class _Call(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_int64), ("i", ctypes.c_int64 * 14), ("f", ctypes.c_float * 2)]


@dataclass
class Recording:
    """The kernel calls of a forward from ``start`` on (``CpuKernels.record``), or why
    they cannot be replayed (``refused``)."""

    calls: list[tuple[str, tuple]] = field(default_factory=list)
    active: bool = False
    refused: str | None = None

    def start(self) -> None:
        self.active = True

    def refuse(self, reason: str) -> None:
        self.refused = self.refused or reason


class Program:
    """Recorded kernel calls replayed in one call (no Python between them)."""

    def __init__(self, lib: ctypes.CDLL, calls: ctypes.Array) -> None:
        self._lib, self._calls = lib, calls

    def __len__(self) -> int:
        return len(self._calls)

    def __call__(self) -> None:
        status = self._lib.ferry_replay(ctypes.addressof(self._calls), len(self._calls))
        if status:
            raise MemoryError("a replayed kernel found no memory for its activations")


def _flags() -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=c11"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags


_LOADED: dict[Path, CpuKernels | None] = {}


def load(build_dir: str | Path) -> CpuKernels | None:
    """The kernels, compiled into ``build_dir`` on first use (an edited source, other
    flags or another compiler build anew); None, with a warning, without a compiler or
    when it fails."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: the CPU runs on torch ops alone (slower)")
        return None
    flags = _flags()
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join([compiler, *flags]).encode())
    path = Path(build_dir) / f"ferry_cpu_{digest.hexdigest()[:16]}.so"
    if path in _LOADED:
        return _LOADED[path]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            cmd = [compiler, *flags, str(_SOURCE), "-o", str(built), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("compiling %s failed; torch ops instead:\n%s", _SOURCE, done.stderr)
                _LOADED[path] = None
                return None
            os.replace(built, path)  # atomic: workers starting together may both build
    _LOADED[path] = CpuKernels(path)
    return _LOADED[path]
