"""Real file-system faults for tests (importable as ``filesystems``): a small tmpfs of the
test's own that can be filled up or remounted read-only, FIFOs and directories in place
of files, and permission bits that bind root too.

Tests may run as root, where ``chmod`` stops nobody: a read-only directory is a real
read-only mount (``mount -o remount,ro`` of the tmpfs), a full one a real full tmpfs, and
an unreadable file is unreadable to a thread (``no_permission_override``) or a process
(``SETPRIV``) that lacks the capabilities with which root ignores mode bits. Where
mounting is not permitted (not root, no CAP_SYS_ADMIN), tests that need a mount skip and
say why.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# CAP_DAC_OVERRIDE (1) and CAP_DAC_READ_SEARCH (2): how root reads and writes past mode bits
_OVERRIDE_CAPS = (1 << 1) | (1 << 2)
_CAP_VERSION_3 = 0x20080522

# a command prefix that runs a process (and its children) as root without those two
SETPRIV = [
    "setpriv", "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]  # fmt: skip


def is_root() -> bool:
    return os.geteuid() == 0


def without_override_prefix() -> list[str]:
    """What to put before a command so that mode bits bind it: nothing for a user that
    is not root; ``SETPRIV`` for root (skips the test when setpriv is missing)."""
    if not is_root():
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: mode bits cannot be made to bind")
    return SETPRIV


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


@contextlib.contextmanager
def no_permission_override() -> Iterator[None]:
    """Within the block, mode bits bind the calling thread even as root: the two
    capabilities that override them leave its *effective* set (they stay permitted, and
    come back at the end). Threads started inside inherit the reduced set."""
    if not is_root():
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(_CAP_VERSION_3, 0)  # pid 0: this thread
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip(f"capget failed: {os.strerror(ctypes.get_errno())}")
    saved = data[0].effective
    data[0].effective = saved & ~_OVERRIDE_CAPS
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip(f"capset failed: {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(header), data) == 0, "capabilities not restored"


class Tmpfs:
    """A tmpfs mounted at ``path``: ``read_only()`` / ``writable()`` remount it, ``fill()``
    leaves it without a free byte until ``unfill()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.filler = path / "filler"

    def _mount(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)

    def read_only(self) -> None:
        done = self._mount("-o", "remount,ro", str(self.path))
        assert done.returncode == 0, done.stderr

    def writable(self) -> None:
        done = self._mount("-o", "remount,rw", str(self.path))
        assert done.returncode == 0, done.stderr

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self) -> None:
        """Write ``filler`` until the file system refuses another byte (ENOSPC)."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 20, 4096, 1):
                chunk = bytes(size)
                while True:
                    try:
                        os.write(fd, chunk)
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC, exc
                        break
        finally:
            os.close(fd)
        assert self.free_bytes() == 0

    def unfill(self) -> None:
        self.filler.unlink()


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "32m") -> Iterator[Tmpfs]:
    """A fresh tmpfs of ``size`` at ``path`` (created) for the block, then unmounted;
    skips the test where this process may not mount."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0755"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "ferry-test", str(path)],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    fs = Tmpfs(path)
    try:
        yield fs
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def fifo_in_place_of(path: Path) -> None:
    """A FIFO where the file ``path`` was: opening it for reading would block forever."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def directory_in_place_of(path: Path) -> None:
    """A directory (holding a file, so it is not merely empty) where ``path`` was."""
    path.unlink(missing_ok=True)
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def unreadable(path: Path) -> None:
    """Mode 000: unreadable to whoever mode bits bind (see ``no_permission_override``)."""
    path.chmod(0)
