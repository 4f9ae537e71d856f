"""The host-memory and file tiers on their own: LRU, pins, the file format, checksums,
capacity and TTL (with an injected clock), files shared between tier instances."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from kvstore.hashing import block_hash
from kvstore.tiers import BlockMeta, CorruptBlock, FileTier, HostTier, PosixIO, TierEvents
from kvstore.tiers.format import pack, unpack

META = BlockMeta("test-model:llama:2x2x4", 2, 4, (("k", (2, 4)), ("v", (2, 4))), torch.float32)


def h(i: int) -> bytes:
    return block_hash(b"\0" * 16, [i] * 4)


def blk(i: int) -> torch.Tensor:
    return torch.full(META.block_shape, float(i)) + torch.arange(16.0).repeat(2, 4, 1)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def file_tier(path, capacity_blocks=100, ttl_s=3600.0, clock=None, events=None, **kw):
    size = len(b"".join(bytes(p) for p in pack(META, h(0), blk(0))))
    tier = FileTier(path, META, capacity_blocks * size, ttl_s, events or TierEvents(),
                    clock=clock or Clock(), **kw)  # fmt: skip
    return tier


@pytest.fixture
def tiers():
    made = []
    yield made
    for t in made:
        t.close()


def bytes_of(parts) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in parts))


# -- format ----------------------------------------------------------------------------------


def test_block_file_round_trips_and_every_flipped_byte_is_caught():
    data = bytes_of(pack(META, h(1), blk(1)))
    assert torch.equal(unpack(META, h(1), data), blk(1))
    for i in range(0, len(data), 7):  # prefix, header and payload alike
        bad = bytearray(data)
        bad[i] ^= 0x40
        with pytest.raises(CorruptBlock):
            unpack(META, h(1), bad)
    for n in (0, 10, len(data) - 1):
        with pytest.raises(CorruptBlock):
            unpack(META, h(1), data[:n])
    with pytest.raises(CorruptBlock):  # a sound file of another block
        unpack(META, h(2), data)
    with pytest.raises(ValueError, match="does not match"):
        pack(META, h(1), torch.zeros(3))


def test_namespace_separates_layouts_dtypes_and_models():
    other = [
        BlockMeta(META.fingerprint, 2, 4, META.components, torch.bfloat16),
        BlockMeta(META.fingerprint, 2, 8, META.components, torch.float32),
        BlockMeta("other:llama:2x2x4", 2, 4, META.components, torch.float32),
    ]
    assert len({META.namespace, *(m.namespace for m in other)}) == 4


# -- host ------------------------------------------------------------------------------------


def test_host_tier_is_lru_and_pins_protect_blocks_about_to_be_read():
    events = TierEvents()
    host = HostTier(2, META.block_shape, META.dtype, events)
    host.put(h(1), blk(1))
    host.put(h(2), blk(2))
    assert torch.equal(host.get(h(1)), blk(1))  # now 2 is the least recently used
    host.put(h(3), blk(3))
    assert h(2) not in host and h(1) in host and h(3) in host
    with host.pinned([h(1), h(3)]):
        assert not host.put(h(4), blk(4))  # nothing evictable
        with pytest.raises(AssertionError, match="pinned"):
            host.check_integrity()
    assert host.dropped == 1 and host.evictions == 1
    host.put(h(4), blk(4))
    assert h(1) not in host and torch.equal(host.get(h(4)), blk(4))
    kinds = [(e.kind, e.block_hash, e.tier) for e in events.drain()]
    assert kinds[:3] == [("stored", h(1), "host"), ("stored", h(2), "host"),
                         ("removed", h(2), "host")]  # fmt: skip
    assert ("removed", h(1), "host") in kinds
    host.check_integrity()


# -- files -----------------------------------------------------------------------------------


def test_file_tier_writes_asynchronously_and_reads_back(tmp_path, tiers):
    events = TierEvents()
    tier = file_tier(tmp_path, events=events)
    tiers.append(tier)
    assert tier.load(h(1)) is None
    assert tier.put(h(1), blk(1))
    assert not tier.put(h(1), blk(1))  # known: not queued twice
    tier.flush()
    path = tier.path(h(1))
    assert path.is_file() and path.parent.parent.name == META.namespace
    assert torch.equal(tier.load(h(1)), blk(1))
    assert [(e.kind, e.tier) for e in events.drain()] == [("stored", "file")]
    assert tier.stats()["bytes_written"] == tier.stats()["bytes_read"] == path.stat().st_size
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_corrupt_file_is_a_miss_and_is_removed(tmp_path, tiers, damage):
    events = TierEvents()
    tier = file_tier(tmp_path, events=events)
    tiers.append(tier)
    tier.put(h(1), blk(1))
    tier.flush()
    events.drain()
    path = tier.path(h(1))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    path.write_bytes(data[: len(data) // 3] if damage == "truncate" else
                     b"" if damage == "empty" else data)  # fmt: skip
    assert tier.load(h(1)) is None
    assert not path.exists()
    assert tier.stats()["checksum_failures"] == 1
    assert [(e.kind, e.tier) for e in events.drain()] == [("removed", "file")]
    tier.put(h(1), blk(1))  # written again once recomputed
    tier.flush()
    assert torch.equal(tier.load(h(1)), blk(1))


def test_capacity_bound_evicts_the_least_recently_used(tmp_path, tiers):
    clock = Clock()
    tier = file_tier(tmp_path, capacity_blocks=3, clock=clock)
    tiers.append(tier)
    for i in range(3):
        clock.now += 1
        tier.put(h(i), blk(i))
        tier.flush()
    clock.now += 1
    assert tier.load(h(0)) is not None  # 0 is now more recent than 1 and 2
    clock.now += 1
    tier.put(h(3), blk(3))
    tier.flush()
    on_disk = {p.name for p in tmp_path.rglob("*.kv")}
    assert on_disk == {tier.path(h(i)).name for i in (0, 2, 3)}
    assert tier.stats()["evictions"] == 1 and len(tier) == 3


def test_ttl_expires_unused_files_on_sweep_and_on_load(tmp_path, tiers):
    clock = Clock()
    events = TierEvents()
    tier = file_tier(tmp_path, ttl_s=100.0, clock=clock, events=events)
    tiers.append(tier)
    tier.put(h(1), blk(1))
    tier.put(h(2), blk(2))
    tier.flush()
    assert os.stat(tier.path(h(1))).st_mtime == clock.now  # the clock's time, not the OS's
    clock.now += 60
    assert tier.load(h(2)) is not None  # a load renews it
    clock.now += 60  # h(1): 120 s unused, h(2): 60 s
    tier.sweep()
    assert not tier.path(h(1)).exists() and tier.path(h(2)).exists()
    clock.now += 101
    assert tier.load(h(2)) is None and not tier.path(h(2)).exists()  # expired on load
    assert tier.stats()["expired"] == 2
    assert [e.kind for e in events.drain()].count("removed") == 2


def test_a_block_another_writer_stored_is_loaded_and_scanned(tmp_path, tiers):
    clock = Clock()
    events = TierEvents()
    a = file_tier(tmp_path, clock=clock)
    b = file_tier(tmp_path, capacity_blocks=2, clock=clock, events=events)
    tiers += [a, b]
    for i in range(3):
        a.put(h(i), blk(i))
    a.flush()
    assert torch.equal(b.load(h(1)), blk(1))  # found by name before any scan lists it
    assert not b.put(h(1), blk(1))  # known now
    events.drain()
    b.scan()  # learns all three; over b's capacity of two: the least recently used goes
    got = [(e.kind, e.block_hash) for e in events.drain()]
    assert sorted(got[:2]) == sorted([("stored", h(0)), ("stored", h(2))])  # announced
    assert got[2][0] == "removed"
    assert len(list(tmp_path.rglob("*.kv"))) == 2
    assert b.path(h(1)).exists()  # the one b loaded (renewed) stays
    a.path(h(1)).unlink()  # removed by another worker: a's next scan forgets it
    assert a.known(h(1))
    clock.now += 1
    a.scan()
    assert not a.known(h(1)) and a.put(h(1), blk(1))


def test_writes_never_block_a_full_queue_drops(tmp_path, tiers):
    gate = threading.Event()

    class SlowIO(PosixIO):
        def write(self, path, parts, mode=0o600):
            gate.wait(10)
            return super().write(path, parts, mode)

    one = blk(0).numel() * 4
    tier = file_tier(tmp_path, io=SlowIO(), max_pending_bytes=2 * one)
    tiers.append(tier)
    assert tier.put(h(1), blk(1)) and tier.put(h(2), blk(2))
    assert not tier.put(h(3), blk(3))  # returns at once
    assert tier.stats()["dropped"] == 1
    assert torch.equal(tier.load(h(2)), blk(2))  # queued blocks are readable already
    gate.set()
    tier.flush()
    assert sorted(p.name for p in tmp_path.rglob("*.kv")) == sorted(
        tier.path(x).name for x in (h(1), h(2))
    )


def test_stale_temporary_files_are_reaped(tmp_path, tiers):
    tier = file_tier(tmp_path)
    tiers.append(tier)
    tier.put(h(1), blk(1))
    tier.flush()
    sub = tier.path(h(1)).parent
    dead = sub / f".{h(2).hex()}.1.999999999@{socket.gethostname()}.tmp"  # no such pid
    live = sub / f".{h(3).hex()}.1.{os.getpid()}@{socket.gethostname()}.tmp"
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    tier.scan()
    assert not dead.exists() and live.exists()
    live.unlink()


def test_bad_directory_and_bounds_are_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="KV file directory"):
        FileTier(tmp_path / "file" / "kv", META, 1 << 20, 60.0, TierEvents())
    with pytest.raises(ValueError, match="holds no block"):
        FileTier(tmp_path, META, 10, 60.0, TierEvents())
    with pytest.raises(ValueError, match="TTL"):
        FileTier(tmp_path, META, 1 << 20, 0.0, TierEvents())
