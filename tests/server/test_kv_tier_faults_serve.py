"""A real ``ferry serve`` whose file tier sits on a tmpfs of the test's own, while it
serves: the disk full from the start, block files replaced by a FIFO, an unreadable file
and a directory, then a read-only remount. The engine process never dies or hangs, /ready
stays 200, greedy text stays that of the first (uncached) run, ``ferry_kv_file_degraded``
goes to 1 and back to 0 by itself (as of the engine's latest step: stats travel with
step outputs), and the log holds no traceback.

The device cache holds 17 blocks, so a prompt of 17 blocks of other tokens (``evict``)
leaves a prompt's prefix only in the file tier."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import assert_sound, run_server
from filesystems import (
    directory_in_place_of,
    fifo_in_place_of,
    tmpfs,
    unreadable,
    without_override_prefix,
)
from test_kv_tiers_serve import complete, metric

BS = 16
RECOVERY_S = 30.0  # the tier probes every 5 s
TOPIC = ("The ferry left the northern pier at six, loaded with timber, letters and a "
         "brass band going to the summer fair on the island. ")  # fmt: skip


@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    with tmpfs(tmp_path_factory.mktemp("serve-faults") / "mnt", size="256m") as fs:
        yield fs


@pytest.fixture(scope="module")
def faulty(mount, tmp_path_factory):
    """``--aggregated`` over files on the tmpfs, with mode bits binding it even as root."""
    log = tmp_path_factory.mktemp("serve-faults-log") / "serve.log"
    flags = ("--aggregated", "--threads", "1", "--kv-tiers", "file", "--block-size", str(BS),
             "--kv-dir", str(mount.path / "kv"), "--kv-cache-memory-gb", "0.012")  # fmt: skip
    with run_server(log, *flags, prefix=without_override_prefix()) as server:
        yield server


def kv_files(mount) -> list:
    return sorted(mount.path.rglob("*.kv"), key=lambda p: p.stat().st_mtime_ns)


class Evictor:
    """Prompts of fresh tokens that fill the whole device cache."""

    def __init__(self, server) -> None:
        models = httpx.get(f"{server.v1}/models", headers=server.headers, timeout=30).json()
        self.length = models["data"][0]["max_model_len"] - 2
        self.server = server
        self.rounds = 0

    def __call__(self) -> None:
        self.rounds += 1
        base = 1000 + 2000 * self.rounds
        complete(self.server, [base + i for i in range(self.length)], max_tokens=1)


def wait_for(cond, what: str, timeout: float = RECOVERY_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def degraded(server) -> float:
    """``ferry_kv_file_degraded`` now: workers report stats with each step, so a request
    too short to fill a block (nothing to write) makes the engine step first."""
    complete(server, "Hi", max_tokens=1)
    return metric(server, "ferry_kv_file_degraded")


def assert_alive(server) -> None:
    assert server.process.poll() is None
    assert_sound(server)
    assert "Traceback" not in server.log_path.read_text(errors="replace")


def test_a_full_disk_degrades_the_tier_and_freeing_space_recovers_it(faulty, mount):
    assert not kv_files(mount), "runs first: the tier must hold nothing yet"
    prompt = f"Full disk. {TOPIC * 4}"
    mount.fill()
    try:
        first = complete(faulty, prompt, max_tokens=6)
        wait_for(lambda: degraded(faulty) == 1, "a full disk did not degrade the tier", 15)
        assert not kv_files(mount)
    finally:
        mount.unfill()
    wait_for(lambda: degraded(faulty) == 0, "the tier stayed degraded with space back")
    evict = Evictor(faulty)
    evict()
    assert complete(faulty, prompt, max_tokens=6)["text"] == first["text"]
    evict()
    again = complete(faulty, prompt, max_tokens=6)  # its prefix now from files
    assert again["text"] == first["text"] and again["cached"] > 0
    assert_alive(faulty)


def test_block_files_replaced_by_a_fifo_an_unreadable_file_and_a_directory(faulty, mount):
    prompt = f"Sabotage. {TOPIC * 4}"
    before = set(kv_files(mount))
    first = complete(faulty, prompt, max_tokens=6)
    assert first["cached"] == 0
    blocks = first["usage"]["prompt_tokens"] // BS
    wait_for(lambda: len(set(kv_files(mount)) - before) >= blocks, "blocks not written", 60)
    paths = [p for p in kv_files(mount) if p not in before]  # in block order (mtime)
    errors = metric(faulty, "ferry_kv_file_read_errors_total")
    evict = Evictor(faulty)
    # the match stops at the first bad block: each round spoils an earlier one
    for bad, spoil in ((3, fifo_in_place_of), (2, unreadable), (1, directory_in_place_of)):
        evict()
        spoil(paths[bad])
        started = time.monotonic()
        out = complete(faulty, prompt, max_tokens=6)
        assert time.monotonic() - started < 60, "a bad block file stalled the request"
        assert out["text"] == first["text"], spoil.__name__
        assert out["cached"] == bad * BS, spoil.__name__
    assert metric(faulty, "ferry_kv_file_read_errors_total") == errors + 3
    assert degraded(faulty) == 0
    assert_alive(faulty)


def test_a_read_only_remount_degrades_the_tier_and_remounting_writable_recovers_it(
    faulty, mount
):
    evict = Evictor(faulty)
    prompt = f"Read-only. {TOPIC * 4}"
    mount.read_only()
    try:
        first = complete(faulty, prompt, max_tokens=6)
        wait_for(lambda: degraded(faulty) == 1, "a read-only remount did not degrade it", 15)
        assert metric(faulty, "ferry_kv_file_write_errors_total") >= 1
    finally:
        mount.writable()
    wait_for(lambda: degraded(faulty) == 0, "the tier stayed degraded once writable")
    evict()
    assert complete(faulty, prompt, max_tokens=6)["text"] == first["text"]  # written now
    evict()
    again = complete(faulty, prompt, max_tokens=6)
    assert again["text"] == first["text"] and again["cached"] > 0
    log = faulty.log_path.read_text(errors="replace")
    assert log.count("is degraded") >= 2 and log.count("takes writes again") >= 2
    assert_alive(faulty)
