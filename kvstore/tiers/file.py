"""The file tier: one file per KV block in a directory every worker of the host shares.

A block lives at ``<dir>/<namespace>/<hh>/<hash>.kv`` (``format.BlockMeta.namespace``
keeps models, dtypes and block sizes apart; ``hh`` is the hash's first byte). Files are
written by one writer thread per process from a queue bounded in bytes, to a temporary
name that is then renamed, so a reader sees a whole file or none; a step never waits for
a write (when the queue is full the block is simply not written). Reads are synchronous
and verified (``format.unpack``); a corrupt file is removed and counts as a miss.

A file's mtime is its last use (set on write and on every load, from ``clock``): a file
unused for ``ttl_s`` expires, and beyond ``capacity_bytes`` the least recently used go.
Each process keeps an index of the files it knows (a scan of the directory at start and
every ``scan_interval_s``, plus its own writes and loads) and enforces both bounds on it;
a block another worker wrote is found by its name even before a scan lists it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from kvstore.hashing import BlockHash
from kvstore.procs import pid_alive
from kvstore.tiers.events import TierEvents
from kvstore.tiers.fileio import BlockIO, open_block_io
from kvstore.tiers.format import BlockMeta, CorruptBlock, file_size, pack, unpack

log = logging.getLogger("ferry.kvstore")

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 600.0  # a temporary file this old belongs to a writer that died
_TICK = object()


class FileTier:
    name = "file"

    def __init__(
        self,
        directory: str | os.PathLike,
        meta: BlockMeta,
        capacity_bytes: int,
        ttl_s: float,
        events: TierEvents,
        *,
        clock: Callable[[], float] = time.time,
        io: BlockIO | None = None,
        max_pending_bytes: int = 256 << 20,
        scan_interval_s: float = 300.0,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"the KV file TTL must be positive, got {ttl_s} s")
        self.meta = meta
        self.file_bytes = file_size(meta, bytes(16))  # every block file has this size
        self.max_files = capacity_bytes // self.file_bytes
        if self.max_files < 1:
            raise ValueError(
                f"KV file capacity {capacity_bytes} bytes holds no block ({self.file_bytes} bytes)"
            )
        self.root = Path(directory).expanduser() / meta.namespace
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"KV file directory {directory}: {exc.strerror}") from exc
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ValueError(f"KV file directory {self.root} is not writable")
        self._root = str(self.root)
        self.ttl_s = ttl_s
        self.clock = clock
        self.io = io or open_block_io(str(self.root), self.file_bytes)
        self._events = events
        self._max_pending = max_pending_bytes
        self._scan_interval = scan_interval_s
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, float] = OrderedDict()  # hash -> last use, LRU first
        self._pending: dict[BlockHash, torch.Tensor] = {}  # queued for the writer
        self._pending_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._buffers: list[bytearray] = []  # read buffers, recycled
        self._host = socket.gethostname()
        self.bytes_read = 0
        self.bytes_written = 0
        self.evictions = 0  # over capacity
        self.expired = 0  # past the TTL
        self.checksum_failures = 0
        self.dropped = 0  # writes skipped because the queue was full
        self.write_errors = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-file-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def path(self, block_hash: BlockHash) -> Path:
        return Path(self._path(block_hash))

    def _path(self, block_hash: BlockHash) -> str:
        hexd = block_hash.hex()
        return f"{self._root}/{hexd[:2]}/{hexd}{_SUFFIX}"

    def __len__(self) -> int:
        """Files this process knows of (its index), queued writes included."""
        with self._lock:
            return len(self._index) + len(self._pending)

    def known(self, block_hash: BlockHash) -> bool:
        """Written or queued, as far as this process knows (no file system call)."""
        with self._lock:
            return block_hash in self._pending or block_hash in self._index

    # -- reading --------------------------------------------------------------------------------

    def load(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block (a CPU tensor of ``meta.block_shape``), or None when no valid file
        holds it. An expired file is removed; so is a corrupt one (and counted)."""
        with self._lock:
            queued = self._pending.get(block_hash)
        if queued is not None:
            return queued
        path = self._path(block_hash)
        try:
            mtime = os.stat(path).st_mtime
            now = self.clock()
            if now - mtime > self.ttl_s:
                self._remove(block_hash, "expired")
                return None
            data = self.io.read(path, self._take_buffer())
        except FileNotFoundError:
            with self._lock:
                self._index.pop(block_hash, None)
            return None
        try:
            block = unpack(self.meta, block_hash, data)
        except CorruptBlock as exc:
            log.warning("KV block file %s is corrupt (%s): removed", path, exc)
            self._remove(block_hash, "corrupt")
            self.recycle(data)
            return None
        block._ferry_buffer = data  # type: ignore[attr-defined]  # for ``recycle``
        self._touch(path, now)
        with self._lock:
            self._index[block_hash] = now
            self._index.move_to_end(block_hash)
            self.bytes_read += len(data)
        return block

    def recycle(self, block: torch.Tensor | bytearray) -> None:
        """Hand back the buffer under a block ``load`` returned, once it has been copied
        out, for the next read (fresh buffers of this size cost page faults)."""
        buf = block if isinstance(block, bytearray) else getattr(block, "_ferry_buffer", None)
        if buf is not None and len(buf) == self.file_bytes and len(self._buffers) < 64:
            self._buffers.append(buf)

    def _take_buffer(self) -> bytearray | None:
        try:
            return self._buffers.pop()
        except IndexError:  # empty (pop is atomic: no lock needed)
            return None

    # -- writing --------------------------------------------------------------------------------

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> bool:
        """Queue ``block`` (a CPU tensor the caller no longer writes to) for writing.
        Returns at once; False when it is known already or the queue is full."""
        nbytes = block.numel() * block.element_size()
        with self._lock:
            if self._closed or block_hash in self._pending or block_hash in self._index:
                return False
            if self._pending_bytes + nbytes > self._max_pending:
                self.dropped += 1
                return False
            self._pending[block_hash] = block
            self._pending_bytes += nbytes
        self._queue.put(block_hash)
        return True

    def flush(self) -> None:
        """Wait until every queued block is written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=60)
        atexit.unregister(self.close)

    def _run(self) -> None:
        self.scan()
        last_scan = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self._scan_interval)
            except queue.Empty:
                item = _TICK
            try:
                if item is None:
                    return
                if item is not _TICK:
                    self._write(item)
                if time.monotonic() - last_scan >= self._scan_interval:
                    self.scan()
                    last_scan = time.monotonic()
            except Exception:  # the writer must outlive one bad write or scan
                log.exception("KV file writer")
            finally:
                if item is not _TICK:
                    self._queue.task_done()

    def _write(self, block_hash: BlockHash) -> None:
        with self._lock:
            block = self._pending[block_hash]
        path = self.path(block_hash)
        owner = f"{threading.get_ident()}.{os.getpid()}@{self._host}"
        tmp = path.parent / f".{path.stem}.{owner}{_TMP_SUFFIX}"
        now = self.clock()
        try:
            if path.exists():  # another worker wrote it
                stored = False
            else:
                path.parent.mkdir(exist_ok=True)
                written = self.io.write(str(tmp), pack(self.meta, block_hash, block))
                os.utime(tmp, (now, now))
                os.replace(tmp, path)
                stored = True
        except OSError as exc:
            log.warning("KV block file %s not written: %s", path, exc)
            _unlink(tmp)
            with self._lock:
                self.write_errors += 1
                self._drop_pending(block_hash)
            return
        with self._lock:
            self._index[block_hash] = now
            self._index.move_to_end(block_hash)
            self._drop_pending(block_hash)
            if stored:
                self.bytes_written += written
        if stored:
            self._events.add("stored", block_hash, self.name)
        self._evict_over_capacity()

    def _drop_pending(self, block_hash: BlockHash) -> None:
        block = self._pending.pop(block_hash)
        self._pending_bytes -= block.numel() * block.element_size()

    # -- bounds ---------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Remove what is past the TTL, then the least recently used beyond capacity."""
        cutoff = self.clock() - self.ttl_s
        with self._lock:
            old = [h for h, used in self._index.items() if used < cutoff]
        for h in old:
            self._remove(h, "expired")
        self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        while True:
            with self._lock:
                if len(self._index) <= self.max_files:
                    return
                victim = next(iter(self._index))
            self._remove(victim, "evicted")

    def _remove(self, block_hash: BlockHash, why: str) -> None:
        _unlink(self._path(block_hash))
        with self._lock:
            self._index.pop(block_hash, None)
            if why == "expired":
                self.expired += 1
            elif why == "evicted":
                self.evictions += 1
            else:
                self.checksum_failures += 1
        self._events.add("removed", block_hash, self.name)

    def scan(self) -> None:
        """Learn the files in the directory (other workers' too, and those left by an
        earlier run: each is announced as stored), drop stale temporary files, then
        apply the TTL and the capacity bound."""
        found: dict[BlockHash, float] = {}
        now = time.time()
        started = self.clock()
        for sub in _listdir(self.root):
            for entry in _scandir(self.root / sub):
                if entry.name.endswith(_TMP_SUFFIX):
                    self._reap_tmp(entry, now)
                    continue
                if not entry.name.endswith(_SUFFIX):
                    continue
                try:
                    found[bytes.fromhex(entry.name[: -len(_SUFFIX)])] = entry.stat().st_mtime
                except (ValueError, OSError):
                    continue
        with self._lock:
            before = self._index
            for h, used in before.items():
                if h in found or used >= started:  # gone from disk unless used since
                    found[h] = max(used, found.get(h, used))
            self._index = OrderedDict(sorted(found.items(), key=lambda kv: kv[1]))
        for h in found.keys() - before.keys():  # so an index learns of older files too
            self._events.add("stored", h, self.name)
        for h in before.keys() - found.keys():
            self._events.add("removed", h, self.name)
        self.sweep()

    def _reap_tmp(self, entry: os.DirEntry, now: float) -> None:
        # .<hash>.<thread>.<pid>@<host>.tmp
        owner = entry.name[1 : -len(_TMP_SUFFIX)].split(".", 2)[-1]
        pid, _, host = owner.partition("@")
        try:
            old = now - entry.stat().st_mtime > _STALE_TMP_S
        except OSError:
            return
        if old or (host == self._host and pid.isdigit() and not pid_alive(int(pid))):
            _unlink(Path(entry.path))

    @staticmethod
    def _touch(path: str, now: float) -> None:
        with contextlib.suppress(OSError):  # removed meanwhile: the next load misses
            os.utime(path, (now, now))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "evictions": self.evictions,
                "expired": self.expired,
                "checksum_failures": self.checksum_failures,
                "dropped": self.dropped,
            }


def _unlink(path: str | Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _scandir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []
