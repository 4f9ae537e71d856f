"""Speculative decoding on the CPU: dynamic verify length vs fixed k = 1..5 vs none.

    PYTHONPATH=. .venv/bin/python -m bench.spec_decode --threads 1 \\
        --out bench/results/spec_decode_cpu.json

SmolLM2-135M (the default GGUF, int4 weights as served on the CPU) with prompt lookup on
two repetitive tasks: a code edit (rewrite a function with one name changed: the answer
repeats the code) and summarise-and-quote (summarise a passage, then quote its first
sentences: the answer repeats the passage). Each arm is one in-process ``EngineCore``
(none; fixed k = 1..5; dynamic with K = 5), all loaded at once; at each concurrency
(closed loop: that many requests in flight, the next sent when one ends) the arms take
turns, round after round, so that machine load shifting during the run hits them alike.
Reported per task, concurrency and arm: output tok/s (median over rounds), the mean
acceptance length (tokens a request gets per step that verifies its drafts: 1 + mean
drafts kept), the mean verify budget per verifying step and the policy's per step it was
asked, the step-cost model's and the acceptance estimate's errors, the steps that
verified, the realized-gain guard's blocked and probe steps and the steps that explored
an unmeasured size, and whether the greedy outputs are those of the arm without
speculation. A PNG plots tok/s against concurrency per arm.

``run_arms`` and ``plot`` are shared with ``bench.spec_decode_gpu`` (the H200 run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import machine_info
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams

MAX_K = 5


@dataclass(frozen=True)
class Arm:
    name: str
    speculative: SpeculativeConfig


def arms(method: str, **fields) -> list[Arm]:
    """none, fixed k = 1..5, dynamic with K = 5, for drafter ``method``."""
    out = [Arm("none", SpeculativeConfig())]
    for k in range(1, MAX_K + 1):
        out.append(Arm(f"fixed-{k}", SpeculativeConfig(method=method, num_speculative_tokens=k,
                                                       schedule="fixed", **fields)))  # fmt: skip
    out.append(Arm("dynamic", SpeculativeConfig(method=method, num_speculative_tokens=MAX_K,
                                                schedule="dynamic", **fields)))  # fmt: skip
    return out


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int


def run_load(core: EngineCore, jobs: Sequence[Job], concurrency: int, tag: str) -> dict:
    """Run ``jobs`` greedily, ``concurrency`` at a time (closed loop): output tokens per
    second, the tokens of each job, and what the spec counters gained."""
    before = core.scheduler.stats()
    pending = list(enumerate(jobs))
    tokens: dict[int, list[int]] = {}
    live: dict[str, int] = {}
    steps = 0
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i, job = pending.pop(0)
            rid = f"{tag}-{i}"
            params = SamplingParams(temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True)
            core.add_request(EngineRequest(rid, job.prompt, params))
            live[rid] = i
            tokens[i] = []
        for out in core.step():
            tokens[live[out.request_id]] += out.new_token_ids
            if out.finish_reason is not None:
                del live[out.request_id]
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id}: {out.error}")
        steps += 1
    while core.has_work:  # a step still in flight (overlap) ends before the next load
        core.step()
    seconds = time.perf_counter() - start
    after = core.scheduler.stats()
    groups = after.spec_verify_groups - before.spec_verify_groups
    verify_steps = after.spec_verify_steps - before.spec_verify_steps
    verified = sum(after.spec_draft_verified) - sum(before.spec_draft_verified)
    accepted = sum(after.spec_draft_accepted) - sum(before.spec_draft_accepted)
    by_position = [a - b for a, b in zip(after.spec_draft_accepted, before.spec_draft_accepted)]
    return {
        "seconds": seconds,
        "output_tokens": sum(len(t) for t in tokens.values()),
        "tok_s": sum(len(t) for t in tokens.values()) / seconds,
        "acceptance_length": 1 + accepted / groups if groups else 1.0,
        "verify_budget_per_step": verified / verify_steps if verify_steps else 0.0,
        "accepted_by_position": by_position,
        "verified_by_position": [
            a - b for a, b in zip(after.spec_draft_verified, before.spec_draft_verified)
        ],
        "step_time_error": (after.spec_time_error_us - before.spec_time_error_us)
        / max(1, after.spec_time_us - before.spec_time_us),
        "acceptance_estimate_error": (after.spec_error_milli - before.spec_error_milli)
        / 1000 / groups if groups else 0.0,
        "policy_budget_per_step": (after.spec_budget_drafts - before.spec_budget_drafts)
        / max(1, after.spec_budget_steps - before.spec_budget_steps),
        "verify_steps": verify_steps,
        "guard_blocked_steps": after.spec_guard_blocked_steps - before.spec_guard_blocked_steps,
        "guard_probe_steps": after.spec_guard_probe_steps - before.spec_guard_probe_steps,
        "explored_steps": after.spec_explored_steps - before.spec_explored_steps,
        "steps": steps,
        "tokens": [tokens[i] for i in range(len(jobs))],
    }


def run_arms(
    cores: dict[str, Callable[[], EngineCore]],
    workloads: dict[str, Callable[[int], list[Job]]],
    concurrencies: Sequence[int],
    rounds: int,
    log: Callable[[str], None] = print,
    deadline: float = float("inf"),
    min_tokens: int = 0,
) -> list[dict]:
    """For every concurrency and workload, every arm in turn, ``rounds`` times, or as many
    more as it takes for each arm to yield ``min_tokens`` output tokens (a cheap point
    repeated, so that a shift in the machine's speed lasting a second or two lands on
    every arm, not on the one that ran then); the order reverses each round. One record
    per (workload, concurrency, arm) with the median tok/s and the other figures.
    ``cores[arm]()`` readies the engine an arm runs on and returns it. An arm that raises
    gets a record with its error and the run goes on; past ``deadline`` (a
    ``time.perf_counter()`` value) the points left get a record saying so."""
    records = []
    points = [(w, c) for c in concurrencies for w in workloads]
    for workload, c in points:
        if time.perf_counter() > deadline:
            records += [{"workload": workload, "concurrency": c, "arm": name,
                         "error": "skipped: out of time"} for name in cores]  # fmt: skip
            log(f"{workload:>18} c={c:<4} skipped: out of time")
            continue
        jobs = workloads[workload](c)
        runs: dict[str, list[dict]] = {name: [] for name in cores}
        errors: dict[str, str] = {}
        per_round = sum(job.max_tokens for job in jobs)
        for r in range(max(rounds, -(-min_tokens // per_round))):
            order = list(cores) if r % 2 == 0 else list(reversed(cores))
            for name in order:
                if name in errors:
                    continue
                try:
                    runs[name].append(run_load(cores[name](), jobs, c, f"{workload}-{c}-{r}"))
                except Exception as exc:  # noqa: BLE001 - reported, the other arms go on
                    errors[name] = f"{type(exc).__name__}: {exc}"
                    log(f"{workload:>18} c={c:<4} {name:>9}: {errors[name]}")
        records += [{"workload": workload, "concurrency": c, "arm": name, "error": e}
                    for name, e in errors.items()]  # fmt: skip
        reference = runs["none"][0]["tokens"] if runs.get("none") else None
        for name, rs in runs.items():
            if rs:
                records.append(_record(workload, c, name, rs, reference))
                log(_line(records[-1]))
    for rec in records:  # each arm against the best of the others, in the same run
        if "tok_s" not in rec:
            continue
        peers = [r for r in records if "tok_s" in r and (r["workload"], r["concurrency"]) ==
                 (rec["workload"], rec["concurrency"])]  # fmt: skip
        base = next((r["tok_s"] for r in peers if r["arm"] == "none"), None)
        fixed = [r["tok_s"] for r in peers if r["arm"].startswith("fixed")]
        rec["vs_none"] = rec["tok_s"] / base if base else None
        rec["vs_best_fixed"] = rec["tok_s"] / max(fixed) if fixed else None
        k5 = next((r["tok_s"] for r in peers if r["arm"] == f"fixed-{MAX_K}"), None)
        rec["vs_fixed_5"] = rec["tok_s"] / k5 if k5 else None
    return records


def _record(workload: str, c: int, arm: str, rs: list[dict], reference: list | None) -> dict:
    """One (workload, concurrency, arm) point from its rounds' runs."""
    same = [a == b for run in rs for a, b in zip(run["tokens"], reference or run["tokens"])]
    out = {"workload": workload, "concurrency": c, "arm": arm}
    for key in ("tok_s", "acceptance_length", "verify_budget_per_step", "step_time_error",
                "acceptance_estimate_error", "policy_budget_per_step"):  # fmt: skip
        out[key] = statistics.median(x[key] for x in rs)
    out["tok_s_runs"] = [x["tok_s"] for x in rs]
    for key in ("accepted_by_position", "verified_by_position", "output_tokens", "steps",
                "verify_steps", "guard_blocked_steps", "guard_probe_steps", "explored_steps"):
        out[key] = rs[-1][key]
    out["outputs_equal_none"] = sum(same) / len(same)
    return out


