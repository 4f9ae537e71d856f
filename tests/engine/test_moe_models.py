"""DeepSeek-V3 and Qwen3-MoE against transformers on the same weights (CPU, float32).

The checkpoints are tiny random ones that transformers writes (``hf_models``): DeepSeek-V3
with a query bottleneck, grouped top-k and YaRN, DeepSeek-V3 without the bottleneck, and
Qwen3-MoE. Metric: ``relative_error`` = max |ours - transformers| / max |transformers|
over all logits of a 40-token prompt; the bound is 1e-4. Prompts run through the paged
cache; single-token steps take the MLA decode path (absorbed projections over the
latent cache), longer ones the prefill path (decompressed keys and values).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import forward_tokens, relative_error
from hf_models import CONFIGS, load_reference
from safetensors.torch import load_file, save_file

from engine.loader import load_model, load_model_config
from engine.loader.hf import INDEX_FILE
from engine.models import build_model

TOLERANCE = 1e-4
PROMPT_LEN = 40

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tiny_moe_dir):
    """(kind, our model, transformers' model), both from the folder transformers wrote."""
    folder = tiny_moe_dir(request.param)
    return request.param, load_model(str(folder), progress=False), load_reference(folder)


def _prompt(vocab_size: int, n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def test_config_parts_are_read_from_the_transformers_config(tiny_moe_dir):
    ds = load_model_config(str(tiny_moe_dir("deepseek-v3")))
    assert ds.architecture == "deepseek_v3" and ds.num_kv_heads == ds.num_heads == 4
    assert (ds.mla.q_lora_rank, ds.mla.kv_lora_rank, ds.mla.latent_dim) == (48, 32, 40)
    assert ds.mla.rope_interleave and ds.head_dim == 24
    assert ds.rope_scaling.kind == "yarn" and ds.rope_scaling.mscale_all_dim == 0.8
    moe = ds.moe
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups) == (16, 4, 4, 2)
    assert moe.scoring == "sigmoid" and moe.score_correction_bias and moe.norm_topk_prob
    assert moe.dense_layers == (0,) and moe.num_shared_experts == 1
    assert moe.routed_scaling_factor == 2.5
    assert ds.num_mtp_layers == 0  # transformers writes num_nextn_predict_layers: 1, no weights
    plain = load_model_config(str(tiny_moe_dir("deepseek-v3-noqlora")))
    assert plain.mla.q_lora_rank is None and not plain.mla.rope_interleave
    assert plain.rope_scaling.kind == "none" and plain.moe.num_groups == 1
    qwen = load_model_config(str(tiny_moe_dir("qwen3-moe")))
    assert qwen.architecture == "qwen3_moe" and qwen.qk_norm and qwen.mla is None
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.dense_layers) == (8, 2, (1,))
    assert qwen.moe.scoring == "softmax" and qwen.moe.norm_topk_prob
    assert qwen.moe.num_shared_experts == 0 and not qwen.moe.score_correction_bias


def test_fingerprints_tell_the_models_apart(tiny_moe_dir):
    prints = {load_model_config(str(tiny_moe_dir(k))).fingerprint for k in CONFIGS}
    assert len(prints) == len(CONFIGS)
    assert "mla32+8" in load_model_config(str(tiny_moe_dir("deepseek-v3"))).fingerprint


def test_logits_match_transformers(pair):
    _, ours, ref = pair
    ids = _prompt(ours.config.vocab_size)
    assert relative_error(forward_tokens(ours.model, ids), reference_logits(ref, ids)) <= TOLERANCE


@pytest.mark.parametrize("chunks", [[1] * 3 + [37], [16, 16, 8], [13, 1, 1, 25]])
def test_chunked_prefill_and_decode_steps_match_transformers(pair, chunks):
    _, ours, ref = pair
    ids = _prompt(ours.config.vocab_size)
    chunked = forward_tokens(ours.model, ids, chunks, block_size=4)
    assert relative_error(chunked, reference_logits(ref, ids)) <= TOLERANCE


def test_decode_steps_alone_match_transformers(pair):
    """Every token a decode step (for MLA: absorbed attention over the latent cache)."""
    _, ours, ref = pair
    ids = _prompt(ours.config.vocab_size, 24)
    stepped = forward_tokens(ours.model, ids, [1] * len(ids), block_size=4)
    assert relative_error(stepped, reference_logits(ref, ids)) <= TOLERANCE


def test_bfloat16_stays_close_to_float32(pair, tiny_moe_dir):
    """Per token, bf16 logits stay within 5% of float32's (max abs difference over the
    largest float32 logit), but for the odd token where bf16 rounding tips a near-tie
    between two experts the other way (transformers' own bf16 run has such tokens too):
    at most 10% of them."""
    kind, ours, _ = pair
    half = load_model(str(tiny_moe_dir(kind)), dtype=torch.bfloat16, progress=False)
    assert half.model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    routers = [m for m in half.model.modules() if getattr(m, "keeps_float32", False)]
    assert routers and all(p.dtype == torch.float32 for m in routers for p in m.parameters())
    ids = _prompt(ours.config.vocab_size)
    full, low = forward_tokens(ours.model, ids), forward_tokens(half.model, ids)
    per_token = (low - full).abs().max(dim=-1).values / full.abs().max()
    assert (per_token <= 5e-2).float().mean() >= 0.9, per_token


