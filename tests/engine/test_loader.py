"""Weight loading: GGUF parsing and dequantization, q/k permutation, names, dummy presets."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import forward_tokens, hf_named_weights

from engine.config import ModelConfig
from engine.loader import (
    default_model_path,
    describe,
    load_model,
    load_model_config,
    load_tokenizer,
    model_aliases,
    model_name,
)
from engine.loader.dummy import PRESETS
from engine.loader.gguf import (
    GGUFFile,
    hf_tensor_name,
    permute_qk,
    read_gguf_metadata,
    unpermute_qk,
)
from engine.models import build_model
from engine.tokenizer import ByteTokenizer, bytes_to_unicode

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
# Worst-case error of a quantized value relative to the tensor's max |x| (block scales).
QUANT_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1}


def add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: Q) -> None:
    """Store a float array (torch order) quantized as ``qtype``."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == Q.F32:
        writer.add_tensor(name, array)
    elif qtype == Q.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        data = gguf.quants.quantize(array, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)


def write_gguf(path: Path, arch: str, kv: dict, tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_array(key, value)
    for name, (array, qtype) in tensors.items():
        add_tensor(writer, name, array, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """A GGUF holding one 2-D tensor per type (plus a 1-D and a 3-D F32 tensor)."""
    rng = np.random.default_rng(0)
    originals = {f"t_{q.name}": rng.standard_normal((6, 64)).astype(np.float32) for q in QTYPES}
    originals["vec"] = rng.standard_normal(10).astype(np.float32)
    originals["cube"] = rng.standard_normal((2, 3, 4)).astype(np.float32)
    tensors = {name: (arr, Q[name[2:]] if name.startswith("t_") else Q.F32)
               for name, arr in originals.items()}  # fmt: skip
    kv = {"general.name": "quant test", "test.u32": 7, "test.f32": 0.5, "test.flag": True,
          "test.strings": ["a", "ü", "日本"], "test.ints": [1, 2, 3]}  # fmt: skip
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "quant.gguf", "llama", kv, tensors)
    return path, originals


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_gguf_dequantizes_each_type_like_the_gguf_package(quant_file, qtype):
    path, originals = quant_file
    file = GGUFFile(path)
    ours = file.dequantize(f"t_{qtype.name}")
    original = originals[f"t_{qtype.name}"]
    assert ours.shape == original.shape and ours.dtype == np.float32
    expected = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype)
    np.testing.assert_array_equal(ours, expected)
    fast = file.dequantize_torch(f"t_{qtype.name}")
    assert fast.dtype == torch.float32
    np.testing.assert_array_equal(fast.numpy(), expected)
    err = np.abs(ours - original).max() / np.abs(original).max()
    assert err <= QUANT_TOLERANCE[qtype]


def test_torch_dequantization_is_exact_on_the_default_model(default_gguf_path):
    file = GGUFFile(default_gguf_path)
    qtypes = {}
    for name, info in file.tensors.items():
        qtypes.setdefault(info.qtype, name)
    assert {Q.Q4_1, Q.Q8_0, Q.F32} <= set(qtypes)
    for name in qtypes.values():
        np.testing.assert_array_equal(file.dequantize_torch(name).numpy(), file.dequantize(name))


def test_gguf_reverses_ggml_shapes(quant_file):
    path, originals = quant_file
    file = GGUFFile(path)
    assert file.tensors["cube"].shape == (4, 3, 2)
    np.testing.assert_array_equal(file.dequantize("cube"), originals["cube"])
    np.testing.assert_array_equal(file.dequantize("vec"), originals["vec"])


def test_gguf_metadata_matches_gguf_reader(quant_file):
    path, _ = quant_file
    ours = read_gguf_metadata(path)
    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert ours[key] == pytest.approx(field.contents()), key
    assert ours["test.strings"] == ["a", "ü", "日本"]
    assert ours["test.flag"] is True


