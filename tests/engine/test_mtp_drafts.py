"""The MTP drafter's drafts and confidences against DeepSeek-V3's multi-token prediction
computed independently, with transformers' own decoder layer: the first draft after a
prompt and the chained ones after it. Two checkpoints: a random MTP layer, whose drafts
are all rejected (each pass overwrites the KV its chain wrote), and a successor machine's
(``hf_models.make_successor``), whose drafts are mostly kept: their KV stays, and the
next proposal starts past them from the target's hidden states of the kept drafts'
rows, with and without overlap scheduling.

The reference follows DeepSeek-V3's definition: at position i the layer takes
``eh_proj([enorm(embed(t[i+1])); hnorm(h[i])])``, where ``h`` is the main model's final
(normed) hidden state, runs one decoder layer over those inputs (causal, positions as the
main model's), and predicts ``t[i+2]`` through ``shared_head.norm`` and the main model's
head. A chained draft feeds the layer its own previous output instead of ``h`` and the
draft before instead of the real token. Rerunning the layer over the whole sequence is
what a KV cache does step by step, so the reference needs none.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import SUCCESSOR, load_reference
from safetensors.torch import load_file

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3
PROMPTS = [[100 + (i * 37) % 150 for i in range(21)], [65, 66, 67, 68, 69, 70, 71]]
# the successor machine's drafts after these are all kept but for a few after [0, 1, 2, 3]
SUCCESSOR_PROMPTS = [*PROMPTS, [0, 1, 2, 3]]


class ReferenceMTP:
    """DeepSeek-V3's MTP layer of a checkpoint folder, on transformers' modules."""

    def __init__(self, folder) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        self.main = load_reference(folder)
        config = self.main.config
        config._attn_implementation = "eager"
        index = config.num_hidden_layers
        weights = load_file(str(folder / "mtp.safetensors"))
        prefix = f"model.layers.{index}."
        mine = {n[len(prefix) :]: t for n, t in weights.items() if n.startswith(prefix)}
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=index).eval()
        experts = range(config.n_routed_experts)
        mine["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
            (mine.pop(f"mlp.experts.{e}.gate_proj.weight"),
             mine.pop(f"mlp.experts.{e}.up_proj.weight"))) for e in experts])  # fmt: skip
        mine["mlp.experts.down_proj"] = torch.stack(
            [mine.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts]
        )
        own = set(self.layer.state_dict())
        self.layer.load_state_dict({n: t for n, t in mine.items() if n in own}, strict=True)
        hidden = config.hidden_size
        self.enorm, self.hnorm, self.head_norm = (
            DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps) for _ in range(3)
        )
        self.enorm.weight.data = mine["enorm.weight"]
        self.hnorm.weight.data = mine["hnorm.weight"]
        self.head_norm.weight.data = mine["shared_head.norm.weight"]
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.eh_proj.weight.data = mine["eh_proj.weight"]

    @torch.no_grad()
    def drafts(self, prompt: list[int], k: int) -> tuple[list[int], list[float]]:
        """The main model's greedy token after ``prompt``, then ``k`` chained drafts after
        it with each one's probability (temperature 1)."""
        ids = torch.tensor([prompt])
        h = self.main.model(input_ids=ids).last_hidden_state[0]  # final norm applied
        first = int(self.main.lm_head(h[-1]).argmax())
        inputs = self._inputs([*prompt[1:], first], h)  # position i: t[i+1] and h[i]
        tokens, confidences = [], []
        for _ in range(k):
            out = self._layer(inputs)
            probs = torch.softmax(self.main.lm_head(self.head_norm(out[-1])), -1)
            token = int(probs.argmax())
            tokens.append(token)
            confidences.append(float(probs[token]))
            inputs = torch.cat((inputs, self._inputs([token], out[-1:])))
        return tokens, confidences

    def _inputs(self, next_tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        embed = self.main.model.embed_tokens(torch.tensor(next_tokens))
        return self.eh_proj(torch.cat((self.enorm(embed), self.hnorm(hidden)), -1))

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        positions = torch.arange(n)[None]
        cos_sin = self.main.model.rotary_emb(x[None], positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        return self.layer(x[None], attention_mask=mask, position_ids=positions,
                          position_embeddings=cos_sin)[0]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tiny_moe_dir):
    return tiny_moe_dir("deepseek-v3-mtp")


@pytest.fixture(scope="module")
def successor(tiny_moe_dir):
    return tiny_moe_dir(SUCCESSOR)


def proposals(
    folder, prompts: list[list[int]], max_tokens: int, overlap: bool = False,
    padded: bool = False,
) -> list[tuple[list, list]]:  # fmt: skip
    """Per prompt (one at a time, K drafts, fixed schedule): prompt + output, and every
    proposal the engine's MTP drafter made for it, the first right after the prefill, the
    next ones after each verify step. ``padded``: the drafter's one-token rows go through
    its graphs' padded buffers (run eagerly: ``engine.spec.graphs``)."""
    llm = LLM(EngineConfig(
        model=str(folder), num_threads=1, cache=CacheConfig(block_size=4, num_blocks=200),
        scheduler=SchedulerConfig(max_num_batched_tokens=64), overlap_scheduling=overlap,
        speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=K,
                                      schedule="fixed"),
    ))  # fmt: skip
    runner = llm.core.runner
    if padded:
        runner.drafter.capture_graphs(4, 256, capture=False)  # 1, 2, 4 rows
    finish, seen = runner.finish, []

    def recorded(launched):
        result = finish(launched)
        seen.extend(result.proposals.values())
        return result

    runner.finish = recorded
    out = []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        seen.clear()
        [result] = llm.generate([prompt], params)
        out.append((prompt + result.token_ids, list(seen)))
    llm.core.check_integrity()
    return out


