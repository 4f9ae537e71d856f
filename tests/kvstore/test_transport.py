"""KV transports: random blocks land in the destination cache at the given block ids;
corruption, peer death and cancelled transfers are detected; nothing leaks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kvstore.auth import key_of
from kvstore.layout import KVCache, KVCacheLayout
from kvstore.transport import TransferError, get_transport
from kvstore.transport import tcp as tcp_mod

SECRET = "kv-test-secret"  # the cluster secret both ends prove
KEY = key_of(SECRET)

LAYOUT = KVCacheLayout.for_attention(3, 2, 8, 4, torch.float32)
MLA = KVCacheLayout.for_mla(2, 12, 4, 4, torch.bfloat16)


def _source(layout: KVCacheLayout, num_blocks: int = 32, device: str = "cpu") -> KVCache:
    cache = KVCache(layout, num_blocks, device)
    gen = torch.Generator().manual_seed(0)
    cache.storage.copy_(torch.randn(cache.shape, generator=gen).to(layout.dtype))
    return cache


def _threads() -> int:
    return threading.active_count()


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "name,device",
    [("shm", "cpu"), ("tcp", "cpu"), pytest.param("tcp", "cuda", marks=CUDA)],
)
@pytest.mark.parametrize("layout", [LAYOUT, MLA], ids=["gqa", "mla"])
def test_round_trip_into_given_block_ids(name, device, layout):
    transport = get_transport(name, secret=SECRET)
    dst = transport.allocate_cache(layout, 48, device)
    receiver = transport.receiver(dst)
    src = _source(layout, device=device)
    sender = get_transport(name, secret=SECRET).sender(src)
    rng = np.random.default_rng(1)
    try:
        for t in range(5):
            n = int(rng.integers(1, 20))
            src_ids = rng.choice(np.arange(1, 32), n, replace=False).tolist()
            dst_ids = rng.choice(np.arange(1, 48), n, replace=False).tolist()
            receiver.expect(f"t{t}", dst_ids)
            stats = sender.send(receiver.endpoint, f"t{t}", src_ids, dst_ids)
            assert stats.num_blocks == n
            assert stats.num_bytes == n * layout.bytes_per_block
            for a, b in zip(src.layers, dst.layers):
                assert torch.equal(b[dst_ids], a[src_ids])
            receiver.forget(f"t{t}")
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_layout_mismatch_and_bad_block_ids_are_refused(name):
    transport = get_transport(name, secret=SECRET)
    receiver = transport.receiver(transport.allocate_cache(LAYOUT, 16, "cpu"))
    other = KVCacheLayout.for_attention(3, 2, 4, 4, torch.float32)
    try:
        with pytest.raises(TransferError, match="layout"):
            sender = get_transport(name, secret=SECRET).sender(_source(other))
            sender.send(receiver.endpoint, "x", [1], [1])
        sender = get_transport(name, secret=SECRET).sender(_source(LAYOUT))
        with pytest.raises(TransferError, match="out of range"):
            sender.send(receiver.endpoint, "x", [1], [16])
        sender.close()
    finally:
        receiver.close()


def test_tcp_corrupted_frame_is_refused_and_not_written():
    transport = get_transport("tcp", secret=SECRET)
    dst = transport.allocate_cache(LAYOUT, 16, "cpu")
    receiver = transport.receiver(dst)
    receiver.expect("bad", [3])
    host, port = receiver.endpoint.address.split(":")
    payload = bytearray(_source(LAYOUT).layers[0][[1]].numpy().tobytes())
    digest = tcp_mod.checksum(np.asarray([3], dtype="<i4").tobytes(), bytes(payload))
    payload[5] ^= 0xFF  # flipped on the wire
    with socket.create_connection((host, int(port))) as sock:
        tcp_mod.prove_to_receiver(sock, KEY, receiver.endpoint.address)
        for layer in range(3):
            tcp_mod.write_frame(sock, tcp_mod.DATA, "bad", layer, [3], bytes(payload), digest)
        tcp_mod.write_frame(sock, tcp_mod.END, "bad", 3)
        reply = tcp_mod.read_frame(sock)
    assert reply.kind == tcp_mod.NACK
    assert b"checksum" in bytes(reply.payload)
    assert not dst.layers[0][3].any()
    receiver.close()


def test_tcp_unexpected_or_forgotten_transfer_is_refused():
    transport = get_transport("tcp", secret=SECRET)
    dst = transport.allocate_cache(LAYOUT, 16, "cpu")
    receiver = transport.receiver(dst)
    sender = get_transport("tcp", secret=SECRET).sender(_source(LAYOUT))
    with pytest.raises(TransferError, match="not expected"):
        sender.send(receiver.endpoint, "never", [1, 2], [3, 4])
    receiver.expect("gone", [3, 4])
    receiver.forget("gone")
    with pytest.raises(TransferError, match="not expected"):
        sender.send(receiver.endpoint, "gone", [1, 2], [3, 4])
    receiver.expect("other", [5])
    with pytest.raises(TransferError, match="not its own"):
        sender.send(receiver.endpoint, "other", [1, 2], [5, 6])
    assert not dst.storage.any()
    sender.close()
    receiver.close()


_RECEIVER = """
import sys, time, msgspec, torch
from kvstore.layout import KVCacheLayout
from kvstore.transport import get_transport
SECRET = "kv-test-secret"
lay = KVCacheLayout.for_attention(3, 2, 8, 4, torch.float32)
t = get_transport(sys.argv[1], secret=SECRET)
rx = t.receiver(t.allocate_cache(lay, 16, "cpu"))
rx.expect("t", list(range(1, 16)))
print(msgspec.json.encode(rx.endpoint).decode(), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_peer_death_is_detected(name):
    import msgspec

    from kvstore.transport import KVEndpoint

    proc = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, name], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)},
    )  # fmt: skip
    try:
        endpoint = msgspec.json.decode(proc.stdout.readline(), type=KVEndpoint)
        sender = get_transport(name, secret=SECRET).sender(_source(LAYOUT))
        sender.send(endpoint, "t", [1, 2], [1, 2])  # the peer is alive: fine
        proc.kill()
        proc.wait()
        started = time.monotonic()
        with pytest.raises(TransferError):
            sender.send(endpoint, "t", [1, 2], [1, 2], timeout=5)
        assert time.monotonic() - started < 5
        sender.close()
    finally:
        proc.kill()


