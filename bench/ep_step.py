"""Decode step time of expert-parallel groups, and the share of it spent in the
dispatcher (the MoE layers' dispatch and combine).

    python -m bench.ep_step [--device cpu] [--ranks 1,2,4] [--model dummy:deepseek-v3-tiny]
    python -m bench.ep_step --device cuda --model dummy:deepseek-v3-4l --batches 1,64 \
        --trace DIR --out FILE

CPU (gloo): first EP 1 in one process, the plain engine and the one-rank dispatcher
stepped in turn (``interleaved_ep1``: the fair comparison on a machine others share).
Then for each group size N, N rank processes (this module, ``--rank``), each an
``EngineCore`` holding its share of the experts, with ``--batch`` decode sequences of
``--context`` tokens of its own; the ranks step in lockstep (``ExpertGroup.round``) and
each times ``--steps`` decode steps and, inside them, every ``dispatch`` and ``combine``.
EP 1 is the plain engine (``one_engine``) and the same engine through the one-rank
dispatcher (``local``). Reported per N: the median step time over the ranks' steps (the
slowest rank's, a step being collective), tokens per second of the group, and the
dispatcher's share of the step — which for N > 1 includes waiting in the all-to-all for
the slowest rank (on 2 cores, N processes share them).

CUDA (one GPU): EP 1 only. First each engine's first MoE layer, as the engine holds it,
is checked against the torch reference (``moe_experts_sorted``) on random tokens. Then at
each ``--batches`` batch size, the median decode step replayed from CUDA graphs: the plain
engine against the same model through the one-rank dispatcher (``local``: its overhead
when it has nothing to send); both again eagerly; and eagerly the all-to-all dispatcher
over a one-rank NCCL group (``all_to_all_eager``: counts read back, sends to itself). The
greedy tokens of the timed steps are compared with the plain engine's (a fraction of
requests whose tokens are identical: bf16 sums in another order may flip a near tie).
Last, the dispatched engine records a routing trace of ``--trace-steps`` steps at the
largest batch (``--trace``), which ``bench.eplb_replay`` replays.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine_info, wall_times


class TimedDispatcher:
    """A dispatcher whose ``dispatch`` and ``combine`` are timed (host clock; on CUDA each
    call is synchronised first and after, so only use it where that is the point)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.capturable = False  # timing reads the clock on the host
        self.seconds = 0.0

    def _timed(self, fn, *args):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
        sync()
        started = time.perf_counter()
        out = fn(*args)
        sync()
        self.seconds += time.perf_counter() - started
        return out

    def dispatch(self, hidden, slots, weights):
        return self._timed(self.inner.dispatch, hidden, slots, weights)

    def combine(self, out, handle):
        return self._timed(self.inner.combine, out, handle)


NEW_TOKENS = 256  # each request's room to decode: more than any run's steps


def _engine(model: str, device: str, dtype: str, batch: int, context: int, group=None,
            eager: bool = False):  # fmt: skip
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.core import EngineCore

    block = 16 if device == "cpu" else 128
    length = context + NEW_TOKENS
    blocks = batch * -(-length // block) + 1
    config = EngineConfig(
        model=model, device=device, dtype=dtype, num_threads=1 if device == "cpu" else 0,
        enforce_eager=eager, cache=CacheConfig(block_size=block, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=8192,
                                  max_model_len=length),
    )  # fmt: skip
    return EngineCore(config, experts=group.experts if group is not None else None)


def _fill(core, batch: int, context: int) -> None:
    """``batch`` requests of ``context`` prompt tokens, prefilled: what is left is decode."""
    from engine.messages import EngineRequest
    from engine.sampling_params import SamplingParams

    vocab = core.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(0, min(vocab, 256), (context,), generator=g).tolist()
        sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS - 1, ignore_eos=True)
        refused = core.add_request(EngineRequest(f"r{i}", prompt, sampling))
        if refused is not None:
            raise ValueError(refused.error)


def _stepper(core, group):
    """One step: the group's round, or the engine's own step."""
    return (lambda: group.round(core, False)) if group is not None else core.step


def _prefill(core, group) -> None:
    """Step until every prompt is computed (untimed): what follows is decode."""
    step = _stepper(core, group)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in core.scheduler.requests.values()):  # fmt: skip
        step()


