"""TCP transport (any host): authenticated, framed, checksummed, back-pressured,
TCP_NODELAY.

One connection per sender/receiver pair, one transfer at a time on it. A connection
opens with the cluster-secret handshake (``prove_to_receiver`` / ``prove_to_sender``,
``kvstore.auth``): a peer that cannot prove the secret is dropped before a frame is read.
Frame headers are bounded before anything is allocated: a transfer id of at most
``MAX_ID_BYTES``, no more block ids than the receiver's cache holds blocks, and a payload
no larger than those blocks' bytes. A transfer is one
``DATA`` frame per chunk of consecutive layers (``layer_chunks``: up to 8 MB, so a small
transfer is one frame and a large one streams layer group by layer group), then ``END``;
the receiver answers ``ACK`` once every layer is in place or ``NACK`` with the reason.
Each frame carries the destination block ids and an xxh3-64 checksum over ids and
payload; the receiver verifies it before writing into its cache, and only writes into
blocks announced by ``expect``. Back-pressure is TCP's own (``sendall`` blocks while the
receiver is behind) plus the one-transfer window.

Frame header (little endian): magic ``FKV1``, kind (u8), first layer (u32; in ``END``:
the layer count), block count (u32),
transfer id length (u32), payload length (u64), checksum (u64); then the transfer id
(UTF-8), the block ids (i32 each) and the payload.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from abc import abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from kvstore import auth
from kvstore.layout import KVCache
from kvstore.transport.base import (
    KVEndpoint,
    KVReceiver,
    KVSender,
    KVTransport,
    TransferError,
    block_bytes,
    layer_chunks,
    layout_signature,
)

log = logging.getLogger("ferry.kv")

MAGIC = b"FKV1"
HEADER = struct.Struct("<4sBIIIQQ")
DATA, END, ACK, NACK = 1, 2, 3, 4
MAX_ID_BYTES = 1024
MAX_REPLY_BYTES = 1 << 16  # what a reply (a NACK's reason) may carry
HANDSHAKE_S = 10.0  # a peer that does not finish the handshake by then is dropped
KV_HELLO = b"FKVA"
SENDER, RECEIVER = b"kv-sender", b"kv-receiver"


@dataclass(frozen=True)
class Frame:
    kind: int
    transfer_id: str
    layer: int = 0
    block_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="<i4"))
    payload: memoryview | bytes = b""
    checksum: int = 0


def checksum(ids: bytes, payload: memoryview | bytes) -> int:
    h = xxhash.xxh3_64()
    h.update(ids)
    h.update(payload)
    return h.intdigest()


def write_frame(
    sock: socket.socket,
    kind: int,
    transfer_id: str,
    layer: int = 0,
    block_ids: list[int] | np.ndarray = (),
    payload: memoryview | bytes = b"",
    digest: int | None = None,
) -> None:
    tid = transfer_id.encode()
    ids = np.asarray(block_ids, dtype="<i4").tobytes()
    if digest is None:
        digest = checksum(ids, payload)
    header = HEADER.pack(MAGIC, kind, layer, len(ids) // 4, len(tid), len(payload), digest)
    sock.sendall(header + tid + ids)
    if len(payload):
        sock.sendall(payload)


def _read_exact(sock: socket.socket, n: int, into: bytearray | None = None) -> memoryview:
    buf = into if into is not None and len(into) >= n else bytearray(n)
    view = memoryview(buf)[:n]
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return view


def read_frame(
    sock: socket.socket, buffer: bytearray | None = None, max_blocks: int = 0,
    max_payload: int = MAX_REPLY_BYTES,
) -> Frame:  # fmt: skip
    """The next frame; ``ConnectionError`` if its header claims more than ``max_blocks``
    block ids, a payload past ``max_payload`` or an id past ``MAX_ID_BYTES`` (checked
    before anything is read or allocated for them)."""
    magic, kind, layer, nids, tid_len, plen, digest = HEADER.unpack(
        bytes(_read_exact(sock, HEADER.size))
    )
    if magic != MAGIC:
        raise ConnectionError(f"bad frame magic {magic!r}")
    if tid_len > MAX_ID_BYTES or nids > max_blocks or plen > max_payload:
        raise ConnectionError(f"frame header out of bounds: id {tid_len} bytes, {nids} "
                              f"blocks, {plen} payload bytes")  # fmt: skip
    tid = bytes(_read_exact(sock, tid_len)).decode() if tid_len else ""
    ids = np.frombuffer(bytes(_read_exact(sock, nids * 4)), dtype="<i4") if nids else None
    payload = _read_exact(sock, plen, buffer) if plen else memoryview(b"")
    if ids is None:
        ids = np.zeros(0, dtype="<i4")
    return Frame(kind, tid, layer, ids, payload, digest)


def _configure(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def prove_to_receiver(sock: socket.socket, key: bytes, link: str) -> None:
    """The sender's side of the handshake on a fresh connection to the receiver ``link``
    (its endpoint address); raises ``auth.AuthError`` if the receiver cannot prove the
    secret."""
    mine = auth.nonce()
    sock.sendall(KV_HELLO + mine)
    reply = bytes(_read_exact(sock, auth.NONCE_BYTES + auth.PROOF_BYTES))
    theirs, answer = reply[: auth.NONCE_BYTES], reply[auth.NONCE_BYTES :]
    auth.check(key, RECEIVER, link.encode(), theirs, mine, answer)
    sock.sendall(auth.proof(key, SENDER, link.encode(), mine, theirs))


def prove_to_sender(conn: socket.socket, key: bytes, link: str) -> None:
    """The receiver's side: a sender that does not prove the secret within
    ``HANDSHAKE_S`` raises (``auth.AuthError``, or a timeout)."""
    conn.settimeout(HANDSHAKE_S)
    hello = bytes(_read_exact(conn, len(KV_HELLO) + auth.NONCE_BYTES))
    if hello[: len(KV_HELLO)] != KV_HELLO:
        raise auth.AuthError("not a KV sender's hello")
    theirs, mine = hello[len(KV_HELLO) :], auth.nonce()
    conn.sendall(mine + auth.proof(key, RECEIVER, link.encode(), mine, theirs))
    answer = bytes(_read_exact(conn, auth.PROOF_BYTES))
    auth.check(key, SENDER, link.encode(), theirs, mine, answer)
    conn.settimeout(None)


# ---- receiving ------------------------------------------------------------------------------


class SocketReceiver(KVReceiver):
    """What the receivers that listen on a TCP socket share: the listener, the handshake,
    one thread per sender's connection (``_serve``), the blocks each expected transfer may
    write and those acknowledged sends have written."""

    endpoint: KVEndpoint

    def __init__(self, cache: KVCache, host: str, key: bytes) -> None:
        self.cache = cache
        self._key = key
        self._expected: dict[str, set[int]] = {}
        self._written: dict[str, set[int]] = {}
        self._refused = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, 0))
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.host = host
        self.port = self._listener.getsockname()[1]

    def _listen(self) -> None:
        self._spawn(self._accept_loop, "kv-accept")

    def expect(self, transfer_id: str, dst_block_ids: list[int]) -> None:
        with self._lock:
            self._expected[transfer_id] = set(dst_block_ids)

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._expected.pop(transfer_id, None)
            self._written.pop(transfer_id, None)

    def landed(self, transfer_id: str) -> bool:
        with self._lock:
            expected = self._expected.get(transfer_id)
            return expected is not None and expected <= self._written.get(transfer_id, set())

    def _allowed(self, transfer_id: str, ids: list[int]) -> bool:
        with self._lock:
            allowed = self._expected.get(transfer_id)
            return allowed is not None and allowed.issuperset(ids)

    def _acknowledged(self, transfer_id: str, ids: set[int]) -> None:
        """A send of ``transfer_id`` wrote ``ids`` and is being acknowledged."""
        with self._lock:
            if transfer_id in self._expected:
                self._written.setdefault(transfer_id, set()).update(ids)

    @property
    def max_frame_bytes(self) -> int:
        """The largest payload one frame may carry: every block of every layer."""
        return self.cache.num_blocks * self.cache.layout.bytes_per_block

    def _spawn(self, target, name: str, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            _configure(conn)
            self._conns.add(conn)
            self._spawn(self._serve_conn, "kv-conn", conn)

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            prove_to_sender(conn, self._key, self.endpoint.address)
        except (OSError, ConnectionError) as exc:
            self._refused += 1
            if self._refused & (self._refused - 1) == 0:  # the 1st, 2nd, 4th ...
                log.warning("refused a KV sender that did not prove the cluster secret: %s "
                            "(%d so far)", exc, self._refused)  # fmt: skip
            self._conns.discard(conn)
            conn.close()
            return
        try:
            self._serve(conn)
        except (OSError, ConnectionError, RuntimeError):
            pass  # the sender went away (or its group broke): its partial transfers drop
        finally:
            self._conns.discard(conn)
            conn.close()

    @abstractmethod
    def _serve(self, conn: socket.socket) -> None:
        """Answer one sender's transfers on ``conn`` until it goes away."""

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)