def test_gguf_tensor_infos_match_gguf_reader(quant_file):
    path, _ = quant_file
    ours = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.qtype == tensor.tensor_type
        assert info.shape == tuple(int(d) for d in tensor.shape)
        assert info.offset == tensor.data_offset
        raw = ours.raw(tensor.name).reshape(-1)
        np.testing.assert_array_equal(raw, tensor.data.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_qk_unpermute_inverts_llama_cpp_permutation(n_head):
    rows = n_head * 8
    weight = np.arange(rows * 5, dtype=np.float32).reshape(rows, 5)
    permuted = permute_qk(weight, n_head)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), weight)
    # llama.cpp interleaves the two rotate-half halves of each head.
    head = permuted[:8, 0] / 5
    assert head.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_gguf_tensor_names_map_to_hugging_face():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight").endswith(".3.post_attention_layernorm.weight")
    assert hf_tensor_name("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj.weight"
    with pytest.raises(KeyError):
        hf_tensor_name("blk.0.unknown.weight")


# ---- a whole tiny model written as GGUF and read back ----------------------------------

_GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_name(hf: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES[rest]}.{kind}"
    return f"{_GGUF_NAMES[base]}.{kind}"


def tiny_tokenizer_kv() -> dict:
    tokens = [bytes_to_unicode()[b] for b in range(256)]
    tokens += ["Ġt", "he", "<|im_start|>", "<|im_end|>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 258 + [3, 3],
        "tokenizer.ggml.merges": ["Ġ t", "h e"],
        "tokenizer.ggml.bos_token_id": 258,
        "tokenizer.ggml.eos_token_id": 259,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }


TINY_ARCHS = {
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(attention_bias=True, tie_word_embeddings=True),
    "qwen3": dict(qk_norm=True, head_dim=32, tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def tiny_gguf(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """(GGUF file, the model whose weights it holds) for a tiny model of each arch."""
    arch = request.param
    fields = dict(vocab_size=260, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=50000.0,
                  max_position_embeddings=128, architecture=arch)  # fmt: skip
    config = ModelConfig(**{**fields, **TINY_ARCHS[arch]})
    source = build_model(config)
    source.init_random_weights(seed=3, std=0.2)
    with torch.no_grad():
        for name, param in source.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.uniform_(0.5, 1.5)
    kv = {f"{arch}.{k}": v for k, v in {
        "block_count": 2, "context_length": 128, "embedding_length": 64,
        "feed_forward_length": 96, "attention.head_count": 4, "attention.head_count_kv": 2,
        "attention.key_length": config.head_dim, "rope.freq_base": 50000.0,
        "attention.layer_norm_rms_epsilon": 1e-5,
    }.items()}  # fmt: skip
    kv.update(tiny_tokenizer_kv())
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    tensors = {}
    for name, param in hf_named_weights(source):
        array = param.detach().numpy()
        target = gguf_name(name)
        base = target.split(".")[-2]
        if arch == "llama" and base in heads:
            array = permute_qk(array, heads[base])
        tensors[target] = (array, Q.F32)
    path = tmp_path_factory.mktemp(f"tiny-{arch}") / f"tiny-{arch}.F32.gguf"
    return write_gguf(path, arch, kv, tensors), source


def test_gguf_model_round_trips_weights_and_config(tiny_gguf):
    path, source = tiny_gguf
    loaded = load_model(str(path), progress=False)
    cfg, expected = loaded.config, source.config
    for field in ("architecture", "num_heads", "num_kv_heads", "head_dim", "qk_norm",
                  "attention_bias", "tie_word_embeddings", "rope_theta", "vocab_size"):  # fmt: skip
        assert getattr(cfg, field) == getattr(expected, field), field
    assert cfg.bos_token_id == 258 and 259 in cfg.eos_token_ids
    ours = dict(loaded.model.named_parameters())
    for name, param in source.named_parameters():
        torch.testing.assert_close(ours[name], param, rtol=0, atol=0, msg=name)
    ids = list(range(0, 260, 7))
    torch.testing.assert_close(forward_tokens(loaded.model, ids), forward_tokens(source, ids))


def test_gguf_tokenizer_comes_from_metadata(tiny_gguf):
    path, _ = tiny_gguf
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.encode("the<|im_end|>") == [ord("t"), 257, 259]
    assert tokenizer.decode([256, 257, 259]) == " the"


def test_gguf_model_name_is_file_stem_with_alias_without_quant(tiny_gguf):
    path, _ = tiny_gguf
    name = model_name(str(path))
    assert name == path.stem and name.endswith(".F32")
    assert name.removesuffix(".F32") in model_aliases(str(path))


def test_progress_bar_goes_to_stderr(tiny_gguf, capsys):
    path, _ = tiny_gguf
    load_model(str(path), progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "tiny" in err


# ---- default model, dummy presets ------------------------------------------------------


def test_default_model_path_finds_the_packaged_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert model_name("default") == "SmolLM2-135M-Instruct.Q4_1"
    assert "SmolLM2-135M-Instruct" in model_aliases("default")


def test_the_start_line_names_the_model_and_where_its_weights_come_from(tmp_path):
    assert describe("default") == f"SmolLM2-135M-Instruct.Q4_1 (GGUF {default_model_path()})"
    assert describe("dummy:tiny") == "dummy-tiny (random weights)"
    (tmp_path / "config.json").write_text("{}")
    assert describe(str(tmp_path)) == f"{tmp_path.name} (Hugging Face folder {tmp_path})"


def test_default_model_config_matches_known_facts():
    cfg = load_model_config("default")
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids[0] == 2


def test_dummy_tiny_loads_with_byte_tokenizer():
    loaded = load_model("dummy:tiny", progress=False)
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.name == "dummy-tiny"
    logits = forward_tokens(loaded.model, loaded.tokenizer.encode("hello"))
    assert logits.shape == (5, PRESETS["tiny"].vocab_size) and torch.isfinite(logits).all()
    again = load_model("dummy:tiny", progress=False)
    for (_, a), (_, b) in zip(loaded.model.named_parameters(), again.model.named_parameters(),
                              strict=True):  # fmt: skip
        assert torch.equal(a, b)


def test_dummy_llama3_8b_preset_has_real_shapes():
    cfg = PRESETS["llama3-8b"]
    model = build_model(cfg, device="meta", dtype=torch.bfloat16)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["model.embed_tokens.weight"] == (128256, 4096)
    assert shapes["lm_head.weight"] == (128256, 4096)
    assert shapes["model.layers.31.self_attn.qkv_proj.weight"] == (4096 + 2 * 1024, 4096)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 14336, 4096)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (4096, 14336)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert cfg.rope_scaling.kind == "llama3" and cfg.rope_theta == 500000.0
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_unknown_specs_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model_config(str(tmp_path / "missing.gguf"))
    with pytest.raises(KeyError, match="llama3-8b"):
        load_model_config("dummy:nope")
