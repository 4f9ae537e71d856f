"""DeepSeek's FP8 block-quantized checkpoints load, dequantized, into the serving dtype.

The test quantizes a tiny random DeepSeek-V3 (written by transformers) itself, the way
DeepSeek's checkpoints are: every linear weight of the decoder layers as
``float8_e4m3fn`` with one float32 ``weight_scale_inv`` per 128 x 128 block (amax / 448),
the rest left as it was. Its widths (192 hidden, 320 dense and 160 expert intermediate,
a 144 latent, a 136 query bottleneck) leave partial blocks on both axes, and each block
of the original weights has its own magnitude (x 2^-3 .. 2^3), so a scale applied to
the wrong block shows.

Expected errors: loading must reproduce the test's own dequantization exactly; on those
dequantized weights, our logits match transformers' within the usual 1e-4; against the
unquantized original they differ by e4m3's rounding (3 mantissa bits: each weight off by
up to 1/16 of itself, more for weights far below their block's largest). Per token (max
logit difference over the largest original logit) the test bounds the median at 0.1
(measured 0.06) and the worst at 0.3 (measured 0.22: the rounding moved a token's hidden
state enough to change one of its experts). Served in bfloat16, both checkpoints add
bfloat16's rounding (7 mantissa bits: 1/256 of a value at most, small beside e4m3's 1/16;
each against itself in float32, a median of 0.01 and a worst of 0.07), so the same bounds
hold between them (measured 0.065 and 0.22).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import forward_tokens, relative_error
from hf_models import load_reference
from safetensors.torch import load_file, save_file

from engine.loader import load_model
from engine.loader.fp8 import dequantize_fp8

BLOCK = 128
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=320, hidden_size=192, intermediate_size=320, moe_intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=144, q_lora_rank=136, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=256, initializer_range=0.05,
        num_nextn_predict_layers=0,
    )  # fmt: skip


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight") and tensor.dim() == 2


def _blocks(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // BLOCK), -(-cols // BLOCK)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale per block) with ``weight ~ q * scale``."""
    rows, cols = weight.shape
    br, bc = _blocks(rows, cols)
    padded = torch.zeros(br * BLOCK, bc * BLOCK)
    padded[:rows, :cols] = weight
    tiles = padded.view(br, BLOCK, bc, BLOCK)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).view(br * BLOCK, bc * BLOCK)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The test's own inverse, element by element."""
    rows, cols = q.shape
    i = torch.arange(rows)[:, None] // BLOCK
    j = torch.arange(cols)[None, :] // BLOCK
    return q.float() * scale[i, j]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The original (unquantized), FP8 and dequantized checkpoints, and the FP8 tensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif _is_quantized(name, param):
                magnitude = 2.0 ** torch.randint(-3, 4, _blocks(*param.shape), generator=g)
                param.mul_(magnitude.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
                           [: param.shape[0], : param.shape[1]])  # fmt: skip
    root = tmp_path_factory.mktemp("fp8")
    original = root / "original"
    model.save_pretrained(original)
    tensors = load_file(original / "model.safetensors")
    fp8, dequantized = dict(tensors), dict(tensors)
    for name, tensor in tensors.items():
        if _is_quantized(name, tensor):
            q, scale = quantize(tensor)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize(q, scale)
    for folder, weights, quantization in [(root / "fp8", fp8, QUANTIZATION),
                                          (root / "dequantized", dequantized, None)]:  # fmt: skip
        folder.mkdir()
        shutil.copy(original / "config.json", folder / "config.json")
        config = json.loads((folder / "config.json").read_text())
        if quantization:
            config["quantization_config"] = quantization
        (folder / "config.json").write_text(json.dumps(config))
        save_file(weights, folder / "model.safetensors")
    return {"original": original, "fp8": root / "fp8", "dequantized": root / "dequantized",
            "tensors": fp8}  # fmt: skip


def _prompt() -> list[int]:
    return torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(2)).tolist()


def test_fp8_checkpoint_loads_exactly_the_blockwise_dequantized_weights(folders):
    ours = load_model(str(folders["fp8"]), progress=False).model
    fp8 = folders["tensors"]
    n = "model.layers.1.self_attn.kv_b_proj.weight"
    assert fp8[n].dtype == torch.float8_e4m3fn and fp8[n + "_scale_inv"].shape == (2, 2)
    assert torch.equal(ours.model.layers[1].self_attn.kv_b_proj.weight,
                       dequantize(fp8[n], fp8[n + "_scale_inv"]))  # fmt: skip
    p = "model.layers.1.mlp.experts.3."
    gate, up = (dequantize(fp8[p + f"{w}.weight"], fp8[p + f"{w}.weight_scale_inv"])
                for w in ("gate_proj", "up_proj"))  # fmt: skip
    assert torch.equal(ours.model.layers[1].mlp.experts.w13[3], torch.cat((gate, up)))
    assert torch.equal(ours.model.embed_tokens.weight, fp8["model.embed_tokens.weight"])


def test_fp8_logits_match_transformers_on_the_dequantized_weights(folders):
    ours = load_model(str(folders["fp8"]), progress=False).model
    ref = load_reference(folders["dequantized"])
    ids = _prompt()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert relative_error(forward_tokens(ours, ids), expected) <= 1e-4


def _logits(folder, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return forward_tokens(load_model(str(folder), dtype=dtype, progress=False).model, _prompt())


def _per_token_error(got: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Each token's largest logit difference over the largest original logit."""
    return (got - original).abs().max(dim=-1).values / original.abs().max()


def test_fp8_logits_stay_within_quantization_error_of_the_original(folders):
    per_token = _per_token_error(_logits(folders["fp8"]), _logits(folders["original"]))
    assert per_token.min() > 1e-3  # the rounding shows: these are not the original weights
    assert per_token.median() <= 0.1, per_token  # measured 0.06
    assert per_token.max() <= 0.3, per_token  # measured 0.22, a token whose experts change


def test_fp8_checkpoint_serves_in_bfloat16_within_quantization_error_of_the_original(folders):
    ours = load_model(str(folders["fp8"]), dtype=torch.bfloat16, progress=False).model
    assert ours.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    fp8 = forward_tokens(ours, _prompt())
    per_token = _per_token_error(fp8, _logits(folders["original"], torch.bfloat16))
    assert per_token.median() <= 0.1, per_token  # measured 0.065
    assert per_token.max() <= 0.3, per_token  # measured 0.22


def test_a_weight_without_its_scale_is_refused():
    q, _ = quantize(torch.randn(4, 4))
    with pytest.raises(ValueError, match="x.weight"):
        list(dequantize_fp8([("x.weight", q), ("y.bias", torch.zeros(2))], (BLOCK, BLOCK)))
    q, scale = quantize(torch.randn(300, 130))
    got = dict(dequantize_fp8([("a.weight_scale_inv", scale), ("a.weight", q)], (BLOCK, BLOCK)))
    assert torch.equal(got["a.weight"], dequantize(q, scale))  # the scale may come first


def test_other_quantization_schemes_are_refused(folders, tmp_path):
    folder = tmp_path / "awq"
    shutil.copytree(folders["original"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="awq"):
        load_model(str(folder), progress=False)
