"""The Llama family: SmolLM2, Llama 3, Qwen2, Qwen3 (dense), one implementation.

Switches come from ``ModelConfig``: ``attention_bias`` (Qwen2's q/k/v bias), ``qk_norm``
(Qwen3's per-head RMSNorm on q and k before RoPE), ``tie_word_embeddings`` and
``rope_scaling`` (``kind="llama3"``). q/k/v share one projection and gate/up another;
``load_weights`` fuses Hugging Face's separate tensors into them. RoPE is the
rotate-half (NeoX / Hugging Face) form with a precomputed cos/sin table. Attention goes
through ``ctx.attention``; the model never sees the KV cache.

The residual stream is carried beside the hidden states (``residual + x`` is added inside
the next norm), so on CUDA, with TileLang present, the add and the RMSNorm run as one
kernel and RoPE rotates q and k in place in one kernel (``kernels.norm_rope_cache``): at
decode, where a step is a few hundred small launches around the weight reads, that halves
the launches. On the CPU in float32 the C kernels of ``kernels.cpu`` do the same
(``engine.cpu_kernels``), and the MLP of a quantized model folds SwiGLU into the down
projection's kernel (``engine.models.quant``). Elsewhere the same arithmetic runs as
torch ops.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import ForwardContext
from engine.config import ModelConfig, RopeScaling
from engine.cpu_kernels import cpu_kernels_for
from engine.models.base import CausalLM, Spliced
from engine.models.quant import QuantEmbedding, QuantLinear, QuantWeight, as_float, quant_slots
from kernels import ATTENTION_DTYPES, tilelang_available
from kvstore.layout import KVCacheLayout


def fused_kernels_for(x: torch.Tensor) -> bool:
    """True when the TileLang norm/RoPE kernels can take ``x`` (CUDA, bf16/fp16)."""
    return x.is_cuda and x.dtype in ATTENTION_DTYPES and _TILELANG_PRESENT


_TILELANG_PRESENT = tilelang_available()


class Linear(nn.Linear):
    """``nn.Linear`` without the random init: weights are loaded or filled afterwards.

    On CUDA a product with at most ``kernels.gemv.MAX_ROWS`` tokens (decode at small
    batch) runs on the TileLang matrix-vector kernel, which streams the weight faster than
    the library GEMM does at that size; ``skinny_kernel = False`` turns it off.
    """

    skinny_kernel = True

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear``, on the skinny GEMV kernel where it takes the operands (see Linear)."""
    if Linear.skinny_kernel and bias is None and fused_kernels_for(x):
        from kernels.gemv import gemv, gemv_supported

        if gemv_supported(x, weight):
            return gemv(x, weight)
    return F.linear(x, weight, bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` without the random init: weights are loaded or filled afterwards."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: normalise in float32, cast back, then scale.

    With ``residual``: first ``residual = x + residual`` (in x's dtype), then normalise that;
    returns ``(normed, residual)``. The CUDA kernel does this in place on both inputs and
    rounds once after the scale (Hugging Face rounds before it too): bf16 rounding apart,
    the same function.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and fused_kernels_for(x) and x.is_contiguous():
            from kernels.norm_rope_cache import fused_add_rms_norm, norm_supported, rms_norm

            if norm_supported(x.shape[1]):  # else torch's, below
                if residual is None:
                    return rms_norm(x, self.weight, self.eps)
                return fused_add_rms_norm(x, residual, self.weight, self.eps)
        cpu = cpu_kernels_for(x)
        if cpu is not None and x.is_contiguous() and self.weight.dtype == torch.float32:
            if residual is None:
                return cpu.rms_norm(x, self.weight, self.eps)
            if residual.is_contiguous():
                return cpu.rms_norm(x, self.weight, self.eps, residual), residual
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, with llama3 scaling when asked."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.kind == "none":
        return inv_freq
    if scaling.kind != "llama3":
        raise NotImplementedError(f"rope scaling {scaling.kind!r}")
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin table [max_positions, head_dim] (cos half then sin half), float32.

    ``freq_factors`` (llama.cpp's ``rope_freqs``), when loaded, divide the frequencies.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.freq_factors: torch.Tensor | None = None
        self.register_buffer("cos_sin", torch.empty(max_positions, head_dim), persistent=False)

    def reset_cache(self) -> None:
        """(Re)compute the table on the buffer's device; call after moving or loading."""
        device = self.cos_sin.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        if self.freq_factors is not None:
            inv_freq = inv_freq / self.freq_factors.to(device, torch.float32)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] at ``positions`` [T] (in place where a
        kernel does it: CUDA, and float32 on the CPU)."""
        if fused_kernels_for(q) and positions.dtype == torch.int64:
            from kernels.norm_rope_cache import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos_sin)
        cpu = cpu_kernels_for(q)
        if (cpu is not None and positions.dtype == torch.int64 and cpu.rope_supported(q)
                and cpu.rope_supported(k)):  # fmt: skip
            cpu.rope(q, positions, self.cos_sin)
            cpu.rope(k, positions, self.cos_sin)
            return q, k
        cos, sin = self.cos_sin[positions].unsqueeze(1).to(q.dtype).chunk(2, dim=-1)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` [T, H, D] by ``cos``/``sin`` [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = [rotary]  # shared, kept out of this module's parameters and buffers

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = ctx.attention(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if isinstance(self.down_proj, QuantLinear):
            return self.down_proj.forward_swiglu(gate_up)
        if fused_kernels_for(gate_up) and gate_up.is_contiguous():
            from kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + hidden`` is the stream entering the layer (``residual`` None: the
        embeddings, in ``hidden``); returns the same pair for the next layer."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        spliced: Spliced | None = None,
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if spliced is not None:
            hidden = hidden.index_copy(0, spliced.rows, spliced.values.to(hidden.dtype))
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, ctx)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


# HF name suffix → (fused parameter suffix, shard index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(CausalLM):
    """Llama-family decoder; parameter names mirror Hugging Face's except the fused ones
    (``self_attn.qkv_proj``, ``mlp.gate_up_proj``).

    Build with ``engine.models.build_model`` (allocates on the target device without a
    random init), then ``load_weights`` or ``init_random_weights``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @property
    def attention_scale(self) -> float:
        """Softmax scale the attention backend must use."""
        return self.config.head_dim**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        spliced: Spliced | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx, spliced)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        embed = self.model.embed_tokens
        if isinstance(embed, QuantEmbedding):
            return embed.project(hidden)
        return linear(hidden, embed.weight).float()

    def kv_layout(self, block_size: int, dtype: torch.dtype) -> KVCacheLayout:
        cfg = self.config
        return KVCacheLayout.for_attention(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype
        )

    # ---- weights ------------------------------------------------------------------------

    def _shard(self, name: str) -> tuple[str, slice | None]:
        """Parameter name and row slice that HF tensor ``name`` fills."""
        for hf, (fused, index) in _FUSED.items():
            marker = f".{hf}."
            if marker in name:
                target = name.replace(marker, f".{fused}.")
                return target, self._fused_rows(hf, index)
        return name, None

    def _fused_rows(self, hf: str, index: int) -> slice:
        cfg = self.config
        if hf.startswith("mlp."):
            sizes = [cfg.intermediate_size] * 2
        else:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            sizes = [q, kv, kv]
        start = sum(sizes[:index])
        return slice(start, start + sizes[index])

    def weight_targets(self) -> dict[str, nn.Parameter]:
        """The parameters ``load_weights`` fills, by name (a model with parts loaded
        otherwise leaves them out)."""
        return dict(self.named_parameters())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]) -> None:
        """Copy HF-named tensors in (any dtype/device; converted), or quantized blocks
        (``QuantWeight``: into a quantized module as they are, dequantized elsewhere).
        Raises ``KeyError`` for a name the model does not have and ``ValueError`` if a
        weight stays unset. ``lm_head.weight`` is ignored when embeddings are tied."""
        quant = quant_slots(self)
        params = self.weight_targets()
        sizes = {n: p.numel() for n, p in params.items()}
        sizes.update({n: m.out_features * m.in_features for n, m in quant.items()
                      if isinstance(m, QuantLinear)})  # fmt: skip
        sizes.update({n: m.num_embeddings * m.embedding_dim for n, m in quant.items()
                      if isinstance(m, QuantEmbedding)})  # fmt: skip
        filled: dict[str, int] = {}
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if name == "model.rotary_emb.freq_factors":
                self.model.rotary_emb.freq_factors = as_float(tensor).float().clone()
                self.model.rotary_emb.reset_cache()
                continue
            target, rows = self._shard(name)
            if target in quant:
                try:
                    done = quant[target].load(tensor, rows)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
                filled[target] = filled.get(target, 0) + done
                continue
            if target not in params:
                raise KeyError(f"unexpected weight {name!r}")
            tensor = as_float(tensor)
            dest = params[target].data if rows is None else params[target].data[rows]
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + dest.numel()
        missing = [n for n, size in sizes.items() if filled.get(n, 0) != size]
        if missing:
            more = "..." if len(missing) > 8 else ""
            raise ValueError(f"weights not loaded: {missing[:8]}{more}")

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Fill every parameter in place on its device: norms 1, biases 0, others N(0, std)."""
        generator = torch.Generator(device=self.model.embed_tokens.weight.device)
        generator.manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
