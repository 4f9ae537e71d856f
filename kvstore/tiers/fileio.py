"""How block files are read and written: POSIX, or 3FS's USRBIO when it is there.

``BlockIO`` is the contract the file tier uses for whole-file reads and writes; naming,
renames, stats and unlinks stay plain ``os`` calls (a 3FS FUSE mount serves them). 3FS's
native binding (``hf3fs_fuse.io``) moves the bytes through a shared-memory iovec and an
I/O ring registered with the FUSE process, which bypasses FUSE's per-request size limit
and its copies. ``open_block_io`` picks it when it is importable and the directory is on
a 3FS mount, POSIX otherwise.

Both open block files through ``open_block`` and ``create_block``: a read opens only a
regular file, without blocking (a FIFO in a block's place returns at once instead of
waiting for a writer that never comes), and a new file gets exactly the tier's mode
(0600 by default: block files hold what prompts computed).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvstore.tiers.faults import NotARegularFile

log = logging.getLogger("ferry.kvstore")

DEFAULT_FILE_MODE = 0o600


def check_file_mode(mode: int) -> int:
    """``mode`` when it is permission bits with which the owner reads and writes (0600 to
    0777: the tier must read back what it wrote), else ``ValueError``."""
    if mode & ~0o777 or mode & 0o600 != 0o600:
        raise ValueError(f"KV file mode {mode:o}: the owner must read and write (600 to 777)")
    return mode


_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
)  # fmt: skip


def check_regular(path: str, mode: int) -> None:
    """``NotARegularFile`` unless ``mode`` (an ``st_mode``) is a regular file's."""
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _NOT_REGULAR if test(mode)), f"mode {mode:o}")
        code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
        raise NotARegularFile(code, f"{kind}, not a regular file", path)


def open_block(path: str) -> tuple[int, int]:
    """``(fd, size)`` of the regular file at ``path``, opened for reading without
    blocking; ``NotARegularFile`` (the fd closed) for a directory, FIFO or device."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        check_regular(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def create_block(path: str, mode: int) -> int:
    """A write-only fd on a new file at ``path`` (it must not exist) whose permission bits
    are exactly ``mode``: set on the open fd, before any byte is written, so the umask
    neither widens nor narrows them and the content is never readable more widely."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


class BlockIO(ABC):
    """Whole-file I/O. Both methods may be called from several threads at once."""

    name: str

    @abstractmethod
    def read(self, path: str, buf: bytearray | None = None) -> bytearray:
        """The file's whole content, in ``buf`` when it has the file's size (a recycled
        buffer: no allocation, no page faults), else in a new one; ``FileNotFoundError``
        if the file is gone, ``NotARegularFile`` if it is not a regular file, another
        ``OSError`` when reading fails. Never blocks on a FIFO (``open_block``)."""

    @abstractmethod
    def write(
        self, path: str, parts: Sequence[bytes | memoryview], mode: int = DEFAULT_FILE_MODE
    ) -> int:
        """Create ``path`` (it must not exist) with permission bits ``mode``, holding
        ``parts`` back to back; bytes written. ``OSError`` when the file system refuses
        (the caller removes what was left)."""


class PosixIO(BlockIO):
    name = "posix"

    def read(self, path: str, buf: bytearray | None = None) -> bytearray:
        fd, size = open_block(path)
        try:
            if buf is None or len(buf) != size:
                buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:  # shrank under us: hand back what is there, the checksum decides
                    del buf[got:]
                    break
                got += n
            return buf
        finally:
            os.close(fd)

    def write(
        self, path: str, parts: Sequence[bytes | memoryview], mode: int = DEFAULT_FILE_MODE
    ) -> int:
        fd = create_block(path, mode)
        try:
            views = [memoryview(p).cast("B") for p in parts]
            total = sum(len(v) for v in views)
            done = 0
            while done < total:
                done += os.writev(fd, _skip(views, done))
            return total
        finally:
            os.close(fd)


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


class UsrbioIO(BlockIO):
    """3FS USRBIO: one shared-memory iovec and one read and one write ring per process,
    serialised by a lock (block files are small; the ring's depth is not the limit)."""

    name = "usrbio"

    def __init__(self, mount_point: str, max_file_bytes: int) -> None:
        from multiprocessing.shared_memory import SharedMemory

        import hf3fs_fuse.io as h3io  # type: ignore[import-not-found]

        self._h3 = h3io
        self._lock = threading.Lock()
        self._size = max_file_bytes
        self._shm = SharedMemory(size=max_file_bytes, create=True)
        self._iov = h3io.make_iovec(self._shm, mount_point, 0, -1)
        self._shm.unlink()  # the iovec keeps it mapped
        self._read_ring = h3io.make_ioring(mount_point, 1, True, 0)
        self._write_ring = h3io.make_ioring(mount_point, 1, False, 0)

    def _io(self, fd: int, nbytes: int, for_read: bool) -> int:
        ring = self._read_ring if for_read else self._write_ring
        self._h3.register_fd(fd)
        try:
            io = (self._iov[:nbytes], fd, 0)
            ring.prepare(io[0], for_read, fd, 0, userdata=io)
            (res,) = ring.submit().wait(min_results=1)
            if res.result < 0:
                raise OSError(-res.result, os.strerror(-res.result))
            return res.result
        finally:
            self._h3.deregister_fd(fd)

    def read(self, path: str, buf: bytearray | None = None) -> bytearray:
        fd, size = open_block(path)
        try:
            if size > self._size:
                raise OSError(f"{path}: {size} bytes, larger than any block file")
            with self._lock:
                got = self._io(fd, size, True)
                if buf is None or len(buf) != got:
                    return bytearray(self._shm.buf[:got])
                buf[:] = self._shm.buf[:got]
                return buf
        finally:
            os.close(fd)

    def write(
        self, path: str, parts: Sequence[bytes | memoryview], mode: int = DEFAULT_FILE_MODE
    ) -> int:
        fd = create_block(path, mode)
        try:
            with self._lock:
                done = 0
                for p in parts:
                    v = memoryview(p).cast("B")
                    self._shm.buf[done : done + len(v)] = v
                    done += len(v)
                wrote = self._io(fd, done, False)
            if wrote != done:
                raise OSError(f"{path}: wrote {wrote} of {done} bytes")
            return done
        finally:
            os.close(fd)


def open_block_io(directory: str, max_file_bytes: int) -> BlockIO:
    """USRBIO when ``hf3fs_fuse.io`` imports and ``directory`` is on a 3FS mount."""
    try:
        from hf3fs_fuse.io import extract_mount_point  # type: ignore[import-not-found]
    except ImportError:
        return PosixIO()
    try:
        mount = extract_mount_point(os.path.realpath(directory))
        if mount:
            return UsrbioIO(mount, max_file_bytes)
    except Exception as exc:  # not a 3FS path, or the FUSE side refused: POSIX works too
        log.info("3FS USRBIO unavailable for %s (%s); using POSIX I/O", directory, exc)
    return PosixIO()
