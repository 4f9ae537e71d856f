"""One bench point and a sweep over several, with their JSON records.

A point builds the workload fresh from the same spec (same seed, same prompts), runs an
optional warm-up that is not recorded, then the measured load.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from bench.load.plots import write_plots
from bench.load.runner import LoadConfig, RunResult, run_load
from bench.load.stats import SLO, format_summary, summarize
from bench.load.workloads import WorkloadSpec, build_sessions

WARMUP_SEED_OFFSET = 10_000


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured load: its summary and, when kept, the per-request records."""

    load: float
    summary: dict[str, Any]
    run: RunResult

    def to_json(self, load_kind: str, with_requests: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"load": self.load, load_kind: self.load, "summary": self.summary}
        if with_requests:
            out["requests"] = [r.to_json() for r in self.run.results]
        return out


def run_point(spec: WorkloadSpec, cfg: LoadConfig, slo: SLO, warmup: int = 0) -> Point:
    """Warm up with ``warmup`` requests (other prompts, same shape), then measure ``spec``."""
    if warmup:
        warm = dataclasses.replace(spec, num_requests=warmup, seed=spec.seed + WARMUP_SEED_OFFSET)
        run_load(build_sessions(warm), dataclasses.replace(cfg, progress=False))
    run = run_load(build_sessions(spec), cfg)
    load = cfg.concurrency if cfg.concurrency is not None else cfg.rate
    return Point(load, summarize(run.results, run.duration_s, slo), run)


def run_sweep(
    spec: WorkloadSpec, cfg: LoadConfig, loads: list[float], slo: SLO, warmup: int = 0
) -> list[Point]:
    """Run one point per load value in turn (concurrency or rate, whichever ``cfg`` sets)."""
    points = []
    for load in loads:
        if cfg.concurrency is not None:
            point_cfg = dataclasses.replace(cfg, concurrency=int(load))
        else:
            point_cfg = dataclasses.replace(cfg, rate=load)
        name = "concurrency" if cfg.concurrency is not None else "rate"
        print(f"== {name} {load:g}")
        point = run_point(spec, point_cfg, slo, warmup)
        print(format_summary(point.summary))
        points.append(point)
    return points


def write_sweep(
    path: Path, header: dict[str, Any], points: list[Point], load_kind: str, label: str
) -> list[Path]:
    """Write the sweep JSON (every point's summary) and its plots beside it."""
    plots = write_plots(
        [p.to_json(load_kind, False) for p in points], load_kind, path.with_suffix(""), label
    )
    record = {
        **header,
        "load_kind": load_kind,
        "points": [p.to_json(load_kind, False) for p in points],
        "plots": [p.name for p in plots],
    }
    write_json(path, record)
    return plots


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Write strict JSON: NaN and infinities become null."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(record), indent=1) + "\n")


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x
