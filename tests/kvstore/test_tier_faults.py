"""The file tier on file systems that fail it, for real: a directory, a FIFO or an
unreadable file where a block file should be, a read-only and a full tmpfs. Nothing
raises or hangs, every failure is a counted miss or skipped write, the tier degrades and
recovers by itself, its queue drains, and its files keep a free-space margin and mode
0600."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time

import pytest
import torch
from filesystems import (
    directory_in_place_of,
    fifo_in_place_of,
    no_permission_override,
    tmpfs,
    unreadable,
)

from kvstore.hashing import block_hash
from kvstore.tiers import BlockMeta, FileTier, PosixIO, TierEvents
from kvstore.tiers.faults import NotARegularFile

META = BlockMeta("test-model:llama:2x2x4", 2, 4, (("k", (2, 4)), ("v", (2, 4))), torch.float32)
BLOCK_BYTES = 2 * 4 * 16 * 4


def h(i: int) -> bytes:
    return block_hash(b"\0" * 16, [i] * 4)


def blk(i: int) -> torch.Tensor:
    return torch.full(META.block_shape, float(i))


@pytest.fixture
def make_tier():
    made = []

    def make(path, capacity_bytes=1 << 30, **kw) -> FileTier:
        kw.setdefault("probe_interval_s", 0.1)
        tier = FileTier(path, META, capacity_bytes, 3600.0, TierEvents(), **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def written(tier: FileTier, *ids: int) -> None:
    for i in ids:
        assert tier.put(h(i), blk(i))
    tier.flush()


def finishes(fn, timeout: float = 10.0):
    """``fn()``'s result (or its exception), from a thread that must finish within
    ``timeout`` s."""
    result: list = []

    def run() -> None:
        try:
            result.append((fn(), None))
        except Exception as exc:
            result.append((None, exc))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), f"{fn} still running after {timeout} s"
    value, error = result[0]
    if error is not None:
        raise error
    return value


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def no_temporaries(root) -> bool:
    return not [p for p in root.rglob("*.tmp")]


# -- one block's file ---------------------------------------------------------------------


def test_a_fifo_in_place_of_a_block_is_a_miss_without_blocking_and_is_replaced(
    tmp_path, make_tier
):
    tier = make_tier(tmp_path)
    written(tier, 1, 2)
    fifo_in_place_of(tier.path(h(1)))
    assert finishes(lambda: tier.load(h(1))) is None
    with pytest.raises(NotARegularFile):  # the reader itself never opens it blocking
        finishes(lambda: PosixIO().read(str(tier.path(h(1)))))
    assert tier.stats()["read_errors"] == 1
    assert torch.equal(tier.load(h(2)), blk(2))
    written(tier, 1)  # recomputed and written again: the rename replaces the FIFO
    assert torch.equal(tier.load(h(1)), blk(1))
    assert tier.degraded is None and no_temporaries(tmp_path)


def test_a_directory_in_place_of_a_block_is_a_miss_and_a_failed_write_of_that_block_only(
    tmp_path, make_tier
):
    tier = make_tier(tmp_path)
    written(tier, 1, 2)
    directory_in_place_of(tier.path(h(1)))
    assert tier.load(h(1)) is None
    written(tier, 1)  # cannot replace a directory: that one write fails, nothing else
    assert tier.load(h(1)) is None
    stats = tier.stats()
    assert stats["read_errors"] == 2 and stats["write_errors"] == 1
    assert tier.degraded is None
    written(tier, 3)
    assert torch.equal(tier.load(h(3)), blk(3))
    tier.scan()  # the directory is not taken for a block file
    assert tier.path(h(1)).is_dir() and no_temporaries(tmp_path)


def test_an_unreadable_block_file_is_a_counted_miss(tmp_path, make_tier):
    with no_permission_override():  # mode bits bind this thread (and the writer) as root too
        tier = make_tier(tmp_path)
        written(tier, 1, 2)
        unreadable(tier.path(h(1)))
        assert tier.load(h(1)) is None
        assert torch.equal(tier.load(h(2)), blk(2))
    assert tier.stats()["read_errors"] == 1 and tier.degraded is None


def test_failures_are_counted_each_and_logged_at_a_bounded_rate(tmp_path, make_tier, caplog):
    tier = make_tier(tmp_path)
    written(tier, 1)
    fifo_in_place_of(tier.path(h(1)))
    with caplog.at_level(logging.WARNING, logger="ferry.kvstore"):
        for _ in range(200):
            assert tier.load(h(1)) is None
    assert tier.stats()["read_errors"] == 200
    lines = [r for r in caplog.records if "not read" in r.getMessage()]
    assert len(lines) == 1 and str(tier.path(h(1))) in lines[0].getMessage()


def test_an_unexpected_error_inside_a_write_leaves_nothing_queued(tmp_path, make_tier):
    class BrokenIO(PosixIO):
        def write(self, path, parts, mode=0o600):
            raise RuntimeError("a bug in the I/O layer")

    tier = make_tier(tmp_path, io=BrokenIO())
    for i in range(5):
        tier.put(h(i), blk(i))
    tier.flush()
    assert tier._pending_bytes == 0 and not tier._pending
    assert len(tier) == 0


# -- the directory ------------------------------------------------------------------------


def test_a_read_only_file_system_degrades_the_tier_drains_the_queue_and_recovers(
    tmp_path, make_tier
):
    with tmpfs(tmp_path / "mnt") as fs:
        tier = make_tier(fs.path)
        written(tier, 1)
        fs.read_only()
        for i in range(2, 40):
            tier.put(h(i), blk(i))
        tier.flush()
        assert tier.degraded is not None and "EROFS" in tier.degraded
        stats = tier.stats()
        assert stats["degraded"] == 1 and stats["write_errors"] == 1  # one failed write only
        assert stats["dropped"] >= 1
        assert tier._pending_bytes == 0 and not tier._pending  # drained: nothing held
        assert not tier.put(h(50), blk(50))  # refused at once while degraded
        assert torch.equal(tier.load(h(1)), blk(1))  # reads go on
        fs.writable()
        wait_until(lambda: tier.degraded is None)  # a probe write found it writable
        written(tier, 60)
        assert tier.path(h(60)).is_file() and torch.equal(tier.load(h(60)), blk(60))
        assert tier.stats()["degraded"] == 0 and no_temporaries(fs.path)


def test_a_directory_without_write_permission_degrades_the_tier_until_it_has_it(
    tmp_path, make_tier
):
    with no_permission_override():  # the writer thread, started here, obeys mode bits too
        tier = make_tier(tmp_path)
        written(tier, 1)
        sub = tier.path(h(2)).parent
        sub.mkdir(mode=0o500, exist_ok=True)  # where block 2 goes: no writing
        sub.chmod(0o500)
        written(tier, 2)
        assert tier.degraded is not None and "EACCES" in tier.degraded
        assert not tier.put(h(3), blk(3))
        assert torch.equal(tier.load(h(1)), blk(1))
        sub.chmod(0o700)
        wait_until(lambda: tier.degraded is None)  # the probe writes where it failed
        written(tier, 2)
        assert torch.equal(tier.load(h(2)), blk(2)) and no_temporaries(tmp_path)


def test_a_tier_started_on_a_read_only_directory_reads_what_is_there_and_waits(
    tmp_path, make_tier
):
    with tmpfs(tmp_path / "mnt") as fs:
        written(make_tier(fs.path), 1)
        fs.read_only()
        tier = make_tier(fs.path)
        assert tier.degraded is not None
        assert torch.equal(tier.load(h(1)), blk(1))
        assert not tier.put(h(2), blk(2))
        fs.writable()
        wait_until(lambda: tier.degraded is None)
        written(tier, 2)
        assert torch.equal(tier.load(h(2)), blk(2))


def test_a_full_file_system_degrades_the_tier_until_space_comes_back(tmp_path, make_tier):
    with tmpfs(tmp_path / "mnt", size="4m") as fs:
        tier = make_tier(fs.path)
        fs.fill()
        for i in range(10):
            tier.put(h(i), blk(i))
        tier.flush()
        assert tier.degraded is not None
        assert tier._pending_bytes == 0 and not list(fs.path.rglob("*.kv"))
        assert tier.stats()["degraded"] == 1
        time.sleep(0.3)  # probes fail while the disk stays full
        assert tier.degraded is not None
        fs.unfill()
        wait_until(lambda: tier.degraded is None)
        written(tier, 20)
        assert torch.equal(tier.load(h(20)), blk(20)) and no_temporaries(fs.path)


def test_the_capacity_counts_free_space_and_the_tier_gives_space_back(tmp_path, make_tier):
    with tmpfs(tmp_path / "mnt", size="1m") as fs:
        st = os.statvfs(fs.path)
        margin = st.f_blocks * st.f_frsize // 4
        tier = make_tier(fs.path, min_free_fraction=0.25)  # capacity 1 GB: space decides
        for i in range(400):  # more than 1 MB in 4 KB pages
            tier.put(h(i), blk(i))
            tier.flush()
        files = len(list(fs.path.rglob("*.kv")))
        stats = tier.stats()
        assert stats["write_errors"] == 0 and stats["evictions"] > 0 and tier.degraded is None
        assert 100 < files < 200, files
        assert fs.free_bytes() >= margin - 4096
        # another program takes the free space: the next write first gives some back
        fs.fill()
        written(tier, 1000)
        assert fs.free_bytes() >= margin - 4096
        assert tier.path(h(1000)).is_file() and tier.degraded is None


# -- file modes ---------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "dirs"), [(None, 0o700), (0o640, 0o750)])
def test_block_files_and_their_temporaries_get_the_mode_whatever_the_umask(
    tmp_path, make_tier, mode, dirs
):
    seen = []

    class WatchingIO(PosixIO):
        def write(self, path, parts, mode=0o600):
            done = super().write(path, parts, mode)
            seen.append(stat.S_IMODE(os.stat(path).st_mode))  # the temporary, before rename
            return done

    old = os.umask(0)  # the umask widens nothing
    try:
        tier = make_tier(tmp_path / "kv", io=WatchingIO(), **({} if mode is None else
                                                              {"mode": mode}))  # fmt: skip
        written(tier, 1)
    finally:
        os.umask(old)
    want = 0o600 if mode is None else mode
    assert seen == [want]
    path = tier.path(h(1))
    assert stat.S_IMODE(path.stat().st_mode) == want
    assert stat.S_IMODE(path.parent.stat().st_mode) == dirs  # <hh>/
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == dirs  # <namespace>/


def test_a_mode_the_owner_cannot_read_and_write_is_refused(tmp_path):
    for bad in (0o400, 0o1600, 0o200):
        with pytest.raises(ValueError, match="KV file mode"):
            FileTier(tmp_path, META, 1 << 20, 60.0, TierEvents(), mode=bad)
