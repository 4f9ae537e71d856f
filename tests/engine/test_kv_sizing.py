"""KV cache and host-tier sizes when none is given (``engine.kv_cache.sizing``)."""

from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig, SchedulerConfig
from engine.core import EngineCore
from engine.kv_cache import sizing
from server import serve


def test_auto_kv_blocks_hold_two_contexts_and_the_null_block():
    assert sizing.auto_kv_blocks(2048, 16, 1 << 20) == 2 * 128 + 1
    assert sizing.auto_kv_blocks(2050, 16, 1 << 20) == 2 * 129 + 1  # a partial block counts


def test_auto_kv_blocks_never_pass_the_memory_cap():
    block = 64 << 20
    assert sizing.auto_kv_blocks(1 << 20, 16, block) == sizing.AUTO_KV_MAX_BYTES // block + 1


def test_host_tier_is_a_share_of_available_memory_split_among_workers():
    gib = 1 << 30
    assert sizing.host_tier_bytes(100 * gib, 2) == int(100 * gib * sizing.HOST_TIER_SHARE) // 2
    assert sizing.host_tier_bytes(10_000 * gib, 1) == sizing.HOST_TIER_MAX_BYTES
    assert sizing.available_memory_bytes() > 0


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    serve.add_parser(p.add_subparsers())
    return p


def test_serve_defaults_on_the_cpu_bound_the_context_and_share_an_asked_for_host_tier(parser):
    args = parser.parse_args(["serve"])
    config = serve.engine_config(args)
    assert config.scheduler.max_model_len == serve.CPU_MAX_MODEL_LEN
    assert config.cache.memory_gb == 0.0  # sized from the context at start
    assert config.cache.host_memory_gb == 0.0  # the file tier alone on the CPU
    expected = sizing.host_tier_bytes(sizing.available_memory_bytes(), 2) / 2**30
    host = ["serve", "--kv-tiers", "host,file"]
    assert serve.engine_config(parser.parse_args(host)).cache.host_memory_gb == pytest.approx(
        expected, rel=0.05)
    aggregated = serve.engine_config(parser.parse_args([*host, "--aggregated"]))
    assert aggregated.cache.host_memory_gb == pytest.approx(2 * expected, rel=0.05)


def test_explicit_sizes_win(parser):
    args = parser.parse_args(["serve", "--max-model-len", "512", "--host-kv-cache-gb", "0.5",
                              "--kv-cache-memory-gb", "0.25"])  # fmt: skip
    config = serve.engine_config(args)
    assert config.scheduler.max_model_len == 512
    assert (config.cache.host_memory_gb, config.cache.memory_gb) == (0.5, 0.25)
    cuda = serve.engine_config(parser.parse_args(["serve", "--device", "cuda"]))
    assert cuda.scheduler.max_model_len == 0  # the model's own on a GPU


def test_engine_sizes_its_cache_for_the_context_and_caps_it_at_the_model():
    core = EngineCore(EngineConfig(model="default", num_threads=1,
                                   scheduler=SchedulerConfig(max_model_len=1024)))  # fmt: skip
    assert core.config.cache.num_blocks == 2 * 1024 // 16 + 1
    assert core.max_model_len == 1024
    own = core.model_config.max_position_embeddings
    longer = EngineCore(EngineConfig(model="default", num_threads=1,
                                     scheduler=SchedulerConfig(max_model_len=own * 2)))  # fmt: skip
    assert longer.max_model_len == own
    assert longer.config.cache.num_blocks == sizing.auto_kv_blocks(
        own, 16, core.kv_cache.layout.bytes_per_block
    )
