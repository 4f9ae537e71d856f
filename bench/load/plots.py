"""PNG plots of a sweep (matplotlib, Agg backend): the throughput/interactivity Pareto
front and the TTFT / ITL percentiles against the load.

Every function takes the sweep's points: dicts with ``load`` (the concurrency or rate
of the point) and ``summary`` (from :func:`bench.load.stats.summarize`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Point = dict[str, Any]
_STYLES = {"p50": "o-", "p90": "s--", "p99": "^:"}


def pareto_front(xy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated in both coordinates (larger is better), sorted by x."""
    front = [p for p in xy if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in xy)]
    return sorted(set(front))


def _load_label(load_kind: str) -> str:
    return "concurrency (streams)" if load_kind == "concurrency" else "request rate (req/s)"


def plot_pareto(ax, points: list[Point], load_kind: str, label: str) -> None:
    """Total output tok/s (y) against per-user output tok/s (x), each point labelled."""
    xy = [
        (p["summary"]["per_user_output_tok_s"], p["summary"]["output_throughput"]) for p in points
    ]
    ax.plot([x for x, _ in xy], [y for _, y in xy], "o", color="tab:blue", label=label)
    front = pareto_front([p for p in xy if p[0] == p[0] and p[1] == p[1]])
    ax.plot(
        [x for x, _ in front],
        [y for _, y in front],
        "-",
        color="tab:blue",
        alpha=0.6,
        label="Pareto front",
    )
    prefix = "c=" if load_kind == "concurrency" else "r="
    for p, (x, y) in zip(points, xy):
        ax.annotate(
            f"{prefix}{p['load']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8
        )
    ax.margins(x=0.12, y=0.12)  # room for the point labels
    ax.set_xlabel("per-user output throughput (tok/s per request)")
    ax.set_ylabel("total output throughput (tok/s)")
    ax.set_title("Throughput vs interactivity")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)  # the front runs from top left to bottom right


def plot_percentiles(ax, points: list[Point], load_kind: str, key: str, name: str) -> None:
    """p50/p90/p99 of ``summary[key]`` (ms) against the load, log-scaled x."""
    loads = [p["load"] for p in points]
    for pct, style in _STYLES.items():
        ax.plot(loads, [p["summary"][key][pct] for p in points], style, label=pct)
    ax.set_xscale("log", base=2 if load_kind == "concurrency" else 10)
    ax.set_xticks(loads, [f"{v:g}" for v in loads])
    ax.minorticks_off()
    ax.set_xlabel(_load_label(load_kind))
    ax.set_ylabel(f"{name} (ms)")
    ax.set_title(f"{name} percentiles vs load")
    ax.grid(True, alpha=0.3)
    ax.legend()


def write_plots(points: list[Point], load_kind: str, stem: Path, label: str) -> list[Path]:
    """Write ``<stem>.png`` (the three panels side by side) and one PNG per panel.

    Returns the paths written. ``label`` names the series (e.g. the server and model).
    """
    panels = [
        ("pareto", lambda ax: plot_pareto(ax, points, load_kind, label)),
        ("ttft", lambda ax: plot_percentiles(ax, points, load_kind, "ttft_ms", "TTFT")),
        ("itl", lambda ax: plot_percentiles(ax, points, load_kind, "itl_ms", "ITL")),
    ]
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (_, draw) in zip(axes, panels):
        draw(ax)
    fig.suptitle(label)
    fig.tight_layout()
    paths.append(_save(fig, stem.with_suffix(".png")))
    for name, draw in panels:
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        draw(ax)
        fig.tight_layout()
        paths.append(_save(fig, stem.with_name(f"{stem.name}_{name}.png")))
    return paths


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
