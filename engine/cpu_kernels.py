"""The engine's handle on the CPU kernels (``kernels.cpu``): built once per user into
``envs.cpu_kernels_dir()`` (``~/.cache/ferry/kernels``, ``$XDG_CACHE_HOME`` respected),
None where they cannot be.

Models and the CPU attention backend ask ``cpu_kernels_for(x)`` before each fused call
and run torch ops when it says None, so a machine without a C compiler computes the same
function, only slower.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine import envs
from kernels import cpu


@functools.cache
def cpu_kernels() -> cpu.CpuKernels | None:
    """The compiled kernels, or None (no compiler, or it failed: logged once)."""
    return cpu.load(Path(envs.cpu_kernels_dir()))


def cpu_kernels_for(x: torch.Tensor) -> cpu.CpuKernels | None:
    """The kernels when they can take ``x`` (a float32 CPU tensor), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return cpu_kernels()