def rank_main(args) -> None:
    """One rank of a CPU group (``--rank``): its step times and dispatcher seconds."""
    from engine.config import ExpertParallelConfig
    from engine.ep.group import ExpertGroup
    from engine.worker.config import GroupMember

    torch.set_num_threads(1)
    member = None
    if args.size > 1 or args.mode == "local":
        member = GroupMember("bench", args.rank, args.size, args.rendezvous)
    if args.mode == "one_engine":
        core, group = _engine(args.model, "cpu", "float32", args.batch, args.context), None
    else:
        group = ExpertGroup(member if args.size > 1 else None, ExpertParallelConfig(), "cpu")
        core = _engine(args.model, "cpu", "float32", args.batch, args.context, group)
        group.experts.dispatcher = timed = TimedDispatcher(group.experts.dispatcher)
    _fill(core, args.batch, args.context)
    _prefill(core, group)
    if group is not None:
        timed.seconds = 0.0
    times = wall_times(_stepper(core, group), args.steps, warmup=3)
    out = {"times": times, "dispatcher_s": timed.seconds if group else 0.0}
    Path(args.out).write_text(json.dumps(out))


def _group_run(args, size: int, mode: str, tmp: Path) -> dict:
    """Run ``size`` ranks of ``mode``; the group's figures."""
    rendezvous = tmp / f"rendezvous-{size}-{mode}"
    outs = [tmp / f"{mode}-{size}-{r}.json" for r in range(size)]
    procs = [subprocess.Popen([sys.executable, "-m", "bench.ep_step", "--rank", str(r),
                               "--size", str(size), "--mode", mode, "--rendezvous",
                               str(rendezvous), "--out", str(outs[r]), "--model", args.model,
                               "--batch", str(args.batch), "--context", str(args.context),
                               "--steps", str(args.steps)])
             for r in range(size)]  # fmt: skip
    if any(p.wait() != 0 for p in procs):
        raise RuntimeError(f"a rank of EP {size} ({mode}) failed")
    ranks = [json.loads(o.read_text()) for o in outs]
    per_step = [max(step) for step in zip(*(r["times"] for r in ranks))]  # collective
    step = statistics.median(per_step)
    total = sum(per_step)
    share = max(r["dispatcher_s"] for r in ranks) / total if total else 0.0
    return {"ranks": size, "mode": mode, "step_ms": step * 1e3,
            "tokens_per_s": size * args.batch / step, "dispatch_combine_share": share,
            "dispatch_combine_ms_per_step": share * step * 1e3}  # fmt: skip


def interleaved_ep1(args) -> dict:
    """EP 1 in this process: the plain engine and the same model through the one-rank
    dispatcher (``ExpertGroup.round``), stepped in turn, so that both see the same machine
    (on a shared one, processes run apart see different loads)."""
    from engine.config import ExpertParallelConfig
    from engine.ep.group import ExpertGroup

    torch.set_num_threads(1)
    plain = _engine(args.model, "cpu", "float32", args.batch, args.context)
    group = ExpertGroup(None, ExpertParallelConfig(), "cpu")
    dispatched = _engine(args.model, "cpu", "float32", args.batch, args.context, group)
    group.experts.dispatcher = timed = TimedDispatcher(group.experts.dispatcher)
    steps = {"one_engine": _stepper(plain, None), "local": _stepper(dispatched, group)}
    for core, g in ((plain, None), (dispatched, group)):
        _fill(core, args.batch, args.context)
        _prefill(core, g)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.steps + 3):
        for name, step in steps.items():
            if name == "local" and i == 3:
                timed.seconds = 0.0
            started = time.perf_counter()
            step()
            if i >= 3:  # after the warm-up
                times[name].append(time.perf_counter() - started)
    runs = []
    for name, t in times.items():
        step = statistics.median(t)
        share = timed.seconds / sum(t) if name == "local" else 0.0
        runs.append({"ranks": 1, "mode": name, "step_ms": step * 1e3,
                     "tokens_per_s": args.batch / step, "dispatch_combine_share": share,
                     "dispatch_combine_ms_per_step": share * step * 1e3,
                     "process": "interleaved"})  # fmt: skip
    group.close()
    return runs


