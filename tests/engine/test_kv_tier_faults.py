"""The real model over a file tier whose file system fails it: a FIFO, a directory or an
unreadable file in place of a block file, a read-only remount and a full disk (a tmpfs of
the test's own). The engine never raises or hangs, greedy tokens equal those of an engine
without tiers, the prefix match stops at the bad block, and the tier's degraded state
shows in ``EngineStats`` and clears by itself once the file system takes writes again."""

from __future__ import annotations

import threading
import time

import pytest
from filesystems import (
    directory_in_place_of,
    fifo_in_place_of,
    no_permission_override,
    tmpfs,
    unreadable,
)

from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM, Completion
from engine.request import Request
from engine.sampling_params import SamplingParams
from kvstore.hashing import extra_keys

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BS = 16
RECOVERY_S = 30.0  # the tier probes every 5 s; a loaded 2-core machine is slow
TOPICS = {
    "fifo": "The lighthouse keeper wrote down the passing ships, the wind and the tide. ",
    "directory": "A ferry crossed the strait at dawn with grain, mail and two tired horses. ",
    "unreadable": "The harbour master counted barrels of salt fish on the frozen quay. ",
    "read_only": "Every spring the river flooded the lower town and the mill stopped. ",
    "read_only_2": "The cartographer redrew the coastline after the great storm of May. ",
    "full": "In the archive, ledgers of tolls paid at the bridge filled three rooms. ",
}


def llm(**cache) -> LLM:
    return LLM(EngineConfig(cache=CacheConfig(block_size=BS, num_blocks=64, **cache)))


@pytest.fixture(scope="module")
def reference(one_torch_thread) -> dict[str, tuple[list[int], list[int]]]:
    """Each prompt and its greedy tokens from an engine without tiers."""
    engine = llm()
    assert engine.core.kv.tiers is None
    # plain text, no chat template: no two prompts share a block
    prompts = {k: engine.tokenizer.encode(t * 6, add_special_tokens=True)
               for k, t in TOPICS.items()}  # fmt: skip
    outs = engine.generate(list(prompts.values()), GREEDY)
    return {k: (p, o.token_ids) for (k, p), o in zip(prompts.items(), outs, strict=True)}


@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    with tmpfs(tmp_path_factory.mktemp("faults") / "mnt", size="64m") as fs:
        yield fs


@pytest.fixture(scope="module")
def engine(mount, one_torch_thread):
    engine = llm(kv_dir=str(mount.path / "kv"))
    yield engine
    engine.core.kv.tiers.close()


def run(engine: LLM, prompt: list[int], *, from_files: bool = True) -> Completion:
    """Generate ``prompt`` with nothing in the device cache (``from_files``: its prefix
    can only come from the file tier); the blocks it computes are written through."""
    if from_files:
        engine.core.kv.pool.reset_prefix_cache()
    done = []
    worker = threading.Thread(target=lambda: done.append(engine.generate([prompt], GREEDY)))
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the engine hung"
    assert done, "the engine raised"
    engine.core.kv.tiers.file.flush()
    engine.core.check_integrity()
    return done[0][0]


def block_paths(engine: LLM, prompt: list[int]) -> list:
    extra = extra_keys(engine.core.model_config.fingerprint)
    hashes = Request("probe", prompt, GREEDY, hash_extra=extra).full_block_hashes(BS, len(prompt))
    return [engine.core.kv.tiers.file.path(h) for h in hashes]


def stats(engine: LLM):
    return engine.core.scheduler.stats()


def wait_for_recovery(engine: LLM) -> None:
    deadline = time.monotonic() + RECOVERY_S
    while stats(engine).kv_file_degraded:
        assert time.monotonic() < deadline, "the file tier stayed degraded"
        time.sleep(0.1)


SABOTAGE = {"fifo": fifo_in_place_of, "directory": directory_in_place_of,
            "unreadable": unreadable}  # fmt: skip


@pytest.mark.parametrize("kind", list(SABOTAGE))
def test_a_block_file_replaced_by_a_fifo_a_directory_or_an_unreadable_file_is_recomputed(
    engine, reference, kind
):
    prompt, tokens = reference[kind]
    first = run(engine, prompt, from_files=False)
    assert first.token_ids == tokens and first.num_cached_tokens == 0
    paths = block_paths(engine, prompt)
    assert all(p.is_file() for p in paths)
    SABOTAGE[kind](paths[2])
    errors = stats(engine).kv_file_read_errors
    with no_permission_override():  # mode bits bind the engine's thread as root too
        again = run(engine, prompt)
    assert again.token_ids == tokens
    assert again.num_cached_tokens == 2 * BS  # blocks 0 and 1 from files, then a miss
    after = stats(engine)
    assert after.kv_file_read_errors == errors + 1
    assert after.kv_file_degraded == 0


def test_a_read_only_remount_stops_writes_not_serving_and_the_tier_recovers(
    engine, reference, mount
):
    prompt, tokens = reference["read_only"]
    assert run(engine, prompt, from_files=False).token_ids == tokens
    other, other_tokens = reference["read_only_2"]
    mount.read_only()
    try:
        again = run(engine, prompt)  # reads still work
        assert again.token_ids == tokens
        assert again.num_cached_tokens == (len(prompt) - 1) // BS * BS
        out = run(engine, other, from_files=False)  # its blocks cannot be written
        assert out.token_ids == other_tokens
        s = stats(engine)
        assert s.kv_file_degraded == 1 and s.kv_file_write_errors >= 1
        file = engine.core.kv.tiers.file
        assert file._pending_bytes == 0 and not file._pending  # nothing held back
        assert not any(p.exists() for p in block_paths(engine, other))
    finally:
        mount.writable()
    wait_for_recovery(engine)
    assert run(engine, other).token_ids == other_tokens  # computed again, written now
    assert all(p.is_file() for p in block_paths(engine, other))
    out = run(engine, other)
    assert out.token_ids == other_tokens and out.num_cached_tokens > 0


def test_a_full_disk_stops_writes_not_serving_and_the_tier_recovers(
    reference, tmp_path, one_torch_thread
):
    prompt, tokens = reference["full"]
    with tmpfs(tmp_path / "mnt", size="16m") as fs:
        engine = llm(kv_dir=str(fs.path / "kv"))
        try:
            fs.fill()
            out = run(engine, prompt, from_files=False)
            assert out.token_ids == tokens
            assert stats(engine).kv_file_degraded == 1
            assert not list(fs.path.rglob("*.kv")) and not list(fs.path.rglob("*.tmp"))
            fs.unfill()
            wait_for_recovery(engine)
            assert run(engine, prompt).token_ids == tokens  # computed, written now
            out = run(engine, prompt)
            assert out.token_ids == tokens
            assert out.num_cached_tokens == (len(prompt) - 1) // BS * BS
        finally:
            engine.core.kv.tiers.close()
