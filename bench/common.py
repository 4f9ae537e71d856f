"""What every benchmark result records about where and when it ran."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        return (out.stdout.strip() + ("-dirty" if dirty else "")) or "unknown"
    except OSError:
        return "unknown"


def machine_info() -> dict:
    import torch

    info = {
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
        },
    }
    if torch.cuda.is_available():
        info["machine"]["gpu"] = torch.cuda.get_device_name()
    return info


def wall_times(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall time of ``fn()`` in seconds in each of ``repeats`` runs, after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs, after one warm-up."""
    return statistics.median(wall_times(fn, repeats))


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, wait up to ``grace_s`` for a clean exit, then SIGKILL (a server, a worker)."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
