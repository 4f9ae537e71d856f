"""The Llama-family model against transformers on the same weights (CPU, float32).

Metric: ``relative_error`` = max |ours - transformers| / max |transformers| over all
logits of a multi-token prompt; the bound is 1e-4.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import forward_tokens, greedy_generate, hf_named_weights, relative_error

from engine.config import RopeScaling
from engine.loader import LoadedModel, load_model
from engine.models import build_model
from engine.models.llama import rope_inv_freq

TOLERANCE = 1e-4
PROMPT_LEN = 40

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def smollm2_reference(default_gguf_path: Path) -> torch.nn.Module:
    """transformers' model loaded from the same GGUF file."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def chat_prompt_ids(smollm2: LoadedModel) -> list[int]:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    return smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(messages))


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def test_smollm2_gguf_logits_match_transformers(smollm2, smollm2_reference, chat_prompt_ids):
    ours = forward_tokens(smollm2.model, chat_prompt_ids)
    assert ours.dtype == torch.float32
    ref = reference_logits(smollm2_reference, chat_prompt_ids)
    assert relative_error(ours, ref) <= TOLERANCE


def test_smollm2_greedy_answer_is_paris(smollm2, chat_prompt_ids):
    out = greedy_generate(smollm2.model, chat_prompt_ids, 12, smollm2.config.eos_token_ids)
    assert smollm2.tokenizer.decode(out) == "The capital of France is Paris."
    assert out[-1] == 2


def test_smollm2_chunked_prefill_matches_one_shot(smollm2, chat_prompt_ids):
    one_shot = forward_tokens(smollm2.model, chat_prompt_ids)
    n = len(chat_prompt_ids)
    chunked = forward_tokens(smollm2.model, chat_prompt_ids, [13, 1, n - 14])
    assert relative_error(chunked[-1], one_shot[-1]) <= 1e-5


# ---- tiny random configs built with transformers -------------------------------------

_TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def _llama3_config():
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaConfig(**_TINY, head_dim=16, rope_parameters=rope, tie_word_embeddings=False)


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(**_TINY, rope_theta=1000000.0, tie_word_embeddings=False)


def _qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(**_TINY, head_dim=32, tie_word_embeddings=True)


TINY_CONFIGS = {"llama3": _llama3_config, "qwen2": _qwen2_config, "qwen3": _qwen3_config}


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny_pair(request, tmp_path_factory) -> tuple[str, LoadedModel, torch.nn.Module]:
    """(kind, our model from the saved HF folder, transformers' model)."""
    from transformers import AutoModelForCausalLM

    kind = request.param
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(TINY_CONFIGS[kind](), dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from 1 so their weights matter
        for name, param in ref.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp(f"tiny-{kind}")
    ref.save_pretrained(folder, safe_serialization=True)
    ours = load_model(str(folder), device="cpu", dtype=torch.float32, progress=False)
    return kind, ours, ref


def _prompt(vocab_size: int, n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


def test_tiny_config_switches_are_read(tiny_pair):
    kind, ours, _ = tiny_pair
    cfg = ours.config
    assert cfg.rope_scaling.kind == ("llama3" if kind == "llama3" else "none")
    assert cfg.attention_bias == (kind == "qwen2")
    assert cfg.qk_norm == (kind == "qwen3")
    assert cfg.tie_word_embeddings == (kind == "qwen3")


def test_tiny_logits_match_transformers(tiny_pair):
    _, ours, ref = tiny_pair
    ids = _prompt(ours.config.vocab_size)
    assert relative_error(forward_tokens(ours.model, ids), reference_logits(ref, ids)) <= TOLERANCE


@pytest.mark.parametrize("chunks", [[1] * 3 + [37], [16, 16, 8], [5, 1, 1, 33]])
def test_tiny_chunked_prefill_matches_one_shot(tiny_pair, chunks):
    _, ours, _ = tiny_pair
    ids = _prompt(ours.config.vocab_size)
    one_shot = forward_tokens(ours.model, ids, block_size=4)
    chunked = forward_tokens(ours.model, ids, chunks, block_size=4)
    assert relative_error(chunked, one_shot) <= 1e-5


def test_tiny_bfloat16_stays_close_to_float32(tiny_pair):
    _, ours, _ = tiny_pair
    model16 = build_model(ours.config, "cpu", torch.bfloat16)
    model16.load_weights((n, p) for n, p in hf_named_weights(ours.model))
    ids = _prompt(ours.config.vocab_size)
    logits16 = forward_tokens(model16, ids)
    assert logits16.dtype == torch.float32
    assert relative_error(logits16, forward_tokens(ours.model, ids)) <= 5e-2


def test_load_weights_rejects_unknown_and_missing_weights(tiny_pair):
    _, ours, _ = tiny_pair
    model = build_model(ours.config)
    with pytest.raises(KeyError):
        model.load_weights([("model.layers.0.bogus.weight", torch.zeros(1))])
    weights = [(n, p) for n, p in hf_named_weights(ours.model) if "down_proj" not in n]
    with pytest.raises(ValueError, match="down_proj"):
        model.load_weights(weights)


def test_gguf_rope_freq_factors_reproduce_llama3_scaling(tiny_pair):
    """llama.cpp stores llama3 scaling as per-frequency divisors (``rope_freqs``)."""
    kind, ours, _ = tiny_pair
    if kind != "llama3":
        pytest.skip("llama3 scaling only")
    cfg = ours.config
    plain = build_model(dataclasses.replace(cfg, rope_scaling=RopeScaling()))
    factors = rope_inv_freq(cfg.head_dim, cfg.rope_theta, RopeScaling()) / rope_inv_freq(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    )
    assert not torch.allclose(factors, torch.ones_like(factors))
    plain.load_weights([*hf_named_weights(ours.model), ("model.rotary_emb.freq_factors", factors)])
    ids = _prompt(cfg.vocab_size)
    assert relative_error(forward_tokens(plain, ids), forward_tokens(ours.model, ids)) <= 1e-6


def test_kv_layout_matches_config(smollm2):
    layout = smollm2.model.kv_layout(16, torch.float32)
    assert layout.num_layers == 30
    assert [c.shape for c in layout.components] == [(3, 64), (3, 64)]
