"""Expert-parallel groups of 2 and 4 rank processes over gloo (``ep_ranks``) against one
engine, on tiny random DeepSeek-V3 and Qwen3-MoE checkpoints written by transformers.

Each rank keeps only its share of the routed experts and its own requests (attention
data-parallel); every MoE layer exchanges tokens between all ranks. The work is uneven
on purpose: sequences of different lengths in different chunks, ranks that have nothing
to run in some steps (they run the model over no tokens), requests that arrive at
different rounds and a rank with no request at all. Logits: ``relative_error`` (max |EP -
one engine| / max |one engine|) at most 1e-5 in float32; greedy tokens identical, their
logprobs within 1e-5. A live rebalance (redundant slots, weights moving between ranks
every few steps) changes no token; the ranks record their routing traces.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ep_ranks import run_group
from helpers import forward_tokens, relative_error

from engine.config import CacheConfig, EngineConfig
from engine.core import EngineCore
from engine.ep.eplb import initial_placement
from engine.ep.load import read_group_trace, read_trace
from engine.loader import load_model
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-5
FP8_TOLERANCE = 1e-2  # see the FP8 case's docstring
# each rank's chunks of its one sequence, step by step (None: nothing to run)
CHUNKS = [[10, 1, 1, None, 8], [3, None, 1, 1, 2], [None, None, 1, 1, 11], [None] * 4 + [1]]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chunked(tokens: list[int], sizes: list[int | None]) -> list[list[int] | None]:
    out, at = [], 0
    for n in sizes:
        out.append(None if n is None else tokens[at : at + n])
        at += n or 0
    return out


def _requests(size: int) -> list[list[tuple[int, str, list[int], int]]]:
    """Per rank, (round, id, prompt, max_tokens): rank 2 never gets one."""
    per_rank = [
        [(0, "a", _tokens(30, 1), 12), (0, "b", _tokens(9, 2), 5), (6, "c", _tokens(17, 3), 10)],
        [(3, "d", _tokens(5, 4), 3)],
        [],
        [(9, "e", _tokens(12, 5), 6), (9, "f", _tokens(12, 6), 6)],
    ]  # fmt: skip
    return per_rank[:size]


def _one_engine(folder: str, requests: list[tuple[int, str, list[int], int]],
                quantization: str = "none") -> dict:  # fmt: skip
    """Greedy tokens and logprobs of every request on one engine, all at once."""
    core = EngineCore(EngineConfig(model=folder, num_threads=1, quantization=quantization,
                                   cache=CacheConfig(num_blocks=96, block_size=4)))  # fmt: skip
    for _, rid, prompt, max_tokens in requests:
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                  logprobs=0)  # fmt: skip
        core.add_request(EngineRequest(rid, prompt, sampling))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while core.has_work:
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.logprobs)
    return {"tokens": tokens, "logprobs": logprobs}


def _run(folder: str, size: int, tmp_path, ep: dict | None = None,
         quantization: str = "none") -> list[dict]:  # fmt: skip
    requests = _requests(size)
    last = max(at for rank in requests for at, *_ in rank)
    per_rank = [{"requests": r, "chunks": _chunked(_tokens(20, 10 + i), CHUNKS[i][:5])}
                for i, r in enumerate(requests)]  # fmt: skip
    return run_group(size, "engine_outputs", tmp_path, per_rank, folder=str(folder),
                     last_arrival=last, ep=ep or {}, quantization=quantization)  # fmt: skip


@pytest.mark.parametrize(("kind", "size", "quantization"), [
    ("deepseek-v3", 2, "none"), ("deepseek-v3", 4, "none"), ("qwen3-moe", 2, "none"),
    ("qwen3-moe", 4, "none"), ("deepseek-v3", 2, "fp8"),
])  # fmt: skip
def test_ranks_give_the_logits_and_greedy_tokens_of_one_engine(kind, size, quantization,
                                                               tiny_moe_dir, tmp_path):  # fmt: skip
    """With FP8 experts (the float32 function of the FP8 kernels, rows quantized alone) a
    rank's experts see other batches than one engine's, whose float32 sums can differ in
    the last bit and so, rarely, round an activation to the neighbouring e4m3 value: the
    logits' bound is FP8_TOLERANCE there."""
    folder = tiny_moe_dir(kind)
    results = _run(folder, size, tmp_path, quantization=quantization)
    reference = load_model(str(folder), progress=False, quantization=quantization).model
    bound = TOLERANCE if quantization == "none" else FP8_TOLERANCE
    for rank, result in enumerate(results):
        sizes = [n for n in CHUNKS[rank] if n]
        tokens = _tokens(20, 10 + rank)[: sum(sizes)]
        expected = forward_tokens(reference, tokens, sizes)
        assert relative_error(result["logits"], expected) <= bound, rank
    alone = _one_engine(str(folder), [r for rank in _requests(size) for r in rank],
                        quantization)  # fmt: skip
    for rank, result in enumerate(results):
        for rid, tokens in result["tokens"].items():
            assert tokens == alone["tokens"][rid], (rank, rid)
            np.testing.assert_allclose(result["logprobs"][rid], alone["logprobs"][rid],
                                       atol=bound, rtol=0)  # fmt: skip
    assert sorted(rid for r in results for rid in r["tokens"]) == sorted(alone["tokens"])
    assert all(r["idle_forwards"] > 0 for r in results[1:])  # ranks stepped with nothing
    assert len({r["steps"] for r in results}) == 1  # in lockstep


@pytest.fixture(scope="module")
def rebalanced(tiny_moe_dir, tmp_path_factory):
    """A 4-rank DeepSeek-V3 group with one redundant slot per rank, rebalancing every 3
    steps over a 5-step window, recording its routing traces."""
    tmp = tmp_path_factory.mktemp("ep-rebalance")
    ep = {"redundant_experts": 4, "eplb_interval": 3, "eplb_window": 5,
          "routing_trace": str(tmp / "trace")}  # fmt: skip
    folder = tiny_moe_dir("deepseek-v3")
    return folder, _run(folder, 4, tmp, ep), tmp / "trace"


def test_a_live_rebalance_moves_experts_without_changing_greedy_tokens(rebalanced):
    folder, results, _ = rebalanced
    alone = _one_engine(str(folder), [r for rank in _requests(4) for r in rank])
    for result in results:
        for rid, tokens in result["tokens"].items():
            assert tokens == alone["tokens"][rid], rid
    assert all(r["rebalances"] > 0 for r in results)
    placements = {str(r["placement"]) for r in results}
    assert len(placements) == 1  # every rank switched to the same placement
    moe_layers = len(results[0]["placement"])
    assert results[0]["placement"] != initial_placement(moe_layers, 16, 4, 20).tolist()


def test_each_rank_records_its_routing_trace(rebalanced):
    folder, results, trace = rebalanced
    files = sorted(trace.glob("*.rtrace"))
    assert len(files) == 4
    header, counts = read_trace(files[0])
    assert (header["layers"], header["experts"], header["ranks"]) == (2, 16, 4)
    assert header["moe_layers"] == [1, 2]
    assert len(counts) == results[0]["steps"]
    _, group = read_group_trace(files)
    # every token a rank ran was routed to top-4 experts in each MoE layer
    routed = group.sum(axis=(0, 2))
    assert routed[0] == routed[1] > 0 and routed[0] % 4 == 0