def test_tcp_sender_gone_mid_transfer_leaves_receiver_clean():
    before = _threads()
    transport = get_transport("tcp", secret=SECRET)
    dst = transport.allocate_cache(LAYOUT, 16, "cpu")
    receiver = transport.receiver(dst)
    receiver.expect("t", [1])
    host, port = receiver.endpoint.address.split(":")
    payload = _source(LAYOUT).layers[0][[1]].numpy().tobytes()
    with socket.create_connection((host, int(port))) as sock:
        tcp_mod.prove_to_receiver(sock, KEY, receiver.endpoint.address)
        tcp_mod.write_frame(sock, tcp_mod.DATA, "t", 0, [1], payload)
    # the receiver keeps working for the next sender
    sender = get_transport("tcp", secret=SECRET).sender(_source(LAYOUT))
    sender.send(receiver.endpoint, "t", [2], [1])
    sender.close()
    receiver.close()
    deadline = time.monotonic() + 5
    while _threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _threads() == before


def _memfds() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:ferry-kv" in line for line in f)


def test_shm_segment_is_released_when_both_ends_let_go():
    import gc

    before = _memfds()
    transport = get_transport("shm", secret=SECRET)
    dst = transport.allocate_cache(LAYOUT, 16, "cpu")
    receiver = transport.receiver(dst)
    sender = get_transport("shm", secret=SECRET).sender(_source(LAYOUT))
    sender.send(receiver.endpoint, "t", [1], [2])
    assert _memfds() > before
    sender.close()
    receiver.close()
    del dst, receiver
    gc.collect()
    assert _memfds() == before
    fds = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    assert not any("ferry-kv" in os.readlink(p) for p in fds if os.path.exists(p))


