"""Which attention backend ``build_backend`` picks for a device and a KV cache dtype.

TileLang's attention kernels take bf16 or fp16 only, so a float32 model on CUDA attends
through torch SDPA (the CPU's torch path, which runs on CUDA tensors as well). The choice
is made without a GPU here: ``kernels_usable`` is patched to say the kernels could run.
"""

from __future__ import annotations

import logging

import pytest
import torch

import engine.attention as attention
from engine.attention import CpuBackend, TileLangBackend, TorchSDPABackend, backend_for
from engine.attention.tilelang_mla import TileLangMLABackend


@pytest.fixture
def kernels_present(monkeypatch):
    monkeypatch.setattr(attention, "kernels_usable", lambda device: str(device).startswith("cuda"))


@pytest.mark.parametrize(
    "device, dtype, expected",
    [
        ("cuda", torch.bfloat16, TileLangBackend),
        ("cuda:0", torch.float16, TileLangBackend),
        ("cuda", torch.float32, TorchSDPABackend),
        ("cuda:1", torch.float32, TorchSDPABackend),
        ("cpu", torch.float32, CpuBackend),
        ("cpu", torch.bfloat16, CpuBackend),
    ],
)
def test_auto_picks_by_device_and_dtype(kernels_present, device, dtype, expected):
    assert backend_for(device, "auto", "gqa", dtype) is expected


def test_float32_on_cuda_says_why_in_one_line(kernels_present, caplog):
    with caplog.at_level(logging.INFO, logger="ferry.attention"):
        backend_for("cuda", "auto", "gqa", torch.float32)
    lines = [r.getMessage() for r in caplog.records if r.name == "ferry.attention"]
    assert len(lines) == 1 and "float32" in lines[0] and "bf16 or fp16" in lines[0]


def test_mla_keeps_its_tilelang_backend_in_float32(kernels_present):
    # the MLA backend falls back to torch ops per call for caches its kernel cannot take
    assert backend_for("cuda", "auto", "mla", torch.float32) is TileLangMLABackend


def test_without_the_kernels_cuda_gets_torch_whatever_the_dtype(monkeypatch):
    monkeypatch.setattr(attention, "kernels_usable", lambda device: False)
    for dtype in (torch.bfloat16, torch.float32):
        assert backend_for("cuda", "auto", "gqa", dtype) is TorchSDPABackend


def test_a_named_backend_is_taken_as_asked(kernels_present):
    assert backend_for("cuda", "tilelang", "gqa", torch.float32) is TileLangBackend
    assert backend_for("cuda", "torch", "gqa", torch.bfloat16) is TorchSDPABackend


@pytest.mark.parametrize("dtype, expected", [(torch.float32, TorchSDPABackend),
                                             (torch.bfloat16, TileLangBackend)])  # fmt: skip
def test_build_backend_reads_the_dtype_from_the_cache(kernels_present, dtype, expected):
    from engine.config import ModelConfig
    from kvstore.layout import KVCache, KVCacheLayout

    layout = KVCacheLayout.for_attention(2, 2, 16, 16, dtype)
    config = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16)  # fmt: skip
    backend = attention.build_backend(KVCache(layout, 4, "cpu"), config, 0.25, "cuda")
    assert type(backend) is expected
