"""Prompt lookup drafting on the device (``engine.spec.ngram``): every proposal the
engine makes is the continuation of the longest suffix's most recent earlier occurrence,
as the definition reads on the host, serially and with the step after a verify step
planned before its outcome (the drafter's token table then fills from the tokens on the
device); greedy outputs stay those without speculation."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.engine.drafting import generate_recorded
from tests.engine.test_spec_generation import GREEDY, engine, prompts, reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=K, schedule="fixed")


def lookup(tokens: list[int], k: int, ngram_min: int = 1, ngram_max: int = 4) -> list[int]:
    """The definition: the longest suffix of ``ngram_min`` .. ``ngram_max`` tokens found
    ending before the last token, its most recent occurrence, and up to ``k`` tokens after."""
    length = len(tokens)
    for n in range(min(ngram_max, length), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def run_checked(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[list, int]:
    """``llm``'s outputs of ``batch``, after checking each proposal it made against
    ``lookup``; and how many steps were planned while a step verifying drafts ran."""
    run = generate_recorded(llm, batch, params)
    for rid, proposal in run.proposals:
        tokens = run.sequences[rid]
        room = len(tokens) - proposal.start - 1  # all kept, and the token after them
        assert proposal.token_ids == lookup(tokens[: proposal.start], min(K, room)), rid
    assert len(run.proposals) >= 10
    return run.outputs, run.early


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_prompt_lookup_proposes_the_most_recent_longest_match(overlap, tiny_moe_dir):
    llama = str(tiny_moe_dir("llama"))
    llm = engine(llama, NGRAM, overlap_scheduling=overlap)
    outputs, early = run_checked(llm, prompts(), GREEDY)
    assert outputs == reference(llama)
    assert (early > 5) == overlap


def test_prompt_lookup_drafts_quoting_text_are_kept(smollm2_tokenizer, default_gguf_path):
    """The default model asked to repeat a passage: many of its drafts are the passage's
    next tokens and are kept, with steps planned before the verify step before them; the
    outputs are those without speculation."""
    text = ("def area(width, height):\n    return width * height\n\n"
            "def perimeter(width, height):\n    return 2 * (width + height)\n")  # fmt: skip
    chat = smollm2_tokenizer.encode(smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this code exactly:\n{text}"}]
    ))
    params = SamplingParams(temperature=0.0, max_tokens=60)

    def served(speculative: SpeculativeConfig, overlap: bool) -> LLM:
        return LLM(EngineConfig(model=str(default_gguf_path), num_threads=1,
                                cache=CacheConfig(block_size=16, num_blocks=64),
                                speculative=speculative, overlap_scheduling=overlap))  # fmt: skip

    plain = [r.token_ids for r in served(SpeculativeConfig(), False).generate([chat], params)]
    llm = served(NGRAM, True)
    outputs, early = run_checked(llm, [chat], params)
    assert outputs == plain
    stats = llm.core.scheduler.stats()
    assert sum(stats.spec_draft_accepted) >= 0.3 * sum(stats.spec_draft_verified) > 15
    assert early > 5
