"""Tiny random DeepSeek-V3 and Qwen3-MoE checkpoints written by transformers itself.

Each kind is a transformers config at toy width that still exercises the parts that
matter: ``deepseek-v3`` has a query bottleneck (``q_lora_rank``), grouped top-k (4 groups
of 4 experts, 2 kept), YaRN with an attention factor and a softmax mscale, and a
correction bias large enough to change which experts are chosen; ``deepseek-v3-noqlora``
projects queries directly, routes without groups and pairs its rotary dims as halves
(``rope_interleave`` false); ``qwen3-moe`` has a dense layer between MoE layers and
renormalised softmax routing. ``write_tiny_model`` saves one with ``save_pretrained``,
so its ``config.json`` and tensor names are exactly what transformers writes (which
includes ``num_nextn_predict_layers: 1`` with no MTP weights).

Weights are transformers' random init at ``initializer_range`` 0.1 (logits far enough
apart that greedy decoding does not hinge on rounding), norms in [0.5, 1.5] so their
weights matter. ``deepseek-v3-mtp-successor`` is the one kind with weights rewritten
after that: a successor machine (``make_successor``) whose MTP drafts are mostly kept.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 260  # the byte tokenizer's ids exactly: one token, one byte string

_DEEPSEEK = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=16, num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, routed_scaling_factor=2.5,
    max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.1,
    bos_token_id=256, eos_token_id=257,
)  # fmt: skip


def _deepseek_v3():
    from transformers import DeepseekV3Config

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
            "original_max_position_embeddings": 256}  # fmt: skip
    return DeepseekV3Config(**_DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2,
                            rope_parameters=rope)  # fmt: skip


def _deepseek_v3_no_q_lora():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**_DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1,
                            rope_interleave=False)  # fmt: skip


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
        max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=257,
    )  # fmt: skip


def _llama():
    """A dense Llama whose next-token distributions are peaked (about 2 nats, the ten most
    likely tokens holding ~0.93), so that sampling statistics can tell distributions apart."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.5, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257,
    )  # fmt: skip


CONFIGS = {
    "deepseek-v3": _deepseek_v3,
    "deepseek-v3-noqlora": _deepseek_v3_no_q_lora,
    "qwen3-moe": _qwen3_moe,
}
# kinds the MoE tests do not sweep: a dense Llama (speculative decoding's target and draft
# model), and DeepSeek-V3 with the multi-token prediction layer transformers leaves out,
# random or a successor machine (``make_successor``)
OTHER_CONFIGS = {"llama": _llama, "deepseek-v3-mtp": _deepseek_v3,
                 "deepseek-v3-mtp-successor": _deepseek_v3}  # fmt: skip
SUCCESSOR = "deepseek-v3-mtp-successor"

# the successor machine (``make_successor``): the scale of every projection that writes
# into the residual stream; the output head's scale; the MTP layer's ``eh_proj`` on the
# previous hidden state, the norm of what it adds as a fraction of the token's part
QUIET, HEAD_SCALE, MTP_HIDDEN_MIX = 0.05, 0.15, 1.5


def quiet_residual_writers(weights) -> None:
    """Scale, in place, by ``QUIET`` every projection of ``weights`` (name, tensor pairs)
    that adds to the residual stream: attention's ``o_proj``, the MLPs', experts' and
    shared experts' ``down_proj`` (transformers' fused experts or a checkpoint's own)."""
    for name, tensor in weights:
        if name.removesuffix(".weight").endswith(("o_proj", "down_proj")):
            tensor.mul_(QUIET)


def make_successor(model: torch.nn.Module) -> None:
    """Rewrite a DeepSeek-V3 reference into a successor machine: the token after ``x`` is
    ``x + 1`` (mod the vocabulary). Embeddings are redrawn at std 1, every layer's writes
    into the residual stream are scaled down (``quiet_residual_writers``: they still
    matter, a little), so the final hidden state is about the current token's embedding;
    head row ``v`` is ``HEAD_SCALE`` times the embedding of ``v - 1``. At width 64 a
    token's embedding is far closer to itself than to any other's: the successor's logit
    is about 10, the others' about 0 give or take 1.2, so greedy decoding continues x + 1,
    x + 2, ... from any prompt."""
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.normal_()
        model.lm_head.weight.copy_(HEAD_SCALE * embed.roll(1, 0))
        quiet_residual_writers(model.named_parameters())