def answer(conn: socket.socket, transfer_id: str, problem: str | None) -> None:
    """ACK the transfer, or NACK it with the problem."""
    if problem is None:
        write_frame(conn, ACK, transfer_id)
    else:
        write_frame(conn, NACK, transfer_id, payload=problem.encode())


def check_reply(reply: Frame, transfer_id: str) -> None:
    """Raise unless ``reply`` acknowledges ``transfer_id``."""
    if reply.kind != ACK or reply.transfer_id != transfer_id:
        reason = bytes(reply.payload).decode(errors="replace") or f"reply kind {reply.kind}"
        raise TransferError(f"receiver refused transfer {transfer_id}: {reason}")


NOT_EXPECTED = "transfer not expected (cancelled or timed out) or blocks not its own"


class TcpReceiver(SocketReceiver):
    def __init__(self, cache: KVCache, host: str, key: bytes) -> None:
        super().__init__(cache, host, key)
        self.endpoint = KVEndpoint(
            "tcp", f"{host}:{self.port}", layout_signature(cache), cache.num_blocks
        )
        self._listen()

    def _serve(self, conn: socket.socket) -> None:
        buffer = bytearray()
        failed: dict[str, str] = {}
        layers: dict[str, int] = {}  # layers written so far, per transfer
        blocks: dict[str, set[int]] = {}  # the blocks they went to
        while True:
            frame = read_frame(conn, buffer, self.cache.num_blocks, self.max_frame_bytes)
            tid = frame.transfer_id
            if frame.kind == DATA:
                written, problem = self._write(frame)
                if problem:
                    failed.setdefault(tid, problem)
                else:
                    layers[tid] = layers.get(tid, 0) + written
                    blocks.setdefault(tid, set()).update(frame.block_ids.tolist())
            elif frame.kind == END:
                done, ids = layers.pop(tid, 0), blocks.pop(tid, set())
                problem = failed.pop(tid, None)
                if problem is None and done != frame.layer:
                    problem = f"got {done} of {frame.layer} layers"
                if problem is None:
                    self._acknowledged(tid, ids)
                answer(conn, tid, problem)
            if len(frame.payload) > len(buffer):
                buffer = bytearray(len(frame.payload))

    def _write(self, frame: Frame) -> tuple[int, str | None]:
        """Verify one frame (a run of layers from ``frame.layer``) and write it; returns
        how many layers it held, or why it was refused."""
        ids = frame.block_ids
        if checksum(ids.tobytes(), frame.payload) != frame.checksum:
            return 0, f"checksum mismatch in the frame of layer {frame.layer}"
        if not self._allowed(frame.transfer_id, ids.tolist()):
            return 0, NOT_EXPECTED
        per_layer = len(ids) * block_bytes(self.cache.layout)
        count, rest = divmod(len(frame.payload), per_layer) if per_layer else (0, 1)
        if rest or not count or frame.layer + count > len(self.cache.layers):
            return 0, "payload size does not match the block and layer counts"
        part = self.cache.storage[frame.layer : frame.layer + count]
        src = torch.frombuffer(frame.payload, dtype=torch.uint8).view(part.dtype)
        src = src.view(count, len(ids), *part.shape[2:]).to(part.device)
        index = torch.from_numpy(ids.astype(np.int64)).to(part.device)
        part.index_copy_(1, index, src)
        if part.is_cuda:  # the frame's buffer is reused once this returns
            torch.cuda.current_stream(part.device).synchronize()
        return count, None