def kept(proposal, tokens: list[int]) -> int:
    """How many of ``proposal``'s leading drafts the output holds."""
    n = 0
    for j, token in enumerate(proposal.token_ids):
        if proposal.start + j >= len(tokens) or tokens[proposal.start + j] != token:
            break
        n += 1
    return n


def assert_as_defined(reference: ReferenceMTP, tokens: list[int], made: list) -> None:
    """Every proposal is the reference's after the sequence up to its first draft's
    token."""
    for proposal in made:
        drafts, confidences = reference.drafts(tokens[: proposal.start - 1], K)
        n = len(proposal.token_ids)
        assert proposal.token_ids == drafts[:n]
        assert proposal.confidence == pytest.approx(confidences[:n], rel=1e-4, abs=1e-6)


def test_mtp_drafts_and_confidences_match_deepseeks_definition(folder):
    reference = ReferenceMTP(folder)
    for tokens, made in proposals(folder, PROMPTS, max_tokens=2 * K + 2):
        assert [p.start for p in made[:2]] == [len(tokens) - 2 * K - 1, len(tokens) - 2 * K]
        assert len(made) >= 3
        assert not any(kept(p, tokens) for p in made)  # each verify step yields one token
        assert_as_defined(reference, tokens, made)


@pytest.mark.parametrize(
    ("overlap", "padded"), [(False, False), (True, False), (False, True), (True, True)],
    ids=["serial", "overlap", "padded-rows", "overlap-padded-rows"],
)  # fmt: skip
def test_mtp_drafts_after_kept_drafts_match_deepseeks_definition(successor, overlap, padded):
    """With most drafts kept, each next proposal starts right past the kept ones (every
    proposal is verified whole: fixed schedule, one request) and is still the reference's:
    the layer's KV of the kept drafts and the hidden states it starts from are the
    target's. Under overlap a proposal one step old is verified after the unresolved
    token, so it is checked against the reference only. Through the padded rows of the
    drafter's graphs the same holds (the verify step's four rows fill a bucket of 4, the
    chain's one a bucket of 1: the null block takes the padding's KV)."""
    reference = ReferenceMTP(successor)
    runs = proposals(successor, SUCCESSOR_PROMPTS, max_tokens=4 * K + 4, overlap=overlap,
                     padded=padded)  # fmt: skip
    for tokens, made in runs:
        assert made[0].start == len(tokens) - 4 * K - 3  # right after the prefill's token
        counts = [kept(p, tokens) for p in made]
        assert sum(counts) > 0.5 * sum(len(p.token_ids) for p in made)
        if not overlap:
            for before, after, n in zip(made, made[1:], counts):
                assert after.start == before.start + n + 1
        assert_as_defined(reference, tokens, made)
