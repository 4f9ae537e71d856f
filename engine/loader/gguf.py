"""GGUF files: metadata, model config, tokenizer and dequantized weights.

The header is parsed directly (``gguf_header``, which imports neither torch nor ``gguf``),
so a frontend can build the tokenizer quickly. Tensor data is memory-mapped and dequantized
with torch ops for the common types (checked bit-exact against ``gguf.quants.dequantize``,
which handles the rest); ggml shapes (innermost first) are reversed into torch order,
llama.cpp's q/k row permutation is undone for the llama architecture, and tensor names
are mapped to Hugging Face names.
"""

from __future__ import annotations

import contextlib
import mmap
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from engine.config import ModelConfig, RopeScaling
from engine.loader.gguf_header import (
    _U32,
    _U64,
    DEFAULT_ALIGNMENT,
    _Cursor,
    read_gguf_metadata,  # noqa: F401  (its home before gguf_header)
    read_header,
)
from kernels.cpu_quant import Q4, Q8, QuantWeight, pack_q4, pack_q8

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the file. ``shape`` is in ggml order (innermost first)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def nbytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) * type_size // block_size


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key → Python value) and ``tensors`` (name → info).

    With ``tensors=False`` only the key/value header is read (enough for a tokenizer).
    """

    def __init__(self, path: str | Path, tensors: bool = True) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.version, tensor_count, self.metadata, cur = read_header(self._map, self.path)
        self.tensors: dict[str, GGUFTensorInfo] = {}
        if tensors:
            self._read_tensor_infos(cur, tensor_count)

    def _read_tensor_infos(self, cur: _Cursor, count: int) -> None:
        entries = []
        for _ in range(count):
            name = cur.string()
            n_dims = cur.scalar(_U32)
            shape = tuple(cur.scalar(_U64) for _ in range(n_dims))
            qtype = GGMLQuantizationType(cur.scalar(_U32))
            entries.append((name, shape, qtype, cur.scalar(_U64)))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        for name, shape, qtype, offset in entries:
            self.tensors[name] = GGUFTensorInfo(name, shape, qtype, data_start + offset)

    def close(self) -> None:
        """Unmap the file (its pages stop counting in this process's memory). Tensors
        taken with ``raw`` must be gone; with one still alive the mapping stays."""
        with contextlib.suppress(BufferError):
            self._map.close()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "llama"))

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor as uint8 ``[*torch_shape[:-1], bytes_per_row]``."""
        info = self.tensors[name]
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(*info.torch_shape[:-1], -1)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in torch order (``torch_shape``), by ``gguf.quants``."""
        info = self.tensors[name]
        out = dequantize(self.raw(name), info.qtype)
        return np.ascontiguousarray(out, dtype=np.float32).reshape(info.torch_shape)

    def dequantize_torch(self, name: str) -> torch.Tensor:
        """Same values as ``dequantize`` as a torch float32 tensor; F32/F16/BF16/Q8_0/Q4_0/
        Q4_1 are decoded with torch ops (several times faster), other types by ``gguf``."""
        info = self.tensors[name]
        decode = _TORCH_DECODERS.get(info.qtype)
        if decode is None:
            return torch.from_numpy(self.dequantize(name).copy())
        with warnings.catch_warnings():  # the mapping is read-only; decoders never write to it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.raw(name))
        return decode(raw.reshape(-1)).reshape(info.torch_shape)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """One little-endian float16 per row: [blocks, 2] uint8 → [blocks, 1] float32."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[blocks, 16] packed bytes → [blocks, 32]: low nibbles first, then high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()


def _decode_q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 34)
    return _f16(blocks[:, :2]) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _decode_q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 18)
    return _f16(blocks[:, :2]) * (_nibbles(blocks[:, 2:]) - 8.0)


def _decode_q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 20)
    return _f16(blocks[:, :2]) * _nibbles(blocks[:, 4:]) + _f16(blocks[:, 2:4])


_TORCH_DECODERS = {
    GGMLQuantizationType.F32: lambda raw: raw.clone().view(torch.float32),
    GGMLQuantizationType.F16: lambda raw: raw.view(torch.float16).float(),
    GGMLQuantizationType.BF16: lambda raw: raw.view(torch.bfloat16).float(),
    GGMLQuantizationType.Q8_0: _decode_q8_0,
    GGMLQuantizationType.Q4_0: _decode_q4_0,
    GGMLQuantizationType.Q4_1: _decode_q4_1,
}


