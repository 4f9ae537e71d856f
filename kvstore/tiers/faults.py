"""What the file tier does when its file system fails it.

Errors come in two kinds, and neither ever reaches the engine's step:

- **of one block**: a directory, a FIFO or a device where its file should be, a file this
  process may not read, an I/O error on one read, a name that cannot be created. A read
  is a miss, a write is skipped; each is counted, and logged at most once per
  ``LOG_INTERVAL_S`` and kind (``ErrorLog``: the next line says how many it left out).
- **of the directory** (``DIRECTORY_ERRNOS``: read-only, full, over quota, no write
  permission, an I/O error on write): the tier is *degraded* (``WriteHealth``). It writes
  nothing (queued blocks are dropped, new ones refused, so the queue drains and memory
  is given back) while reads go on. Every ``probe_interval_s`` the writer thread writes
  and removes a small probe file in the directory that failed; once that works, and the
  free space allows a block, the tier writes again by itself.

Free space is part of the capacity bound: the tier holds no more files than fit in what
it holds already plus the file system's free space, less a margin of
``min_free_fraction`` of the file system (and never takes the last free inodes). When
even an empty tier would not fit, it is degraded ("free space below the margin") until
space comes back.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

LOG_INTERVAL_S = 30.0  # at most one line per kind of error this often
MIN_FREE_INODES = 64
_PROBE_BYTES = 4096

# errors of a write that say the directory takes no writes (not just this block's file)
DIRECTORY_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
)


class NotARegularFile(OSError):
    """A block path holds something other than a regular file (a directory, a FIFO...)."""


class ErrorLog:
    """Warnings about one kind of failure, at most one line per ``interval_s`` and kind;
    the next line written says how many were left out. Safe from any thread."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``message % args`` at WARNING unless ``kind`` was logged recently; True
        when it was written."""
        now = self._clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._left_out[kind] = self._left_out.get(kind, 0) + 1
                return False
            self._last[kind] = now
            left_out = self._left_out.pop(kind, 0)
        if left_out:
            message += f" (and {left_out} more like it in the last {self._interval:g} s)"
        self._log.warning(message, *args, exc_info=exc_info)
        return True


def errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, type(exc).__name__)


class WriteHealth:
    """Whether the tier's directory takes writes, and how many files its free space
    allows. The writer thread calls everything but ``degraded``, which any thread reads.

    ``degraded`` is None while writes work, else why they do not (a sentence).
    """

    def __init__(
        self,
        root: str,
        file_bytes: int,
        *,
        mode: int,
        min_free_fraction: float,
        probe_interval_s: float,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= min_free_fraction < 1.0:
            raise ValueError(f"the free-space margin must be in [0, 1), got {min_free_fraction}")
        self.root = root
        self.file_bytes = file_bytes
        self.mode = mode
        self.min_free_fraction = min_free_fraction
        self.probe_interval_s = probe_interval_s
        self.degraded: str | None = None
        self.degraded_count = 0  # times the tier became degraded
        self._log = logger
        self._clock = clock
        self._probe_dir = root
        self._next_probe = 0.0

    # -- free space ------------------------------------------------------------------------

    def room(self, known_files: int) -> int | None:
        """How many files the tier may hold, free space considered, when it holds
        ``known_files`` now (None: the file system does not say). One ``statvfs`` (a
        microsecond or so beside a block's write)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        unit = st.f_frsize or st.f_bsize or 4096
        on_disk = -(-self.file_bytes // unit) * unit  # a file takes whole blocks
        reserve = int(st.f_blocks * unit * self.min_free_fraction)
        limit = max((known_files * on_disk + st.f_bavail * unit - reserve) // on_disk, 0)
        if st.f_files and st.f_favail < MIN_FREE_INODES:
            limit = min(limit, known_files)  # room for a new file only by removing one
        return limit

    # -- degraded state ---------------------------------------------------------------------

    def failed(self, exc: OSError, where: str) -> bool:
        """A write under ``where`` (a directory) raised ``exc``: True when that makes the
        tier degraded (an error of the directory, not of one block)."""
        if exc.errno not in DIRECTORY_ERRNOS:
            return False
        self.enter(f"{exc.strerror or exc} ({errno_name(exc)})", where)
        return True

    def enter(self, reason: str, where: str | None = None) -> None:
        """Stop writing until a probe succeeds in ``where`` (default: the tier's root)."""
        self._probe_dir = where or self.root
        self._next_probe = self._clock() + self.probe_interval_s
        if self.degraded is None:
            self.degraded_count += 1
            self._log.warning(
                "KV file tier %s is degraded: %s; no blocks are written until a probe "
                "write succeeds (every %g s)", self.root, reason, self.probe_interval_s,
            )  # fmt: skip
        self.degraded = reason

    def probe_due(self) -> bool:
        return self.degraded is not None and self._clock() >= self._next_probe

    def probe(self, known_files: int) -> bool:
        """Try to leave the degraded state: a small file written and removed where the
        failure was, and room for a block. True when the tier writes again."""
        self._next_probe = self._clock() + self.probe_interval_s
        try:
            os.makedirs(self._probe_dir, mode=dir_mode(self.mode), exist_ok=True)
            owner = f"{threading.get_ident()}.{os.getpid()}@{socket.gethostname()}"
            path = os.path.join(self._probe_dir, f".probe.{owner}.tmp")  # a temporary's name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, self.mode)
            try:
                os.write(fd, bytes(_PROBE_BYTES))
            finally:
                os.close(fd)
                unlink_quietly(path)
        except OSError as exc:
            self.degraded = f"{exc.strerror or exc} ({errno_name(exc)})"
            return False
        room = self.room(known_files)
        if room is not None and room < 1:
            self.degraded = "free space below the margin"
            return False
        self._log.info("KV file tier %s takes writes again", self.root)
        self.degraded = None
        return True


def dir_mode(file_mode: int) -> int:
    """The mode of the tier's directories for files of ``file_mode``: whoever may read a
    file may list its directory (0600 -> 0700, 0640 -> 0750)."""
    return file_mode | (file_mode & 0o444) >> 2


def unlink_quietly(path: str | os.PathLike) -> OSError | None:
    """Remove ``path``; a missing file is fine, any other failure is returned, not raised
    (a read-only file system must not turn a cleanup into a crash)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc
    return None
