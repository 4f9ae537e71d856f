"""What every kernel wrapper shares: TileLang detection, boundary checks, a build cache."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import torch

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


def check_rows_contiguous(name: str, t: torch.Tensor, ndim: int) -> None:
    """Raise ValueError unless every dim but the first is packed (the first may stride)."""
    if t.dim() != ndim:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected rank {ndim}")
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            raise ValueError(f"{name}: strides {t.stride()} are not row-contiguous")
        expected *= size


class KernelCache:
    """Compiled kernels by configuration key; builds each key once, thread-safe.
    ``build_seconds``: the time every cache of the process has spent building (compiling,
    or loading from TileLang's disk cache) so far."""

    build_seconds: ClassVar[float] = 0.0

    def __init__(self) -> None:
        self._kernels: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        kernel = self._kernels.get(key)
        if kernel is None:
            with self._lock:
                kernel = self._kernels.get(key)
                if kernel is None:
                    started = time.perf_counter()
                    kernel = build()
                    KernelCache.build_seconds += time.perf_counter() - started
                    self._kernels[key] = kernel
        return kernel

    def __len__(self) -> int:
        return len(self._kernels)


def compile_seconds() -> float:
    """Seconds this process has spent building kernels (``KernelCache.build_seconds``)."""
    return KernelCache.build_seconds