def _arch_value(meta: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    value = meta.get(f"{arch}.{key}", default)
    if isinstance(value, list):  # per-layer values (e.g. head_count_kv): uniform models only
        if len(set(value)) != 1:
            raise NotImplementedError(f"{arch}.{key} varies per layer")
        value = value[0]
    return value


def gguf_model_config(gguf: GGUFFile, name: str) -> ModelConfig:
    """The ``ModelConfig`` a GGUF file describes (llama, qwen2, qwen3 architectures)."""
    meta, arch = gguf.metadata, gguf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} (supported: {SUPPORTED_ARCHITECTURES})"
        )
    scaling_type = _arch_value(meta, arch, "rope.scaling.type", "none")
    if scaling_type not in ("none", "", None):
        raise NotImplementedError(f"GGUF rope scaling {scaling_type!r}")
    hidden = int(_arch_value(meta, arch, "embedding_length"))
    heads = int(_arch_value(meta, arch, "attention.head_count"))
    vocab = _arch_value(meta, arch, "vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens", ())
        vocab = len(tokens) or gguf.tensors["token_embd.weight"].shape[1]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_arch_value(meta, arch, "feed_forward_length")),
        num_layers=int(_arch_value(meta, arch, "block_count")),
        num_heads=heads,
        num_kv_heads=int(_arch_value(meta, arch, "attention.head_count_kv", heads)),
        head_dim=int(_arch_value(meta, arch, "attention.key_length", hidden // heads)),
        rms_norm_eps=float(_arch_value(meta, arch, "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_arch_value(meta, arch, "rope.freq_base", 10000.0)),
        rope_scaling=RopeScaling(),
        max_position_embeddings=int(_arch_value(meta, arch, "context_length", 8192)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
        architecture=arch,
        name=name,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "rope_freqs": "model.rotary_emb.freq_factors",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` →
    ``model.layers.3.self_attn.q_proj.weight``). ``rope_freqs.weight`` (llama3 frequency
    divisors) maps to ``model.rotary_emb.freq_factors``. Raises KeyError when unknown."""
    if m := _LAYER_RE.match(gguf_name):
        layer, base, kind = m.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[base]}.{kind}"
    if m := _GLOBAL_RE.match(gguf_name):
        base, kind = m.groups()
        mapped = _GLOBAL_NAMES[base]
        return mapped if base == "rope_freqs" else f"{mapped}.{kind}"
    raise KeyError(gguf_name)


def permute_qk(weight: ArrayT, n_head: int) -> ArrayT:
    """llama.cpp's convert-time permutation of q/k rows (HF layout → GGUF layout).
    Works on numpy arrays and torch tensors; returns a contiguous result."""
    rows, rest = weight.shape[0], tuple(weight.shape[1:])
    out = weight.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)
    return out.reshape(weight.shape)


def unpermute_qk(weight: ArrayT, n_head: int) -> ArrayT:
    """Inverse of ``permute_qk``: GGUF q/k rows back to Hugging Face's rotate-half layout."""
    rows, rest = weight.shape[0], tuple(weight.shape[1:])
    out = weight.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2)
    return out.reshape(weight.shape)


def _progress(items: list[str], enabled: bool, desc: str) -> Any:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="tensor", file=sys.stderr, leave=False)


def iter_gguf_weights(
    gguf: GGUFFile, config: ModelConfig, progress: bool = False, blocks: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor, q/k unpermuted for llama.

    With ``blocks``, matrices stored as Q4_0, Q4_1 or Q8_0 come as ``QuantWeight`` blocks
    instead (the same values, not dequantized: see ``gguf_blocks``)."""
    unpermute = {}
    if gguf.architecture == "llama":
        unpermute = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    for name in _progress(list(gguf.tensors), progress, f"loading {gguf.path.name}"):
        tensor = gguf_blocks(gguf, name) if blocks else None
        if tensor is None:
            tensor = gguf.dequantize_torch(name)
        parts = name.split(".")
        if len(parts) == 4 and parts[2] in unpermute:
            tensor = _unpermute(tensor, unpermute[parts[2]])
        yield hf_tensor_name(name), tensor


def _unpermute(tensor: torch.Tensor | QuantWeight, n_head: int) -> torch.Tensor | QuantWeight:
    if isinstance(tensor, QuantWeight):  # rows of blocks move like rows of values
        return QuantWeight(tensor.kind, unpermute_qk(tensor.data, n_head), tensor.k)
    return unpermute_qk(tensor, n_head)


def gguf_blocks(gguf: GGUFFile, name: str) -> QuantWeight | None:
    """A Q4_0 / Q4_1 / Q8_0 matrix as ``kernels.cpu_quant`` blocks, the same values
    exactly (float16 scales widened to float32; Q4_0's ``(q - 8) * d`` as ``q * d - 8d``,
    exact too); None for other tensors."""
    info = gguf.tensors[name]
    if len(info.shape) != 2 or info.qtype not in _BLOCK_LAYOUTS:
        return None
    stride, kind = _BLOCK_LAYOUTS[info.qtype]
    with warnings.catch_warnings():  # the mapping is read-only; nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(gguf.raw(name))
    rows, k = info.torch_shape
    raw = raw.reshape(rows, k // 32, stride)
    d = _f16(raw[..., :2].reshape(-1, 2)).reshape(rows, -1)
    if kind == Q8:
        return pack_q8(d, raw[..., 2:].contiguous().view(torch.int8))
    if info.qtype == GGMLQuantizationType.Q4_1:
        m, qs = _f16(raw[..., 2:4].reshape(-1, 2)).reshape(rows, -1), raw[..., 4:]
    else:
        m, qs = -8 * d, raw[..., 2:]
    return pack_q4(d, m, torch.cat((qs & 0x0F, qs >> 4), dim=-1))


_BLOCK_LAYOUTS = {
    GGMLQuantizationType.Q4_0: (18, Q4),
    GGMLQuantizationType.Q4_1: (20, Q4),
    GGMLQuantizationType.Q8_0: (34, Q8),
}