# ---- nccl: the rendezvous and protocol, run with gloo on CPU (no GPU here) -----------------
# gloo stands in for NCCL to exercise the code path only; the GPU run of the real backend is
# in bench/kv_transfer.py --backends nccl.


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 1], ids=["one-chunk", "per-layer"])
def test_nccl_code_path_with_gloo_round_trip_and_refusal(monkeypatch, chunk_bytes):
    from kvstore.transport import nccl as nccl_mod

    monkeypatch.setattr(nccl_mod, "CHUNK_BYTES", chunk_bytes)
    transport = get_transport("nccl", backend="gloo", timeout=20, secret=SECRET)
    dst = transport.allocate_cache(LAYOUT, 24, "cpu")
    receiver = transport.receiver(dst)
    src = _source(LAYOUT)
    sender = get_transport("nccl", backend="gloo", timeout=20, secret=SECRET).sender(src)
    try:
        for t, (s_ids, d_ids) in enumerate([([1, 2, 3], [9, 4, 20]), ([31], [1])]):
            receiver.expect(f"t{t}", d_ids)
            stats = sender.send(receiver.endpoint, f"t{t}", s_ids, d_ids)
            assert stats.num_bytes == len(s_ids) * LAYOUT.bytes_per_block
            for a, b in zip(src.layers, dst.layers):
                assert torch.equal(b[d_ids], a[s_ids])
        before = dst.storage.clone()
        with pytest.raises(TransferError, match="not expected"):
            sender.send(receiver.endpoint, "never", [5], [6])
        assert torch.equal(dst.storage, before)
        receiver.expect("after", [6])  # the pair still works after a refusal
        sender.send(receiver.endpoint, "after", [5], [6])
        assert torch.equal(dst.layers[0][6], src.layers[0][5])
    finally:
        sender.close()
        receiver.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("name", ["tcp", "nccl"])
def test_a_sender_without_the_cluster_secret_is_refused_and_writes_nothing(name):
    options = {"backend": "gloo", "timeout": 20} if name == "nccl" else {}
    transport = get_transport(name, secret=SECRET, **options)
    dst = transport.allocate_cache(LAYOUT, 16, "cpu")
    receiver = transport.receiver(dst)
    receiver.expect("t", [1, 2])
    stranger = get_transport(name, secret="another secret", **options).sender(_source(LAYOUT))
    with pytest.raises(TransferError, match="cluster secret"):
        stranger.send(receiver.endpoint, "t", [1, 2], [1, 2])
    host, port = receiver.endpoint.address.split("/")[0].split(":")
    payload = _source(LAYOUT).layers[0][[1]].numpy().tobytes()
    with socket.create_connection((host, int(port))) as sock:  # frames with no handshake
        try:
            tcp_mod.write_frame(sock, tcp_mod.DATA, "t", 0, [1], payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the receiver closed on the first bytes, before the frame was all sent
        else:
            sock.settimeout(10)
            assert _closed_by_peer(sock)
    assert not dst.storage.any() and not receiver.landed("t")
    stranger.close()
    receiver.close()


def test_a_forged_frame_header_is_refused_before_anything_is_allocated():
    import resource

    transport = get_transport("tcp", secret=SECRET)
    dst = transport.allocate_cache(LAYOUT, 16, "cpu")
    receiver = transport.receiver(dst)
    receiver.expect("t", [1])
    host, port = receiver.endpoint.address.split(":")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    with socket.create_connection((host, int(port))) as sock:
        tcp_mod.prove_to_receiver(sock, KEY, receiver.endpoint.address)
        header = tcp_mod.HEADER.pack(tcp_mod.MAGIC, tcp_mod.DATA, 0, 1, 1, 2 << 30, 0)
        sock.sendall(header + b"t" + b"\x01\x00\x00\x00")  # claims a 2 GiB payload
        sock.settimeout(10)
        assert _closed_by_peer(sock)  # dropped at the header
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 256, f"the receiver allocated {grown_mb:.0f} MB"
    sender = get_transport("tcp", secret=SECRET).sender(_source(LAYOUT))
    sender.send(receiver.endpoint, "t", [2], [1])  # and it still serves honest senders
    sender.close()
    receiver.close()


def test_landed_says_whether_every_expected_block_was_acknowledged():
    transport = get_transport("tcp", secret=SECRET)
    receiver = transport.receiver(transport.allocate_cache(LAYOUT, 16, "cpu"))
    sender = get_transport("tcp", secret=SECRET).sender(_source(LAYOUT))
    receiver.expect("t", [3, 4, 5])
    assert not receiver.landed("t")
    sender.send(receiver.endpoint, "t", [1, 2], [3, 4])  # a first chunk of the prompt
    assert not receiver.landed("t")
    sender.send(receiver.endpoint, "t", [7], [5])
    assert receiver.landed("t")
    receiver.forget("t")
    assert not receiver.landed("t") and not receiver.landed("never expected")
    sender.close()
    receiver.close()