# ---- sending ---------------------------------------------------------------------------------


class TcpSender(KVSender):
    backend = "tcp"

    def __init__(self, cache: KVCache, key: bytes) -> None:
        super().__init__(cache)
        self._key = key
        self._conns: dict[str, socket.socket] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _send(
        self, endpoint: KVEndpoint, transfer_id: str, src: list[int], dst: list[int],
        timeout: float,
    ) -> None:  # fmt: skip
        with self._guard:
            lock = self._locks.setdefault(endpoint.address, threading.Lock())
        with lock:
            sock = self._connect(endpoint, timeout)
            try:
                sock.settimeout(timeout)
                self._stream(sock, transfer_id, src, dst)
                reply = read_frame(sock)
            except (OSError, ConnectionError) as exc:
                self._drop(endpoint)
                raise TransferError(f"KV transfer to {endpoint.address} failed: {exc}") from exc
        check_reply(reply, transfer_id)

    def _stream(self, sock: socket.socket, tid: str, src: list[int], dst: list[int]) -> None:
        storage = self.cache.storage
        index = torch.tensor(src, dtype=torch.long, device=storage.device)
        for start, end in layer_chunks(self.cache, len(src)):
            data = storage[start:end].index_select(1, index).reshape(-1).view(torch.uint8)
            write_frame(sock, DATA, tid, start, dst, memoryview(data.cpu().numpy()))
        write_frame(sock, END, tid, len(self.cache.layers))

    def _connect(self, endpoint: KVEndpoint, timeout: float) -> socket.socket:
        sock = self._conns.get(endpoint.address)
        if sock is None:
            host, port = endpoint.address.rsplit(":", 1)
            try:
                sock = socket.create_connection((host, int(port)), timeout=timeout)
                _configure(sock)
                prove_to_receiver(sock, self._key, endpoint.address)
            except (OSError, ConnectionError) as exc:
                raise TransferError(f"cannot open a KV link to {endpoint.address}: {exc}") from exc
            self._conns[endpoint.address] = sock
        return sock

    def _drop(self, endpoint: KVEndpoint) -> None:
        sock = self._conns.pop(endpoint.address, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for sock in self._conns.values():
            sock.close()
        self._conns.clear()


class TcpTransport(KVTransport):
    name = "tcp"

    def receiver(self, cache: KVCache, host: str = "127.0.0.1") -> TcpReceiver:
        return TcpReceiver(cache, host, self.key)

    def sender(self, cache: KVCache) -> TcpSender:
        return TcpSender(cache, self.key)
