"""Expert-parallel groups of real processes for the tests.

``run_group(size, fn, workdir, per_rank, **shared)`` starts ``size`` Python processes, each
one rank of a gloo group that meets through a ``FileStore`` in ``workdir``, runs
``fn(member, **shared, **per_rank[rank])`` there (``fn``: the name of a function of this
module) and returns what each rank's call returned, in rank order. A rank that fails
fails the call, with its output, and the others are killed.

The rank functions:

- ``engine_outputs``: a model's float32 logits over one sequence per rank, fed in chunks,
  with ``None`` steps in which the rank has nothing (it runs the model over no tokens);
  then the greedy tokens and their logprobs of requests given to each rank's
  ``EngineCore`` at given rounds, stepped in lockstep by ``ExpertGroup.round``.
- ``dispatch_roundtrip``: the all-to-all dispatcher's contract on random pairs.
- ``weight_moves``: a rank's expert weights after placements change.
- ``peer_dies``: what a rank sees when its peer exits mid-collective.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_group(size: int, fn: str, workdir: Path, per_rank: list[dict] | None = None,
              timeout: float = 300.0, **shared: Any) -> list[Any]:  # fmt: skip
    import torch

    rendezvous = workdir / f"rendezvous-{uuid.uuid4().hex[:8]}"
    per_rank = per_rank or [{}] * size
    procs, outs = [], []
    for rank in range(size):
        out = workdir / f"{fn}-{rank}-{uuid.uuid4().hex[:6]}.pt"
        spec = {"fn": fn, "rank": rank, "size": size, "rendezvous": str(rendezvous),
                "out": str(out), "kwargs": {**shared, **per_rank[rank]}}  # fmt: skip
        log = (workdir / f"{out.stem}.log").open("wb")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
        procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(spec)], stdout=log,
                                      stderr=subprocess.STDOUT, cwd=ROOT, env=env))
        outs.append(out)
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                logs = "\n".join((workdir / f"{o.stem}.log").read_text()[-3000:] for o in outs)
                raise RuntimeError(f"ranks {failed or 'timed out'}:\n{logs}")
            time.sleep(0.05)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            logs = "\n".join((workdir / f"{o.stem}.log").read_text()[-3000:] for o in outs)
            raise RuntimeError(f"ranks {failed} failed:\n{logs}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [torch.load(o, weights_only=False) if o.exists() else None for o in outs]


def _group(member, **ep: Any):
    from engine.config import ExpertParallelConfig
    from engine.ep.group import ExpertGroup

    return ExpertGroup(member, ExpertParallelConfig(**ep), "cpu", f"rank{member.rank}")


def _lockstep_logits(model, chunks: list[list[int] | None]) -> Any:
    """Logits [tokens, vocab] of one sequence fed chunk by chunk through ``model`` (its
    experts a rank's); at a ``None`` step the rank runs the model over no tokens."""
    import torch
    from helpers import SequenceRunner

    from engine.attention.base import AttentionMetadata, ForwardContext

    runner = SequenceRunner(model, max(1, sum(len(c) for c in chunks if c)))
    none = torch.zeros(0, dtype=torch.long)
    outputs = []
    with torch.no_grad():
        for chunk in chunks:
            if chunk is None:
                model(none, none, ForwardContext(AttentionMetadata.empty("cpu"), runner.backend))
            else:
                outputs.append(runner.step(chunk))
    return torch.cat(outputs) if outputs else torch.zeros(0)


def engine_outputs(member, folder: str, requests: list[tuple[int, str, list[int], int]],
                   last_arrival: int, ep: dict | None = None,
                   chunks: list[list[int] | None] | None = None,
                   quantization: str = "none") -> dict:  # fmt: skip
    """Greedy outputs of ``requests`` ((round, id, prompt, max_tokens): each added at that
    round) on this rank's engine, stepped in lockstep with the group until every rank is
    done after ``last_arrival`` (the last round any rank adds a request); first, with
    ``chunks``, the logits of one sequence fed in those chunks (every rank the same number
    of them). Returns ``{"tokens": {id: [...]}, "logprobs": {id: [...]}, "logits": ...,
    "rebalances": n, "placement": [[...]], "idle_forwards": n}``."""
    from engine.config import CacheConfig, EngineConfig
    from engine.core import EngineCore
    from engine.messages import EngineRequest
    from engine.sampling_params import SamplingParams

    group = _group(member, **(ep or {}))
    config = EngineConfig(model=folder, num_threads=1, quantization=quantization,
                          cache=CacheConfig(num_blocks=96, block_size=4))  # fmt: skip
    core = EngineCore(config, experts=group.experts)
    logits = _lockstep_logits(core.runner.model, chunks) if chunks else None
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    idle = 0
    for round_ in range(10_000):
        for at, rid, prompt, max_tokens in requests:
            if at == round_:
                sampling = SamplingParams(temperature=0, max_tokens=max_tokens,
                                          ignore_eos=True, logprobs=0)  # fmt: skip
                core.add_request(EngineRequest(rid, prompt, sampling))
        forwards_before, had_work = core.runner.num_forwards, core.has_work
        for out in group.round(core, leaving=False):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(
                lp.logprob for lp in out.logprobs or [])
        idle += core.runner.num_forwards > forwards_before and not had_work
        if round_ >= last_arrival and not group.busy:
            break
    result = {"tokens": tokens, "logprobs": logprobs, "logits": logits,
              "rebalances": group.experts.rebalances, "steps": group.steps,
              "placement": group.experts.phy2log.tolist(), "idle_forwards": idle}  # fmt: skip
    group.close()
    return result


def dispatch_roundtrip(member, tokens: list[int], slots_per_rank: int = 2, top_k: int = 3,
                       hidden: int = 8) -> dict:  # fmt: skip
    """Random pairs (``tokens[r]`` tokens on rank r) through ``AllToAllDispatcher``, each
    received row computed as ``x * (local slot + 1) * weight``; returns what this rank
    received (the (source rank, token) of each row, from the hidden state's first two
    columns) and the largest error of ``combine`` against the same sum computed locally."""
    import torch

    from engine.ep.comm import join
    from engine.ep.dispatcher import AllToAllDispatcher

    comm = join(member.rendezvous, "test", member.rank, member.size, "gloo", member.host,
                30.0, 60.0)  # fmt: skip
    mine = tokens[member.rank]
    g = torch.Generator().manual_seed(member.rank)
    x = torch.randn(mine, hidden, generator=g)
    x[:, 0], x[:, 1] = member.rank, torch.arange(mine)
    slots = torch.randint(0, slots_per_rank * member.size, (mine, top_k), generator=g)
    weights = torch.rand(mine, top_k, generator=g)
    dispatcher = AllToAllDispatcher(comm, slots_per_rank)
    got = dispatcher.dispatch(x, slots, weights)
    out = got.hidden * (got.slots[:, None] + 1) * got.weights[:, None]
    combined = dispatcher.combine(out, got.handle)
    local = (slots % slots_per_rank + 1).float() * weights  # [T, K]
    expected = x * local.sum(dim=1, keepdim=True)
    return {"sources": got.hidden[:, :2].long().tolist(), "slots": got.slots.tolist(),
            "error": float((combined - expected).abs().max()) if mine else 0.0,
            "shape": list(combined.shape)}  # fmt: skip


def weight_moves(member, model: str, redundant: int, seeds: list[int],
                 quantization: str = "none") -> list[bool]:  # fmt: skip
    """For each seed, a placement from random counts applied to this rank's experts; after
    each, whether every local slot holds exactly the weights of the expert it should (all
    of its tensors: FP8 experts' scales too)."""
    import numpy as np
    import torch

    from engine.ep import eplb
    from engine.loader import load_model
    from engine.models.moe import MoE

    group = _group(member, redundant_experts=redundant)
    full = load_model(model, progress=False, quantization=quantization).model
    layers = [layer.mlp for layer in full.model.layers if isinstance(layer.mlp, MoE)]
    weights = [[t.clone() for t in m.experts.stacked()] for m in layers]
    ep = group.experts
    ep.attach(full)
    results = []
    for seed in seeds:
        load = np.random.default_rng(seed).zipf(1.5, (len(layers), ep.num_experts)).astype(float)
        ep.apply(eplb.rebalance(load, ep.size, ep.num_slots))
        ok = True
        for index, layer in enumerate(ep.layers):
            local = torch.from_numpy(ep._local(ep.phy2log[index]))
            for got, full_tensor in zip(layer.local.stacked(), weights[index], strict=True):
                expected = full_tensor.index_select(0, local)  # bytes: FP8 has no == here
                ok &= got.dtype == expected.dtype and torch.equal(
                    got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))
        results.append(ok)
    group.close()
    return results


def peer_dies(member, after_rounds: int) -> dict:
    """Rank 1 exits after ``after_rounds`` rounds of all-reduces; rank 0 goes on and
    reports how long its next collective took to fail, and with what."""
    import os
    import time

    import torch

    from engine.ep.comm import GroupFailed

    group = _group(member)
    for _ in range(after_rounds):
        group.control.all_reduce(torch.zeros(2))
    if member.rank == 1:
        os._exit(0)
    started = time.monotonic()
    try:
        group.control.all_reduce(torch.zeros(2))
        group.control.all_reduce(torch.zeros(2))
    except GroupFailed as exc:
        return {"seconds": time.monotonic() - started, "error": str(exc)}
    return {"seconds": None, "error": None}


def _main(spec: dict) -> None:
    import torch

    from engine.worker.config import GroupMember

    torch.set_num_threads(1)
    member = GroupMember("test", spec["rank"], spec["size"], spec["rendezvous"])
    result = globals()[spec["fn"]](member, **spec["kwargs"])
    torch.save(result, spec["out"])


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