def _line(r: dict) -> str:
    return (f"{r['workload']:>18} c={r['concurrency']:<4} {r['arm']:>9}: "
            f"{r['tok_s']:8.1f} tok/s, acceptance length {r['acceptance_length']:.2f}, "
            f"budget {r['verify_budget_per_step']:.1f}, same as none "
            f"{r['outputs_equal_none']:.0%}, steps {r['steps']} ({r['verify_steps']} "
            f"verifying, guard {r['guard_blocked_steps']} blocked / "
            f"{r['guard_probe_steps']} probes)")  # fmt: skip


def plot(records: list[dict], path: Path, title: str) -> None:
    """tok/s against concurrency, one line per arm, one panel per workload (nothing where
    matplotlib is missing: ``python -m bench.spec_decode --plot RESULTS.json`` later)."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib here: no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in records})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in records if r["workload"] == workload and "tok_s" in r]
        for arm in dict.fromkeys(r["arm"] for r in mine):
            points = sorted((r["concurrency"], r["tok_s"]) for r in mine if r["arm"] == arm)
            style = "k-o" if arm == "dynamic" else ("k--" if arm == "none" else "-.")
            ax.plot(*zip(*points), style, label=arm, alpha=1.0 if arm == "dynamic" else 0.7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("output tok/s")
        ax.set_title(workload)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the CPU tasks ------------------------------------------------------------------------------

CODE = [
    '''def moving_average(x, window):
    """Mean of each run of `window` values of x."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(x):
        total += v
        if i >= window:
            total -= x[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out''',
    """def count_words(x):
    counts = {}
    for line in x.splitlines():
        for word in line.split():
            word = word.strip(".,;:!?").lower()
            if not word:
                continue
            counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return ranked[:10]""",
    """def merge_sorted(x, other):
    i, j, out = 0, 0, []
    while i < len(x) and j < len(other):
        if x[i] <= other[j]:
            out.append(x[i])
            i += 1
        else:
            out.append(other[j])
            j += 1
    out.extend(x[i:])
    out.extend(other[j:])
    return out""",
    """def parse_config(x):
    settings = {}
    for number, line in enumerate(x.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value")
        key, value = line.split("=", 1)
        settings[key.strip()] = value.strip()
    return settings""",
]

PASSAGES = [
    "The ferry leaves the harbour at six in the morning. It crosses the bay in forty "
    "minutes when the sea is calm. On stormy days the crossing can take twice as long. "
    "The captain has worked on the route for twenty years. Passengers often see dolphins "
    "near the northern cape. In winter the first crossing is cancelled when ice forms.",
    "Bread needs only flour, water, salt and yeast. The dough is kneaded until it is "
    "smooth and elastic. It then rises in a warm place for about two hours. After shaping "
    "it rises again, more briefly. A hot oven gives the crust its colour. The loaf must "
    "cool before it is cut, or the crumb turns gummy.",
    "Bees visit thousands of flowers to make a spoonful of honey. They tell each other "
    "where food is with a dance. The queen lays up to two thousand eggs a day. Worker bees "
    "live for a few weeks in summer. In winter the colony huddles together for warmth. "
    "Without bees many crops would not be pollinated.",
    "A violin has four strings tuned in fifths. The bow is strung with horsehair rubbed "
    "with rosin. The body is carved from spruce and maple. Its sound post carries the "
    "vibration from the top to the back. Old instruments are prized for their tone. "
    "Players change strings every few months.",
]


def cpu_workloads(core: EngineCore, max_tokens: int) -> dict[str, Callable[[int], list[Job]]]:
    tok = core.tokenizer

    def chat(text: str) -> list[int]:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True)  # fmt: skip
        return tok.encode(rendered, add_special_tokens=False)

    def code_edit(c: int) -> list[Job]:
        n = max(2, c)
        return [Job(chat("Rename the parameter `x` to `values` in this Python function. "
                         "Reply with the whole function and nothing else.\n\n```python\n"
                         f"{CODE[i % len(CODE)]}\n```"), max_tokens)
                for i in range(n)]  # fmt: skip

    def summarise_and_quote(c: int) -> list[Job]:
        n = max(2, c)
        return [Job(chat("Summarise this passage in one sentence, then quote its first "
                         f"three sentences word for word.\n\n{PASSAGES[i % len(PASSAGES)]}"),
                    max_tokens)
                for i in range(n)]  # fmt: skip

    return {"code edit": code_edit, "summarise and quote": summarise_and_quote}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/spec_decode_cpu.json"))
    ap.add_argument(
        "--plot",
        type=Path,
        metavar="RESULTS",
        help="only draw the PNG of a results JSON (this or the GPU run's)",
    )
    args = ap.parse_args()
    if args.plot:
        result = json.loads(args.plot.read_text())
        plot(result["records"], args.plot.with_suffix(".png"), result.get("title", ""))
        return
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    cores = {}
    for arm in arms("ngram"):
        config = EngineConfig(
            model=args.model, num_threads=args.threads, speculative=arm.speculative,
            cache=CacheConfig(block_size=16, memory_gb=0.25, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=max(concurrencies),
                                      max_num_batched_tokens=2048, max_model_len=2048),
        )  # fmt: skip
        cores[arm.name] = EngineCore(config)
    workloads = cpu_workloads(next(iter(cores.values())), args.max_tokens)
    for core in cores.values():  # warm up: kernels built, caches touched
        run_load(core, workloads["code edit"](1)[:1], 1, "warm")
    records = run_arms({name: (lambda c=core: c) for name, core in cores.items()}, workloads,
                       concurrencies, args.rounds)  # fmt: skip
    title = f"SmolLM2-135M + prompt lookup, CPU ({args.threads} thread)"
    result = {
        **machine_info(),
        "benchmark": "spec_decode_cpu",
        "title": title,
        "model": args.model,
        "drafter": "ngram",
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(records, args.out.with_suffix(".png"), title)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
