"""Speculative decoding across prefill/decode disaggregation: the real prefill and decode
roles in one process over the real tcp transport. The decode worker drafts; greedy
outputs equal the aggregated engine's without speculation, for every drafter. With MTP the
prefill worker runs the MTP layer over the prompt without drafting, and its latents reach
the decode worker in the request's blocks: the decode worker's MTP KV of the prompt is
the aggregated engine's.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import SUCCESSOR

import decode.worker as decode_worker
from decode.messages import DecodeRequest, KVReady, KVWanted
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core import EngineCore
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams
from engine.worker.config import TransferConfig, WorkerConfig
from prefill.messages import PrefillDone, PrefillRequest
from prefill.worker import PrefillWorker

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SECRET = "test-cluster-secret"
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[40, 41, 42, 43, 44] * 5, [3 + (i * 7) % 200 for i in range(21)], [9, 8, 9, 8, 9, 8]]


def config(model: str, **spec) -> EngineConfig:
    speculative = SpeculativeConfig(num_speculative_tokens=3, **spec) if spec else None
    return EngineConfig(
        model=model, num_threads=1, cache=CacheConfig(num_blocks=160, block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        **({"speculative": speculative} if speculative else {}),
    )  # fmt: skip


def run_local(core: EngineCore, prompt: list[int], rid: str) -> list[int]:
    core.add_request(EngineRequest(rid, prompt, GREEDY))
    tokens = []
    while core.has_work:
        tokens += [t for o in core.step() for t in o.new_token_ids]
    return tokens


def run_pd(prefill: PrefillWorker, decode, prompt: list[int], rid: str) -> list[int]:
    decode.handle(DecodeRequest(EngineRequest(rid, prompt, GREEDY)))
    want = next(m for m, _ in decode.step().replies if isinstance(m, KVWanted))
    prefill.handle(PrefillRequest(EngineRequest(rid, prompt, GREEDY), want.destination))
    done = None
    while done is None:
        done = next((m for m, _ in prefill.step().replies if isinstance(m, PrefillDone)), None)
    decode.handle(KVReady(done.output))
    tokens = list(done.output.new_token_ids)
    while True:
        outs = decode.step().outputs
        tokens += [t for o in outs for t in o.new_token_ids]
        if any(o.finish_reason for o in outs):
            return tokens


def roles(cfg: EngineConfig):
    transfer = TransferConfig("tcp", timeout_s=30, local_prefill_tokens=0)
    d = decode_worker.DecodeWorker(WorkerConfig("decode", cfg, transfer), SECRET)
    p = PrefillWorker(WorkerConfig("prefill", cfg, TransferConfig("tcp", 30)), SECRET)
    return p, d


@pytest.mark.parametrize("name", ["ngram", "draft", "mtp", "mtp-kept"])
def test_greedy_through_1p_1d_with_drafts_equals_aggregated_without(name, tiny_moe_dir):
    """``mtp-kept``: a successor machine's MTP layer (``hf_models.make_successor``), whose
    drafts the decode worker mostly keeps, from the prompt's MTP KV the prefill worker
    wrote on (fixed schedule: every draft is verified)."""
    kind = {"mtp": "deepseek-v3-mtp", "mtp-kept": SUCCESSOR}.get(name, "llama")
    model = str(tiny_moe_dir(kind))
    fields = {"ngram": dict(method="ngram"), "draft": dict(method="draft", draft_model=model),
              "mtp": dict(method="mtp"),
              "mtp-kept": dict(method="mtp", schedule="fixed")}[name]  # fmt: skip
    plain = EngineCore(config(model))
    expected = [run_local(plain, p, f"ref{i}") for i, p in enumerate(PROMPTS)]
    prefill, decode = roles(config(model, **fields))
    try:
        got = [run_pd(prefill, decode, p, f"r{i}") for i, p in enumerate(PROMPTS)]
        assert got == expected
        stats = decode.core.scheduler.stats()
        assert sum(stats.spec_draft_verified) > 0  # the decode worker drafted
        if name == "mtp-kept":
            assert sum(stats.spec_draft_accepted) > 0.75 * sum(stats.spec_draft_verified)
        assert sum(prefill.core.scheduler.stats().spec_draft_verified) == 0
        for worker in (prefill, decode):
            worker.core.check_integrity()
    finally:
        prefill.close()
        decode.close()


def test_mtp_latents_of_the_prompt_reach_the_decode_worker(tiny_moe_dir):
    model = str(tiny_moe_dir("deepseek-v3-mtp"))
    cfg = config(model, method="mtp")
    aggregated = EngineCore(cfg)
    prefill, decode = roles(cfg)
    try:
        prompt = PROMPTS[1]
        aggregated.add_request(EngineRequest("a", prompt, GREEDY))
        aggregated.step()  # the prompt, its first token, the MTP pass over the prompt
        run_pd(prefill, decode, prompt, "d")  # to the end: the blocks stay cached on D
        layer = aggregated.model_config.num_layers  # the MTP layer's KV sits after the model's
        assert aggregated.kv_cache.layout.num_layers == layer + 1
        n = len(prompt)

        def latents(core: EngineCore, blocks: list[int]) -> torch.Tensor:
            rows = core.kv_cache.layers[layer][blocks].flatten(0, 1)
            return rows[:n]

        agg_blocks = [b.block_id for b in aggregated.scheduler.requests["a"].blocks]
        d_blocks = [b.block_id for b in decode.core.kv.pool.lookup(
            aggregated.scheduler.requests["a"].full_block_hashes(4, n))]  # fmt: skip
        full = len(d_blocks) * 4
        assert full >= 16  # the prompt's full blocks are cached on D
        mine = latents(decode.core, d_blocks)[:full]
        theirs = latents(aggregated, agg_blocks)[:full]
        assert mine.abs().sum() > 0
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    finally:
        prefill.close()
        decode.close()