def test_mla_cache_holds_one_latent_per_token_and_layer(pair):
    kind, ours, _ = pair
    layout = ours.model.kv_layout(16, torch.float32)
    assert layout.num_layers == 3
    if kind == "qwen3-moe":
        assert [c.shape for c in layout.components] == [(2, 16), (2, 16)]
    else:
        assert [(c.name, c.shape) for c in layout.components] == [("latent", (40,))]


def test_load_weights_rejects_unknown_and_missing_experts(pair):
    kind, ours, _ = pair
    model = build_model(ours.config)
    with pytest.raises(KeyError):
        model.load_weights([("model.layers.2.mlp.experts.99.bogus.weight", torch.zeros(1))])
    folder_weights = [(n, p) for n, p in _hf_weights(pair) if ".experts.3.up_proj" not in n]
    with pytest.raises(ValueError, match="experts.w13"):
        model.load_weights(folder_weights)


def _hf_weights(pair):
    """The reference's tensors under checkpoint names (per-expert, as saved)."""
    _, _, ref = pair
    for name, tensor in ref.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2)
                yield name.replace("gate_up_proj", f"{e}.gate_proj.weight"), gate
                yield name.replace("gate_up_proj", f"{e}.up_proj.weight"), up
        elif name.endswith("experts.down_proj"):
            for e, w in enumerate(tensor):
                yield name.replace("down_proj", f"{e}.down_proj.weight"), w
        else:
            yield name, tensor


# ---- DeepSeek-V3's multi-token prediction layer ------------------------------------------


def _mtp_tensors(config, layer: int) -> dict[str, torch.Tensor]:
    """An MTP layer in DeepSeek's checkpoint format: a transformers decoder layer (MLA +
    MoE) under ``model.layers.<layer>``, plus enorm, hnorm, eh_proj and the shared head."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    torch.manual_seed(7)
    block = DeepseekV3DecoderLayer(config, layer)
    hidden, prefix = config.hidden_size, f"model.layers.{layer}."
    tensors = {}
    for name, t in block.state_dict().items():
        t = torch.randn_like(t) * 0.1  # the layer's own init leaves norms at 1, biases at 0
        if name.endswith("experts.gate_up_proj"):
            for e, w in enumerate(t):
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = w.chunk(2)[0]
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = w.chunk(2)[1]
        elif name.endswith("experts.down_proj"):
            for e, w in enumerate(t):
                tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = w
        else:
            tensors[prefix + name] = t
    for name, shape in [("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                        ("eh_proj.weight", (hidden, 2 * hidden)),
                        ("shared_head.norm.weight", (hidden,)),
                        ("shared_head.head.weight", (config.vocab_size, hidden)),
                        ("embed_tokens.weight", (config.vocab_size, hidden))]:  # fmt: skip
        tensors[prefix + name] = torch.randn(shape)
    return {n: t.contiguous() for n, t in tensors.items()}


def test_mtp_layer_of_a_sharded_checkpoint_loads_into_model_mtp(tiny_moe_dir, tmp_path):
    src = tiny_moe_dir("deepseek-v3")
    ref = load_reference(src)
    folder = tmp_path / "with-mtp"
    shutil.copytree(src, folder)
    main = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    mtp = _mtp_tensors(ref.config, ref.config.num_hidden_layers)
    shards = {"model-00001-of-00002.safetensors": main, "model-00002-of-00002.safetensors": mtp}
    for file, tensors in shards.items():
        save_file(tensors, folder / file)
    weight_map = {n: file for file, tensors in shards.items() for n in tensors}
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    loaded = load_model(str(folder), progress=False)
    assert loaded.config.num_mtp_layers == 1 and len(loaded.model.mtp) == 1
    layer = loaded.model.mtp[0]
    p = "model.layers.3."
    assert torch.equal(layer.enorm.weight, mtp[p + "enorm.weight"])
    assert torch.equal(layer.eh_proj.weight, mtp[p + "eh_proj.weight"])
    assert torch.equal(layer.shared_head["norm"].weight, mtp[p + "shared_head.norm.weight"])
    assert torch.equal(layer.self_attn.kv_b_proj.weight, mtp[p + "self_attn.kv_b_proj.weight"])
    assert torch.equal(layer.mlp.gate.e_score_correction_bias,
                       mtp[p + "mlp.gate.e_score_correction_bias"])  # fmt: skip
    gate, up = mtp[p + "mlp.experts.5.gate_proj.weight"], mtp[p + "mlp.experts.5.up_proj.weight"]
    assert torch.equal(layer.mlp.experts.w13[5], torch.cat((gate, up)))
    assert torch.equal(layer.mlp.experts.w2[5], mtp[p + "mlp.experts.5.down_proj.weight"])
    assert layer.self_attn.layer_idx == 3  # its KV would be one more MLA layer, after the model's
    ids = _prompt(loaded.config.vocab_size)
    logits = forward_tokens(loaded.model, ids)
    assert relative_error(logits, reference_logits(ref, ids)) <= TOLERANCE
