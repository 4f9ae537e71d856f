"""Block-quantized weight products on the CPU: ``y = x @ W.T`` with W in 4 or 8 bits.

At decode on a CPU a step's cost is reading the weights once; SmolLM2-135M in float32 is
540 MB a token, in these formats ~95 MB. The weight formats are llama.cpp's Q4_1 and
Q8_0 with float32 scales, stored row by row in blocks of ``BLOCK`` (32) input features:

- ``Q4`` (24 bytes a block): ``float d, m; uint8 qs[16]``, ``w[j] = d * q[j] + m`` with
  ``q[j]`` the low nibble of ``qs[j]`` for ``j < 16``, the high nibble of ``qs[j - 16]``
  above. GGUF's Q4_1 and Q4_0 (``m = -8 d``) blocks map onto it exactly.
- ``Q8`` (36 bytes a block): ``float d; int8 qs[32]``, ``w[j] = d * qs[j]``; GGUF's Q8_0
  exactly.

``qgemm`` rounds the rows of ``x`` per block of 32 to 16-bit integers (scale ``max|x| /
32767``: a relative error under 2e-5 of the block's largest value, against 4e-3 for the
8-bit activations llama.cpp uses) and takes exact integer dot products per block, scaled
in float32: the product is ``x`` so rounded against the exact weights (``qgemm_ref``
states it in torch). 8-bit activations moved the default model's logits by up to 0.3,
enough to flip a greedy choice whose margin was 0.08; 16-bit ones (``vpmaddwd`` on
weights unpacked to 16 bits instead of ``vpmaddubsw``) moved them by under 0.005, for
about 30% more time at one row. ``gated=True`` takes the fused gate/up output
``[M, 2K]`` and multiplies ``silu(gate) * up`` (SwiGLU) into the weights, so the MLP's
activation costs no extra pass. ``dequantize`` gives the weights back in float32
exactly (the prefill path, where a float32 GEMM is faster than the integer one).

The kernels are C (``cpu_quant.c``: AVX2 + FMA where the CPU has them, portable C
elsewhere), compiled on first use with the system C compiler into ``build_dir`` and
loaded with ctypes; ``load`` returns None when no compiler is found, and callers then
run ``dequantize_ref`` + ``F.linear``. OpenMP threads come from libgomp, the runtime
torch itself loads, so the kernels and torch share one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("ferry.kernels")

BLOCK = 32
Q4, Q8 = 4, 8
BLOCK_BYTES = {Q4: 24, Q8: 36}
_ACT_BLOCK_BYTES = 72  # float d, float s, int16 qs[32]
_SOURCE = Path(__file__).with_name("cpu_quant.c")


@dataclass(frozen=True)
class QuantWeight:
    """A weight matrix ``[n, k]`` in ``kind`` (Q4 or Q8) blocks: ``data`` is uint8
    ``[n, k / BLOCK * BLOCK_BYTES[kind]]``, contiguous; row slices of it are weights too."""

    kind: int
    data: torch.Tensor
    k: int

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES or self.k % BLOCK:
            raise ValueError(f"kind {self.kind}, k {self.k}: expected Q4/Q8 and k % {BLOCK} == 0")
        if self.data.dtype != torch.uint8 or self.data.shape[-1] != self.row_bytes:
            raise ValueError(f"data {tuple(self.data.shape)} is not [n, {self.row_bytes}] uint8")

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.k // BLOCK * BLOCK_BYTES[self.kind]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


# ---- packing: from float32 or from llama.cpp's blocks ------------------------------------


def _pack(kind: int, scales: list[torch.Tensor], qs: torch.Tensor) -> torch.Tensor:
    """Blocks ``[n, nb, bytes]`` from float32 scales ``[n, nb]`` each and payload bytes."""
    parts = [s.to(torch.float32).contiguous().unsqueeze(-1).view(torch.uint8) for s in scales]
    return torch.cat([*parts, qs.view(torch.uint8)], dim=-1).reshape(qs.shape[0], -1)


def pack_q4(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> QuantWeight:
    """Q4 weight from scales ``d``, offsets ``m`` ``[n, nb]`` and codes ``q`` (0..15,
    ``[n, nb, 32]``): ``w = d * q + m``."""
    n, nb, _ = q.shape
    q = q.to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return QuantWeight(Q4, _pack(Q4, [d, m], qs), nb * BLOCK)


def pack_q8(d: torch.Tensor, q: torch.Tensor) -> QuantWeight:
    """Q8 weight from scales ``d`` ``[n, nb]`` and codes ``q`` (-127..127, ``[n, nb, 32]``)."""
    n, nb, _ = q.shape
    return QuantWeight(Q8, _pack(Q8, [d], q.to(torch.int8).contiguous()), nb * BLOCK)


def quantize(weight: torch.Tensor, kind: int) -> QuantWeight:
    """Quantize a float matrix ``[n, k]``: Q4 by each block's min and max (``d = (max -
    min) / 15``, ``m = min``), Q8 by its largest magnitude (``d = max|w| / 127``)."""
    n, k = weight.shape
    w = weight.detach().to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    if kind == Q4:
        lo, hi = w.amin(-1), w.amax(-1)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((w - lo[..., None]) * inv[..., None]).round().clamp(0, 15)
        return pack_q4(d, lo, q)
    d = w.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return pack_q8(d, (w * inv[..., None]).round().clamp(-127, 127))


def unpack(weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d, m, q)``: scales and offsets ``[n, nb]`` (m zero for Q8) and codes ``[n, nb, 32]``
    as float32."""
    nb = weight.k // BLOCK
    blocks = weight.data.reshape(weight.n, nb, BLOCK_BYTES[weight.kind])
    d = blocks[..., 0:4].contiguous().view(torch.float32)[..., 0]
    if weight.kind == Q4:
        m = blocks[..., 4:8].contiguous().view(torch.float32)[..., 0]
        qs = blocks[..., 8:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
    else:
        m = torch.zeros_like(d)
        q = blocks[..., 4:].contiguous().view(torch.int8).float()
    return d, m, q


# ---- references ---------------------------------------------------------------------------


def dequantize_ref(weight: QuantWeight) -> torch.Tensor:
    """The weights as float32 ``[n, k]``: ``d * q + m`` (bit-exact with GGUF's own
    dequantization of Q4_1/Q4_0/Q8_0 blocks, which rounds the same two operations)."""
    d, m, q = unpack(weight)
    w = d[..., None] * q if weight.kind == Q8 else d[..., None] * q + m[..., None]
    return w.reshape(weight.n, weight.k)


def quantize_activations_ref(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded the way ``qgemm`` rounds it: per row and block of 32, to 16-bit codes
    of scale ``max|x| / 32767`` (round half away from zero), returned as float32."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 32767
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    v = xb * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * d).reshape(m, k)


def qgemm_ref(
    x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None, gated: bool = False
) -> torch.Tensor:
    """What ``qgemm`` computes, in float64 then rounded: ``x`` (or ``silu(gate) * up`` when
    ``gated``) quantized per block, times the exact weights."""
    if gated:
        gate, up = x.float().chunk(2, dim=-1)
        x = F.silu(gate) * up
    xq = quantize_activations_ref(x).double()
    y = xq @ dequantize_ref(weight).double().T
    if bias is not None:
        y = y + bias.double()
    return y.float()


# ---- the compiled kernels -----------------------------------------------------------------


class CpuQuantKernels:
    """The compiled library: ``qgemm`` and ``dequantize`` on contiguous CPU tensors."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.ferry_qgemm.argtypes = [i32, ptr, i64, i64, i32, ptr, i64, ptr, ptr, ptr, i32]
        lib.ferry_qgemm.restype = None
        lib.ferry_dequantize.argtypes = [i32, ptr, i64, i64, ptr, i32]
        lib.ferry_dequantize.restype = None
        lib.ferry_simd.restype = i32
        self._lib = lib
        self.path = path
        self.simd = "avx2" if lib.ferry_simd() == 2 else "portable"

    def qgemm(
        self,
        x: torch.Tensor,
        weight: QuantWeight,
        bias: torch.Tensor | None = None,
        gated: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [M, K]`` float32 (``[M, 2K]`` when ``gated``) → ``[M, n]`` float32."""
        m, width = x.shape
        k = weight.k
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or not x.is_contiguous()
            or width != (2 * k if gated else k)
        ):
            raise ValueError(f"qgemm: x {tuple(x.shape)} {x.dtype} against k={k}")
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weight.n,)):
            raise ValueError("qgemm: bias must be float32 [n]")
        y = torch.empty(m, weight.n, dtype=torch.float32) if out is None else out
        scratch = torch.empty(m * (k // BLOCK) * _ACT_BLOCK_BYTES, dtype=torch.uint8)
        self._lib.ferry_qgemm(
            weight.kind, x.data_ptr(), m, k, int(gated), weight.data.data_ptr(), weight.n,
            None if bias is None else bias.contiguous().data_ptr(), y.data_ptr(),
            scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return y

    def dequantize(self, weight: QuantWeight) -> torch.Tensor:
        """The weights as float32 ``[n, k]`` (same values as ``dequantize_ref``)."""
        out = torch.empty(weight.n, weight.k, dtype=torch.float32)
        self._lib.ferry_dequantize(
            weight.kind, weight.data.data_ptr(), weight.n, weight.k, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out


def _flags() -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=c11"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags


_LOADED: dict[Path, CpuQuantKernels | None] = {}


def load(build_dir: str | Path) -> CpuQuantKernels | None:
    """The kernels, compiled into ``build_dir`` on first use (keyed by the source, the
    flags and the compiler, so an edit or another CPU rebuilds); None, with a warning, when
    there is no C compiler or it fails."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    flags = _flags()
    if compiler is None:
        log.warning("no C compiler: quantized CPU weights run without their kernels (slower)")
        return None
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join([compiler, *flags]).encode())
    key = digest.hexdigest()[:16]
    path = Path(build_dir) / f"ferry_cpu_quant_{key}.so"
    if path in _LOADED:
        return _LOADED[path]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            cmd = [compiler, *flags, str(_SOURCE), "-o", str(built), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("compiling %s failed; running without it:\n%s", _SOURCE, done.stderr)
                _LOADED[path] = None
                return None
            os.replace(built, path)  # atomic: workers starting together may both build
    _LOADED[path] = CpuQuantKernels(path)
    return _LOADED[path]
