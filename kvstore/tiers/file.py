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
a block another worker wrote is found by its name even before a scan lists it. The
capacity also counts free disk space, less a margin (``faults.WriteHealth.room``).

No file system error reaches the caller (``faults``): a block that cannot be read is a
miss, one that cannot be written is skipped, both counted and logged at a bounded rate;
a directory that is full or read-only makes the tier *degraded* (nothing is written, the
queue drains) until a periodic probe write succeeds. Block files, temporary files
included, are created with ``mode`` (0600: they hold what prompts computed), and the
tier's directories with the matching directory mode.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import queue
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from kvstore.hashing import BlockHash
from kvstore.procs import pid_alive
from kvstore.tiers.events import TierEvents
from kvstore.tiers.faults import ErrorLog, WriteHealth, dir_mode, errno_name, unlink_quietly
from kvstore.tiers.fileio import (
    DEFAULT_FILE_MODE,
    BlockIO,
    check_file_mode,
    check_regular,
    open_block_io,
)
from kvstore.tiers.format import BlockMeta, CorruptBlock, file_size, pack, unpack

log = logging.getLogger("ferry.kvstore")

_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 600.0  # a temporary file this old belongs to a writer that died
_TICK = object()
_FULL = (errno.ENOSPC, errno.EDQUOT)


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
        mode: int = DEFAULT_FILE_MODE,
        min_free_fraction: float = 0.05,
        probe_interval_s: float = 5.0,
    ) -> None:
        """``mode``: permission bits of block files (the owner must read and write);
        ``min_free_fraction``: the share of the file system the tier leaves free;
        ``probe_interval_s``: how often a degraded tier tries a write."""
        if ttl_s <= 0:
            raise ValueError(f"the KV file TTL must be positive, got {ttl_s} s")
        self.meta = meta
        self.file_bytes = file_size(meta, bytes(16))  # every block file has this size
        self.max_files = capacity_bytes // self.file_bytes
        if self.max_files < 1:
            raise ValueError(
                f"KV file capacity {capacity_bytes} bytes holds no block ({self.file_bytes} bytes)"
            )
        self.mode = check_file_mode(mode)
        self.root = Path(directory).expanduser() / meta.namespace
        self._root = str(self.root)
        self._health = WriteHealth(
            self._root, self.file_bytes, mode=mode, min_free_fraction=min_free_fraction,
            probe_interval_s=probe_interval_s, logger=log,
        )  # fmt: skip
        self._errors = ErrorLog(log)
        self._make_root(directory)
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
        self.dropped = 0  # writes skipped: the queue was full or the tier degraded
        self.read_errors = 0  # loads that failed for another reason than a missing file
        self.write_errors = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-file-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _make_root(self, directory: str | os.PathLike) -> None:
        """Create the namespace directory. One that cannot be written (read-only, full, no
        permission) leaves the tier degraded, reading what is there; a path that cannot
        be a directory at all is refused."""
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                self.root.mkdir(mode=dir_mode(self.mode))
                os.chmod(self.root, dir_mode(self.mode))  # the umask may have narrowed it
        except OSError as exc:
            if not self._health.failed(exc, self._root):
                raise ValueError(f"KV file directory {directory}: {exc.strerror}") from exc
            return
        if not self.root.is_dir():
            raise ValueError(f"KV file directory {self.root} is not a directory")
        if not os.access(self.root, os.W_OK | os.X_OK):
            self._health.enter("the directory is not writable")

    @property
    def degraded(self) -> str | None:
        """Why the tier writes nothing now (None: it writes)."""
        return self._health.degraded

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
            st = os.stat(path)
            check_regular(path, st.st_mode)  # a FIFO or a directory is never opened
            now = self.clock()
            if now - st.st_mtime > self.ttl_s:
                self._remove(block_hash, "expired")
                return None
            data = self.io.read(path, self._take_buffer())
        except OSError as exc:
            with self._lock:
                self._index.pop(block_hash, None)
                if not isinstance(exc, FileNotFoundError):
                    self.read_errors += 1
            if not isinstance(exc, FileNotFoundError):
                self._errors.warn(f"read {errno_name(exc)}", "KV block file %s not read (%s): "
                                  "a miss", path, exc.strerror or exc)  # fmt: skip
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
        Returns at once; False when it is known already, the queue is full or the tier
        is degraded."""
        nbytes = block.numel() * block.element_size()
        with self._lock:
            if self._closed or block_hash in self._pending or block_hash in self._index:
                return False
            full = self._pending_bytes + nbytes > self._max_pending
            if full or self._health.degraded is not None:
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
            health = self._health
            wait = health.probe_interval_s if health.degraded else self._scan_interval
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = _TICK
            try:
                if item is None:
                    return
                if health.probe_due():
                    self._probe()
                if item is not _TICK:
                    try:
                        self._write(item)
                    finally:  # written, skipped or failed: it leaves the queue (no leak)
                        with self._lock:
                            self._drop_pending(item)
                if time.monotonic() - last_scan >= self._scan_interval:
                    self.scan()
                    last_scan = time.monotonic()
            except Exception:  # the writer must outlive one bad write or scan
                self._errors.warn("writer", "KV file writer", exc_info=True)
            finally:
                if item is not _TICK:
                    self._queue.task_done()

    def _write(self, block_hash: BlockHash) -> None:
        with self._lock:
            block = self._pending[block_hash]
        if self._health.degraded is not None or not self._make_room():
            with self._lock:
                self.dropped += 1
                self._drop_pending(block_hash)
            return
        path = self.path(block_hash)
        now = self.clock()
        try:
            try:
                written = self._store(block_hash, block, path, now)
            except OSError as exc:  # another program took the space: give some back, once
                if exc.errno not in _FULL or not self._make_room():
                    raise
                written = self._store(block_hash, block, path, now)
        except OSError as exc:
            with self._lock:
                self.write_errors += 1
                self._drop_pending(block_hash)
            if not self._health.failed(exc, str(path.parent)):
                self._errors.warn(f"write {errno_name(exc)}", "KV block file %s not written "
                                  "(%s)", path, exc.strerror or exc)  # fmt: skip
            return
        stored = written > 0
        with self._lock:
            self._index[block_hash] = now
            self._index.move_to_end(block_hash)
            self._drop_pending(block_hash)
            if stored:
                self.bytes_written += written
        if stored:
            self._events.add("stored", block_hash, self.name)
        self._evict_over_capacity()

    def _probe(self) -> None:
        """Try to leave the degraded state, first giving back space the tier holds beyond
        what the free space allows."""
        self._evict_over_capacity(max(self.max_files_now() - 1, 0))
        with self._lock:
            known = len(self._index)
        self._health.probe(known)

    def _store(self, block_hash: BlockHash, block: torch.Tensor, path: Path, now: float) -> int:
        """Write the block's file (bytes written; 0 when another worker wrote it) or raise
        ``OSError``, leaving no temporary file behind."""
        if _is_regular_file(path):
            return 0
        # absent, or a FIFO or a link in its place: the rename replaces it
        owner = f"{threading.get_ident()}.{os.getpid()}@{self._host}"
        tmp = path.parent / f".{path.stem}.{owner}{_TMP_SUFFIX}"
        try:
            _make_dir(path.parent, dir_mode(self.mode))
            written = self.io.write(str(tmp), pack(self.meta, block_hash, block), self.mode)
            os.utime(tmp, (now, now))
            os.replace(tmp, path)
        except BaseException:
            unlink_quietly(tmp)
            raise
        return written

    def _drop_pending(self, block_hash: BlockHash) -> None:
        block = self._pending.pop(block_hash, None)
        if block is not None:
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

    def max_files_now(self) -> int:
        """The capacity in files: ``max_files``, or fewer when the free disk space (less
        the margin) holds fewer."""
        with self._lock:
            known = len(self._index)
        room = self._health.room(known)
        return self.max_files if room is None else min(self.max_files, room)

    def _make_room(self) -> bool:
        """Evict until one more file fits; False (the tier degraded) when none fits even
        with every file gone: the file system is too full."""
        limit = self.max_files_now()
        if limit < 1:
            self._health.enter("free space below the margin")
            return False
        self._evict_over_capacity(limit - 1)
        return True

    def _evict_over_capacity(self, limit: int | None = None) -> None:
        limit = self.max_files_now() if limit is None else limit
        while True:
            with self._lock:
                if len(self._index) <= limit:
                    return
                victim = next(iter(self._index))
            self._remove(victim, "evicted")

    def _remove(self, block_hash: BlockHash, why: str) -> None:
        path = self._path(block_hash)
        error = unlink_quietly(path)
        if error is not None:
            self._errors.warn(f"remove {errno_name(error)}", "KV block file %s not removed "
                              "(%s)", path, error.strerror or error)  # fmt: skip
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
                if not entry.name.endswith(_SUFFIX) or not _is_file(entry):
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
            unlink_quietly(entry.path)

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
                "read_errors": self.read_errors,
                "write_errors": self.write_errors,
                "degraded": int(self._health.degraded is not None),
            }


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def _make_dir(path: Path, mode: int) -> None:
    """Create ``path`` with ``mode`` exactly, unless something is there already."""
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        return
    os.chmod(path, mode)  # the umask may have narrowed it


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
