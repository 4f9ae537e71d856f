"""The simulated H200's step costs (``bench.spec_decode_sim.H200Costs``) fitted to a sweep's trace.

    PYTHONPATH=. .venv/bin/python -m bench.spec_decode_fit \\
        bench/results/traces/spec_decode_h200.tar.gz [--compare] [--seeds 4]

Reads the step trace ``bench.spec_decode_gpu`` packs beside its JSON (one line per step of
every arm) and fits, each by least squares reweighted toward the absolute error (a slow
spell of the host's moves a median, not a mean):

- ``graph_s``: decode steps a CUDA graph replays (every chunk one token plus its drafts:
  they yield at least a token a row; at most 256 rows), without drafts: the median device
  time per graph bucket, less ``sample_s``;
- ``verify_graph_s`` (``--graph-rows`` past 256: the sweep replayed verify steps of that
  many rows from graphs): those steps' median device time per bucket past 256 rows, less
  sampling, verification and drafting;
- ``verify_s``: what a replayed decode step with drafts adds to one without in the same
  bucket (the median over buckets), less the drafter's ``draft_s``;
- ``eager_s`` + ``eager_row_s`` a row: decode steps past the graphs (all verify drafts),
  less sampling, verification and drafting;
- ``mixed_s`` + ``mixed_token_s`` a token + ``mixed_draft_s`` a draft + ``mixed_drafts_s``
  when it holds any: steps with prefill, less sampling (and, with drafts, verification
  and drafting);
- ``issue_drafts_s`` + ``issue_draft_s`` a draft: how much later the replayed step before
  a step with prefill and drafts takes its outcome (its wall interval less its device
  time) than the one before a step with prefill and none, by the drafts of the step after
  (the host issues that step, kernel by kernel, before it takes the outcome).

``eager_issue_s``, ``eager_floor_s`` and the host's other costs are not in the trace and
stay as ``H200Costs`` has them. ``--compare``: the sim with ``H200Costs`` over ``--seeds``
seeds against the sweep's tok/s, per point and arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tarfile
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from engine.spec.cost import graph_size

GRAPH_ROWS = 256  # the largest decode step without drafts a CUDA graph replays


@dataclass(frozen=True)
class Step:
    arm: str
    workload: str
    concurrency: int
    tokens: int
    drafts: int
    yielded: int
    interval_s: float | None
    device_s: float

    @property
    def base(self) -> int:
        """Tokens beside the drafts."""
        return self.tokens - self.drafts

    @property
    def decode(self) -> bool:
        """Every chunk one token plus its drafts: each row yields (a prompt's do not)."""
        return self.yielded >= self.base

    def replayed(self, graph_rows: int = GRAPH_ROWS) -> bool:
        return self.decode and self.tokens <= graph_rows


def read_trace(archive: Path) -> tuple[list[Step], list[dict]]:
    """The steps of an archive's trace (the warm-up and diagnosis left out) and its JSON's
    records."""
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        trace = next(n for n in names if n.endswith("_trace.jsonl"))
        lines = tar.extractfile(trace).read().decode().splitlines()  # type: ignore[union-attr]
        result = next((n for n in names if n.endswith(".json")), None)
        records = (json.loads(tar.extractfile(result).read())["records"]  # type: ignore[union-attr]
                   if result else [])  # fmt: skip
    header = json.loads(lines[0])
    steps = []
    for line in lines[1:]:
        row = dict(zip(header, json.loads(line)))
        parts = row["point"].rsplit("-", 2)  # workload-concurrency-round, else the warm-up
        if len(parts) != 3 or not parts[1].isdigit():  # and the diagnoses (warm, host-..)
            continue
        workload, c, _ = parts
        steps.append(Step(row["arm"], workload, int(c), row["tokens"], row["drafts"],
                          row["yielded"], row["interval_s"], row["device_s"]))  # fmt: skip
    return steps, records


def robust_fit(x: np.ndarray, y: np.ndarray, rounds: int = 30) -> np.ndarray:
    """Coefficients of ``y ~ x`` (columns), reweighted toward the absolute error."""
    weights = np.ones(len(y))
    coef = np.zeros(x.shape[1])
    for _ in range(rounds):
        coef = np.linalg.lstsq(x * weights[:, None], y * weights, rcond=None)[0]
        weights = 1.0 / np.sqrt(np.maximum(np.abs(y - x @ coef), 1e-4))
    return coef


def fit(steps: list[Step], sample_s: float, draft_s: float,
        graph_rows: int = GRAPH_ROWS) -> dict[str, object]:  # fmt: skip
    """The fitted ``H200Costs`` fields (module docstring), in seconds; ``graph_rows``:
    the most rows the sweep's graphs replayed."""
    plain: dict[int, list[float]] = {}
    drafted: dict[int, list[float]] = {}
    for s in steps:
        if s.replayed(graph_rows):
            (drafted if s.drafts else plain).setdefault(graph_size(s.tokens), []).append(s.device_s)
    graph = {b: statistics.median(v) for b, v in plain.items() if len(v) >= 3}
    added = [statistics.median(drafted[b]) - graph[b] for b in graph
             if len(drafted.get(b, ())) >= 3]  # fmt: skip
    verify_s = statistics.median(added) - draft_s
    verify_graph = {b: statistics.median(v) - sample_s - verify_s - draft_s
                    for b, v in drafted.items() if b > GRAPH_ROWS and len(v) >= 3}  # fmt: skip
    eager = [s for s in steps if s.decode and not s.replayed(graph_rows)]
    e0, e1 = robust_fit(np.array([[1.0, s.tokens] for s in eager]),
                        np.array([s.device_s for s in eager]))  # fmt: skip
    mixed = [s for s in steps if not s.decode]
    m = robust_fit(np.array([[1.0, s.base, s.drafts, s.drafts > 0] for s in mixed], float),
                   np.array([s.device_s for s in mixed]))  # fmt: skip
    late, early = [], []  # (drafts after, how late) for a replayed step before a prefill
    for before, after in zip(steps, steps[1:]):
        same = (before.arm, before.workload, before.concurrency) == (
            after.arm, after.workload, after.concurrency)  # fmt: skip
        if (same and before.replayed(graph_rows) and not after.decode
                and before.interval_s is not None):  # fmt: skip
            (late if after.drafts else early).append(
                (after.drafts, before.interval_s - before.device_s))
    i0, i1 = robust_fit(np.array([[1.0, d] for d, _ in late]),
                        np.array([x for _, x in late]))  # fmt: skip
    on_time = statistics.median(x for _, x in early)
    verify_graphs = {"verify_graph_s": tuple((b, round(t, 6)) for b, t in
                                             sorted(verify_graph.items()))} if verify_graph else {}
    return {
        "graph_s": tuple((b, round(t - sample_s, 6)) for b, t in sorted(graph.items())),
        **verify_graphs,
        "verify_s": round(verify_s, 6),
        "eager_s": round(e0 - sample_s - verify_s - draft_s, 6),
        "eager_row_s": round(e1, 8),
        "mixed_s": round(m[0] - sample_s, 6),
        "mixed_token_s": round(m[1], 8),
        "mixed_draft_s": round(m[2], 8),
        "mixed_drafts_s": round(m[3] - verify_s - draft_s, 6),
        "issue_drafts_s": round(i0 - on_time, 6),
        "issue_draft_s": round(i1, 8),
    }


def compare(records: list[dict], seeds: int,
            costs=None) -> list[tuple[str, int, str, float]]:  # fmt: skip
    """(workload, concurrency, arm, the sim's mean tok/s over the sweep's) per record, the
    sim on ``costs`` (default ``H200Costs``)."""
    from bench.spec_decode_sim import run

    sims: dict[tuple[str, int, str], list[float]] = {}
    for seed in range(seeds):
        for r in run(seed=seed, costs=costs):
            sims.setdefault((r["workload"], r["concurrency"], r["arm"]), []).append(r["tok_s"])
    return [(r["workload"], r["concurrency"], r["arm"],
             statistics.mean(sims[key]) / r["tok_s"])
            for r in records if (key := (r["workload"], r["concurrency"], r["arm"])) in sims
            and r.get("tok_s")]  # fmt: skip


def main() -> None:
    from bench.spec_decode_sim import H200Costs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("archive", type=Path)
    ap.add_argument("--compare", action="store_true", help="the sim against the sweep")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--graph-rows", type=int, default=GRAPH_ROWS,
                    help="the most rows the sweep replayed from graphs (its verify steps')")
    ap.add_argument("--fitted", action="store_true",
                    help="--compare the sim on the fitted costs, not H200Costs'")
    args = ap.parse_args()
    steps, records = read_trace(args.archive)
    costs = H200Costs()
    fitted = fit(steps, costs.sample_s, costs.draft_s, args.graph_rows)
    print(f"{len(steps)} steps of {args.archive}; fitted, and as H200Costs has it:")
    for f in fields(H200Costs):
        if f.name in fitted:
            print(f"  {f.name} = {fitted[f.name]}  ({getattr(costs, f.name)})")
    if args.compare:
        ratios = compare(records, args.seeds, replace(costs, **fitted) if args.fitted else None)
        fixed = [r for _, _, arm, r in ratios if arm != "dynamic"]  # the policy may differ
        close = sum(abs(r - 1) <= 0.10 for r in fixed)
        print(f"sim / sweep tok/s over {args.seeds} seeds; {close} of the {len(fixed)} none "
              "and fixed points within 10 %:")
        for workload, c, arm, ratio in ratios:
            print(f"  {workload:>14} c={c:<4} {arm:>8} {ratio:.2f}")


if __name__ == "__main__":
    main()