def cpu_main(args) -> dict:
    """EP 1 interleaved in this process (``interleaved_ep1``), then for each group size the
    same engine as a group of rank processes; EP 1 is also run as one rank process (the
    same process set-up as the groups' ranks)."""
    runs = interleaved_ep1(args)
    with tempfile.TemporaryDirectory(prefix="ferry-ep-bench-") as tmp:
        runs.append({**_group_run(args, 1, "one_engine", Path(tmp)), "process": "rank"})
        for size in args.ranks:
            mode = "local" if size == 1 else "all_to_all"
            runs.append({**_group_run(args, size, mode, Path(tmp)), "process": "rank"})
    base = runs[0]["step_ms"]
    rank_base = runs[2]["step_ms"]
    for run in runs:
        run["step_vs_one_engine"] = run["step_ms"] / base
        if run["process"] == "rank":
            run["step_vs_one_engine_rank"] = run["step_ms"] / rank_base
    return {"runs": runs}


def _check_layer(core) -> dict:
    """The first MoE layer's experts module (as the engine holds it) on 64 random tokens
    against the torch reference ``moe_experts_sorted`` over the same weights."""
    from engine.models.moe import MoE, moe_experts_sorted

    moe = next(layer.mlp for layer in core.runner.model.model.layers
               if isinstance(layer.mlp, MoE))  # fmt: skip
    experts, cfg = moe.experts, core.model_config.moe
    w13, w2 = experts.w13, experts.w2
    g = torch.Generator(device=w13.device).manual_seed(1)
    hidden = torch.randn(64, w13.shape[2], device=w13.device, dtype=w13.dtype, generator=g)
    scores = torch.rand(64, cfg.num_experts, device=w13.device, generator=g)
    weights, ids = scores.topk(cfg.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = experts(hidden, ids, weights).float()
    ref = moe_experts_sorted(hidden, ids, weights, w13, w2).float()
    error = ((out - ref).norm() / ref.norm()).item()
    return {"module": type(experts).__name__, "relative_error": error, "ok": error < 2e-2}


def _timed_batches(core, group, batches: list[int], context: int, steps: int) -> dict:
    """Per batch size: the median decode step and the tokens the timed steps produced."""
    out = {}
    for batch in batches:
        _fill(core, batch, context)
        _prefill(core, group)
        tokens: dict[str, list[int]] = {}
        step = _stepper(core, group)

        def collect(step=step, tokens=tokens) -> None:
            for o in step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

        times = wall_times(collect, steps, warmup=3)
        out[batch] = {"step_ms": statistics.median(times) * 1e3, "tokens": tokens}
        core.abort(list(core.scheduler.requests))
        while core.has_work:  # the aborts land
            step()
    return out


def _arm(name: str, run, errors: dict):
    try:
        return run()
    except Exception as exc:  # one arm's failure is reported, the others still run
        errors[name] = f"{type(exc).__name__}: {exc}"
        print(f"{name} failed: {errors[name]}", flush=True)
        return None


def one_device_main(args, save) -> dict:
    """EP 1 on one GPU (module docstring): two engines of the one model, the plain one and
    the one through the dispatcher; each runs graphed, then eagerly (its graphs set aside);
    the second then swaps in the all-to-all dispatcher over a one-rank NCCL group, and
    last records a routing trace at the largest batch. ``--one-device`` runs it on the
    CPU (float32, gloo, no graphs) to try it out."""
    from engine.config import ExpertParallelConfig
    from engine.ep.comm import join
    from engine.ep.dispatcher import AllToAllDispatcher
    from engine.ep.group import ExpertGroup

    device = args.device
    dtype, backend = ("float32", "gloo") if device == "cpu" else ("bfloat16", "nccl")
    batch = max(args.batches)
    errors: dict[str, str] = {}
    runs: dict[str, dict] = {}
    checks: dict[str, dict] = {}

    def measure(core, group, label: str) -> None:
        graphs = core.runner.graphs
        runs[label] = _timed_batches(core, group, args.batches, args.context, args.steps)
        core.runner.graphs = None
        runs[f"{label}_eager"] = _timed_batches(core, group, args.batches, args.context,
                                                args.steps)  # fmt: skip
        core.runner.graphs = graphs

    def plain() -> None:
        core = _engine(args.model, device, dtype, batch, args.context)
        checks["one_engine"] = _check_layer(core)
        measure(core, None, "one_engine")
        del core

    _arm("one_engine", plain, errors)
    save({"checks": checks, "errors": errors})
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()

    def dispatched() -> None:
        group = ExpertGroup(None, ExpertParallelConfig(), device, "ep1")
        core = _engine(args.model, device, dtype, batch, args.context, group)
        checks["local"] = _check_layer(core)
        measure(core, group, "local")

        def all_to_all() -> None:  # the same engine, its tokens sent to itself by NCCL
            rendezvous = tempfile.mktemp(prefix="ferry-ep-rdv-")
            comm = join(rendezvous, "bench", 0, 1, backend, "127.0.0.1", 60.0, 60.0)
            local = group.experts.dispatcher
            group.experts.dispatcher = AllToAllDispatcher(comm, group.experts.slots_per_rank)
            checks["all_to_all"] = _check_layer(core)
            graphs, core.runner.graphs = core.runner.graphs, None
            runs["all_to_all_eager"] = _timed_batches(core, group, args.batches, args.context,
                                                      args.steps)  # fmt: skip
            core.runner.graphs, group.experts.dispatcher = graphs, local

        _arm("all_to_all", all_to_all, errors)
        if args.trace:
            trace = Path(args.trace) / "ep1.rtrace"
            group.experts.load.record(trace, {"rank": 0, "ranks": 1,
                                              "moe_layers": group.experts.moe_layers})
            _timed_batches(core, group, [batch], args.context, args.trace_steps)
            group.experts.load.close()
        group.close()

    _arm("local", dispatched, errors)
    save({"checks": checks, "errors": errors})
    points = {}
    for b in args.batches:
        point = {name: {"step_ms": run[b]["step_ms"]} for name, run in runs.items()}
        for name, base in (("local", "one_engine"), ("local_eager", "one_engine_eager"),
                           ("all_to_all_eager", "one_engine_eager")):  # fmt: skip
            if name in runs and base in runs:
                point[f"{name}_vs_{base}"] = runs[name][b]["step_ms"] / runs[base][b]["step_ms"]
                same = [t == runs[base][b]["tokens"].get(r)
                        for r, t in runs[name][b]["tokens"].items()]  # fmt: skip
                point[f"{name}_tokens_as_{base}"] = sum(same) / max(len(same), 1)
        points[f"b{b}"] = point
        print(b, json.dumps(point), flush=True)
    return {"checks": checks, "points": points, "errors": errors,
            "trace": args.trace or None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="dummy:deepseek-v3-tiny")
    parser.add_argument("--ranks", default="1,2,4", help="CPU: group sizes")
    parser.add_argument("--batch", type=int, default=8, help="CPU: sequences per rank")
    parser.add_argument("--batches", default="1,64", help="CUDA: batch sizes")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help=f"below {NEW_TOKENS - 10}")
    parser.add_argument("--trace", default="", help="CUDA: routing-trace directory")
    parser.add_argument("--trace-steps", type=int, default=200,
                        help=f"CUDA: steps the trace records (below {NEW_TOKENS - 10})")
    parser.add_argument("--one-device", action="store_true",
                        help="the one-GPU comparison (the default on CUDA) on this device")
    parser.add_argument("--commit", help="commit to record (default: git's)")
    parser.add_argument("--out", default="")
    # one rank of a CPU group (what this module runs itself as)
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank >= 0:
        rank_main(args)
        return
    args.ranks = [int(n) for n in args.ranks.split(",")]
    args.batches = [int(n) for n in args.batches.split(",")]
    started = time.time()
    one = args.one_device or args.device != "cpu"
    info = machine_info()
    if args.commit:
        info["commit"] = args.commit
    settings = {k: getattr(args, k) for k in ("model", "batch", "context", "steps")}
    settings["batches" if one else "ranks"] = args.batches if one else args.ranks
    out = Path(args.out or f"bench/results/ep_step_{args.device}{'_one' if one else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(results: dict) -> None:  # after every arm too: a run cut short keeps those
        record = {"benchmark": "ep_step", **info, "device": args.device, "settings": settings,
                  "seconds": time.time() - started, **results}  # fmt: skip
        out.write_text(json.dumps(record, indent=2) + "\n")

    results = one_device_main(args, save) if one else cpu_main(args)
    save(results)
    print(json.dumps(results, indent=2))

if __name__ == "__main__":
    main()