def tiny_reference(kind: str, seed: int = 0) -> torch.nn.Module:
    """transformers' model of ``kind`` with random weights (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = {**CONFIGS, **OTHER_CONFIGS}[kind]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # sigmoid scores sit near 0.5
                buffer.uniform_(-0.2, 0.2)
    if kind == SUCCESSOR:
        make_successor(model)
    return model


def write_tiny_model(kind: str, folder: Path, seed: int = 0) -> Path:
    """Save the ``kind`` reference into ``folder`` with ``save_pretrained`` (for
    ``deepseek-v3-mtp`` and its successor machine, then add an MTP layer:
    ``add_mtp_layer``)."""
    tiny_reference(kind, seed).save_pretrained(folder)
    if kind.startswith("deepseek-v3-mtp"):
        add_mtp_layer(folder, seed, successor=kind == SUCCESSOR)
    return folder


def add_mtp_layer(folder: Path, seed: int = 0, successor: bool = False) -> None:
    """Write DeepSeek-V3's multi-token prediction layer (checkpoint layer
    ``num_hidden_layers``) into ``folder`` as ``mtp.safetensors``: a decoder layer copied
    from the last one with noise added to its matrices (so that loading the wrong layer
    shows), random ``eh_proj``, norms in [0.5, 1.5]. Its drafts are poor; what runs is the
    real layer.

    ``successor`` (the folder holds ``make_successor``'s model): the layer's writes into
    the residual stream are quiet too and ``eh_proj`` is ``[I, B]``, ``B`` random (what it
    adds is ``MTP_HIDDEN_MIX`` times the token's part in norm): its output is about the
    next token's embedding plus noise that the previous hidden state sets, so it predicts
    the token after that, as the model does, mostly (about one draft in seven is
    rejected), with confidences well short of 1 that move with the hidden state (a wrong
    one shows)."""
    import json

    from safetensors.torch import load_file, save_file

    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    weights = load_file(str(folder / "model.safetensors"))
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    g = torch.Generator().manual_seed(seed + 1)
    out = {mtp + n[len(last) :]: t + 0.05 * torch.randn(t.shape, generator=g) * (t.dim() > 1)
           for n, t in weights.items() if n.startswith(last)}  # fmt: skip
    hidden = weights["model.norm.weight"].shape[0]
    for name in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{mtp}{name}.weight"] = torch.rand(hidden, generator=g) + 0.5
    out[f"{mtp}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    if successor:
        quiet_residual_writers(out.items())
        mix = torch.randn(hidden, hidden, generator=g) * MTP_HIDDEN_MIX / hidden**0.5
        out[f"{mtp}eh_proj.weight"] = torch.cat((torch.eye(hidden), mix), 1)
    save_file(out, str(folder / "mtp.safetensors"))


def load_reference(folder: Path) -> torch.nn.Module:
    """transformers' model read back from a folder (float32, eval)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ---- a tiny Qwen2.5-VL folder: model, tokenizer, chat template, image processor --------------

VL_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
              "<|image_pad|>", "<|video_pad|>")  # ids 256.. in this order (bytes are 0-255)
VL_IDS = {name: 256 + i for i, name in enumerate(VL_SPECIAL)}
VL_IMAGE_TOKEN = VL_IDS["<|image_pad|>"]
# small enough for the CPU: an image is resized to at most 8 x 8 merged squares (64 tokens)
VL_PROCESSOR = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64}


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(vocab_size=256 + len(VL_SPECIAL), hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=2048, initializer_range=0.1, rope_parameters=rope,
                bos_token_id=None, eos_token_id=VL_IDS["<|im_end|>"], tie_word_embeddings=False)
    # a window of 2 x 2 merged squares: images split into several windows, some partial
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                  out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
                  initializer_range=0.1)
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=VL_IMAGE_TOKEN,
        video_token_id=VL_IDS["<|video_pad|>"], vision_start_token_id=VL_IDS["<|vision_start|>"],
        vision_end_token_id=VL_IDS["<|vision_end|>"], tie_word_embeddings=False,
    )  # fmt: skip


def vl_reference(seed: int = 0) -> torch.nn.Module:
    """transformers' Qwen2.5-VL with random weights (norms in [0.5, 1.5])."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(_qwen2_5_vl()).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = None  # EOS is just a token: compare whole runs
    return model


def write_tiny_vlm(folder: Path, seed: int = 0) -> Path:
    """A Qwen2.5-VL folder as a real checkpoint has it: the weights (``save_pretrained``),
    a byte-level ``tokenizer.json`` with Qwen's special tokens, Qwen2.5-VL's chat template
    and transformers' image processor settings (``preprocessor_config.json``)."""
    import json

    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from engine.tokenizer import QWEN2_VL_CHAT_TEMPLATE, bytes_to_unicode

    vl_reference(seed).save_pretrained(folder)
    spelling = bytes_to_unicode()
    backend = HFTokenizer(models.BPE(vocab={spelling[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in VL_SPECIAL])  # fmt: skip
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    ))  # fmt: skip
    (folder / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE)
    Qwen2VLImageProcessorPil(**VL_PROCESSOR).save_pretrained(folder)
    return folder


def random_image(seed: int, width: int, height: int, fmt: str = "PNG") -> bytes:
    """An image file of random pixels."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()
