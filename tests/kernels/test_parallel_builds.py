"""Kernel builds done all at once (``kernels.parallel_builds``), as an engine's start-up
asks for them: calls inside run nothing; leaving the section builds every kernel asked
for: those never built before are compiled on worker processes at once, then every one
loads here."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernels import parallel_builds
from kernels._tl import KernelCache

BUILD_S = 0.3  # a compile; a load from the (fake) disk cache takes no time


@dataclass(frozen=True)
class FakeBuild:
    """A ``TileLangBuild`` with a disk cache of marker files in ``folder``; every build
    is logged there with what it did and in which process."""

    folder: str
    name: str

    def built_before(self) -> bool:
        return (Path(self.folder) / self.name).exists()

    def build(self):
        folder = Path(self.folder)
        if (folder / self.name).exists():
            action = "load"
        elif self.name.startswith("bad"):
            raise RuntimeError("nvcc: no such architecture")
        else:
            time.sleep(BUILD_S)
            (folder / self.name).write_text("")
            action = "compile"
        with (folder / "log").open("a") as log:
            log.write(f"{action} {self.name} {os.getpid()}\n")
        name = self.name
        return lambda out: out.append(name)


def fake_make(key: tuple[str, str]) -> FakeBuild:  # module-level: workers unpickle it
    return FakeBuild(*key)


def builds(folder: Path) -> list[tuple[str, str, bool]]:
    """(action, kernel, in this process) per build, in order."""
    lines = (folder / "log").read_text().split()
    return [(a, n, int(p) == os.getpid()) for a, n, p in zip(lines[::3], lines[1::3], lines[2::3])]


def test_kernels_never_built_compile_on_workers_at_once_then_load_here(tmp_path):
    caches, ran = [KernelCache(), KernelCache()], []
    names = [f"k{i}" for i in range(5)]
    with parallel_builds(workers=2):
        for i, name in enumerate(names):
            caches[i % 2].get((str(tmp_path), name), fake_make)(ran)  # not built: runs nothing
        caches[0].get((str(tmp_path), "k0"), fake_make)(ran)  # asked twice, built once
    assert ran == [] and sum(map(len, caches)) == 5
    log = builds(tmp_path)
    assert sorted(n for a, n, here in log[:5] if a == "compile" and not here) == names
    assert log[5:] == [("load", n, True) for n in names]  # then loaded here, in order
    caches[1].get((str(tmp_path), "k3"), fake_make)(ran)  # served from the cache now
    assert ran == ["k3"] and len(builds(tmp_path)) == len(log)


def test_only_the_kernels_never_built_go_to_workers_and_one_alone_compiles_here(tmp_path):
    (tmp_path / "old").write_text("")
    cache = KernelCache()
    with parallel_builds(workers=4):
        for name in ("old", "new1", "new2"):
            cache.get((str(tmp_path), name), fake_make)
    log = builds(tmp_path)
    assert sorted((a, n, here) for a, n, here in log[:2]) == [("compile", "new1", False),
                                                              ("compile", "new2", False)]
    assert log[2:] == [("load", n, True) for n in ("old", "new1", "new2")]
    with parallel_builds(workers=4):
        cache.get((str(tmp_path), "new3"), fake_make)
    assert builds(tmp_path)[-1] == ("compile", "new3", True)  # no workers for one kernel


def test_kernels_already_compiled_load_one_after_another_with_no_workers(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).write_text("")
    cache = KernelCache()
    with parallel_builds(workers=4):
        for name in ("a", "b", "c"):
            cache.get((str(tmp_path), name), fake_make)
    assert builds(tmp_path) == [("load", n, True) for n in ("a", "b", "c")]


def test_a_build_that_fails_raises_its_error_when_the_section_ends(tmp_path):
    cache = KernelCache()
    with pytest.raises(RuntimeError, match="no such architecture"), parallel_builds():
        cache.get((str(tmp_path), "first"), fake_make)
        cache.get((str(tmp_path), "bad"), fake_make)
    assert (str(tmp_path), "bad") not in cache._kernels


def test_only_the_sections_own_thread_defers_and_sections_do_not_nest(tmp_path):
    cache, other = KernelCache(), []
    with parallel_builds(workers=1):
        with parallel_builds():  # the inner one is the outer one's
            cache.get((str(tmp_path), "inner"), fake_make)
        assert not (tmp_path / "inner").exists()  # the inner section built nothing
        thread = threading.Thread(target=lambda: other.append(
            cache.get((str(tmp_path), "t"), fake_make)))  # fmt: skip
        thread.start()
        thread.join()
        assert builds(tmp_path) == [("compile", "t", True)]  # there, right away
    assert builds(tmp_path)[-1] == ("compile", "inner", True)


def test_a_kept_kernel_asked_for_inside_a_section_runs_the_built_one_after_it(tmp_path):
    """A step's plan made in a dry run (a decode graph's bucket) keeps its kernel past the
    section: it must not keep the stand-in that runs nothing."""
    cache, ran = KernelCache(), []
    with parallel_builds(workers=1):
        kept = cache.kept((str(tmp_path), "k"), fake_make)
        kept(ran)
    assert ran == []
    kept(ran)
    kept(ran)
    assert ran == ["k", "k"] and [a for a, _, _ in builds(tmp_path)] == ["compile"]
