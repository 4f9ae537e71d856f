"""The mixture-of-experts layer: router, routed experts, shared experts.

One layer serves every MoE model; what differs between them is the routing strategy,
which ``MoEConfig`` states (see its docstring): Qwen3's softmax top-k (optionally
renormalised) and DeepSeek-V3's sigmoid scores with a selection-only correction bias,
grouped top-k and a scaling factor are the same ``Router`` with other settings.

The routed experts' computation is ``moe_experts(hidden, topk_ids, topk_weights, w13,
w2)``, a pure function of the tokens, the routing and the stacked expert weights (the
``Experts`` module's call):

- ``hidden`` [T, H]; ``topk_ids`` [T, K] int64 expert ids; ``topk_weights`` [T, K] float32;
- ``w13`` [E, 2I, H]: each expert's gate rows then up rows; ``w2`` [E, H, I]: its down
  projection;
- returns [T, H] in ``hidden``'s dtype: ``sum_k topk_weights[t, k] *
  w2[e] (silu(gate_e(x)) * up_e(x))`` with ``e = topk_ids[t, k]``.

On CUDA it is a grouped GEMM over the tokens each expert received
(``kernels.moe.moe_experts_cuda``: the TileLang kernel ``fused_moe`` for decode batches,
torch's ``_grouped_mm`` for prefills, whichever measured faster): no host synchronisation, so
a decode step captures in a CUDA graph and reads only the chosen experts' weights. An
expert-parallel dispatcher (tokens to the ranks that own their experts and back) takes
its place the same way, without the model changing.
Elsewhere (the CPU, float32, shapes the kernel does not take) the torch version sorts the
(token, expert) pairs by expert and runs one product pair per expert that has tokens;
that reads the per-expert counts on the host. While a CUDA graph is being captured
without the kernel it runs ``moe_experts_dense`` instead: every expert over every token,
weighted by zero where a token did not choose it — the same sum, at the cost of reading
every expert's weights each step.

With ``--quantization fp8`` the routed experts are ``Fp8Experts``: the same weights as
e4m3 with a float32 scale per output channel (half the bytes; 97 % of DeepSeek-V3's
weights are routed experts), made from the loaded ones (``quantize_experts``). On a
Hopper GPU their products run in FP8 (``kernels.moe.fp8_grouped_moe``: the tokens and
SiLU-and-mul's output quantized per row on the way in); elsewhere ``fp8_moe_ref``
computes the same function in float32, the parity path of the tests. Both kinds give
their weights as tensors stacked by expert (``stacked``) and are made back from them
(``from_stacked``): what an expert-parallel rank keeps and moves, whatever their format.

The router computes in float32 (``keeps_float32``: ``build_model`` leaves its weight and
bias in float32 whatever the model's dtype), as transformers keeps DeepSeek's router.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig, MoEConfig
from engine.models.llama import LlamaMLP
from kernels.fp8 import FP8, quantize_rows_ref
from kernels.moe import (
    fp8_grouped_moe,
    fp8_grouped_moe_supported,
    fp8_moe_ref,
    fused_moe_supported,
    moe_experts_cuda,
)

QUANTIZATIONS = ("none", "fp8")


def moe_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' weighted sum per token (module docstring)."""
    if fused_moe_supported(hidden, w13, w2):
        return moe_experts_cuda(hidden, topk_ids, topk_weights, w13, w2)
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return moe_experts_dense(hidden, topk_ids, topk_weights, w13, w2)
    return moe_experts_sorted(hidden, topk_ids, topk_weights, w13, w2)


def moe_experts_sorted(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """``moe_experts`` in torch ops: pairs sorted by expert, one product pair per expert
    that has tokens (the per-expert counts are read on the host)."""
    tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // top_k
    x = hidden[token_of]
    y = torch.empty(tokens * top_k, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
            y[rows] = F.linear(F.silu(gate) * up, w2[expert])
            start += count
    weighted = y.float() * topk_weights.flatten()[order, None]
    out = torch.zeros(tokens, w2.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, token_of, weighted).to(hidden.dtype)


def moe_experts_dense(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """``moe_experts`` without reading anything back to the host: every expert runs on
    every token, its output weighted by the token's weight for it (zero if unchosen)."""
    per_expert = torch.zeros(
        topk_ids.shape[0], w13.shape[0], dtype=torch.float32, device=hidden.device
    ).scatter_add_(1, topk_ids, topk_weights.float())  # [T, E]
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float32, device=hidden.device)
    for expert in range(w13.shape[0]):
        gate, up = F.linear(hidden, w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out += per_expert[:, expert, None] * y.float()
    return out.to(hidden.dtype)


class Router(nn.Module):
    """Chooses ``top_k`` experts per token and their weights, as ``MoEConfig`` says.

    ``forward(x [T, H])`` → ``(topk_weights [T, K] float32, topk_ids [T, K] int64)``.
    """

    keeps_float32 = True

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(moe.num_experts)) if moe.score_correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores
        if self.e_score_correction_bias is not None:  # steers the choice, not the weights
            choice = scores + self.e_score_correction_bias.float()
        if moe.num_groups > 1:
            choice = _in_best_groups(choice, moe.num_groups, moe.topk_groups)
        topk_ids = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, topk_ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, topk_ids


def _in_best_groups(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """``choice`` [T, E] with every expert outside the ``topk_groups`` best groups at -inf;
    a group's rank is the sum of its two best scores (DeepSeek-V3)."""
    grouped = choice.unflatten(-1, (num_groups, -1))  # [T, G, E/G]
    best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
    kept = best.topk(topk_groups, dim=-1).indices
    mask = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~mask[..., None], float("-inf")).flatten(-2)


class Experts(nn.Module):
    """The routed experts' weights, stacked: ``w13`` [E, 2I, H] and ``w2`` [E, H, I].

    ``forward(hidden, topk_ids, topk_weights)`` is ``moe_experts`` over them; an
    expert-parallel rank puts its own module in this one's place (``engine.ep.experts``),
    with the same call."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return moe_experts(hidden, topk_ids, topk_weights, self.w13, self.w2)

    def stacked(self) -> tuple[torch.Tensor, ...]:
        """The weights, each stacked by expert on its first dim (what an expert-parallel
        rank selects and moves, ``engine.ep.experts``)."""
        return self.w13.data, self.w2.data

    @classmethod
    def from_stacked(cls, w13: torch.Tensor, w2: torch.Tensor) -> Experts:
        """The module of ``stacked()``'s tensors (no copy)."""
        module = cls(0, 0, 0)
        module.w13 = nn.Parameter(w13, requires_grad=False)
        module.w2 = nn.Parameter(w2, requires_grad=False)
        return module


class Fp8Experts(nn.Module):
    """``Experts`` with FP8 weights (module docstring): buffers ``w13`` [E, 2I, H] and
    ``w2`` [E, H, I] in e4m3, ``w13_scale`` [E, 2I] and ``w2_scale`` [E, H] in float32
    (``kernels.fp8``'s rows: ``w ~ w13[e, r] * w13_scale[e, r]``). The same call."""

    def __init__(self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                 w2_scale: torch.Tensor) -> None:  # fmt: skip
        super().__init__()
        self.register_buffer("w13", w13)
        self.register_buffer("w13_scale", w13_scale)
        self.register_buffer("w2", w2)
        self.register_buffer("w2_scale", w2_scale)

    @classmethod
    @torch.no_grad()
    def quantize(cls, experts: Experts, chunk: int = 8) -> Fp8Experts:
        """``experts``' weights as FP8 rows, ``chunk`` experts at a time (the float32
        copies quantizing takes stay that small)."""
        parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name in ("w13", "w2"):
            weight = getattr(experts, name)
            q = torch.empty(weight.shape, dtype=FP8, device=weight.device)
            scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
            for start in range(0, weight.shape[0], chunk):
                rows = slice(start, start + chunk)
                q[rows], scale[rows] = quantize_rows_ref(weight[rows])
            parts[name] = q, scale
        return cls(*parts["w13"], *parts["w2"])

    def stacked(self) -> tuple[torch.Tensor, ...]:
        """As ``Experts.stacked``: every buffer, stacked by expert."""
        return self.w13, self.w13_scale, self.w2, self.w2_scale

    @classmethod
    def from_stacked(cls, *tensors: torch.Tensor) -> Fp8Experts:
        """The module of ``stacked()``'s tensors (no copy)."""
        return cls(*tensors)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        weights = self.stacked()
        if fp8_grouped_moe_supported(hidden, self.w13, self.w2):
            return fp8_grouped_moe(hidden, topk_ids, topk_weights, *weights)
        return fp8_moe_ref(hidden, topk_ids, topk_weights, *weights).to(hidden.dtype)


def quantize_experts(model: nn.Module, quantization: str) -> nn.Module:
    """Replace, in place, every MoE layer's routed experts by ``Fp8Experts`` for
    ``quantization`` "fp8" (``QUANTIZATIONS``; "none" changes nothing), one layer at a
    time, each layer's unquantized weights freed before the next. Returns ``model``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: expected one of {QUANTIZATIONS}")
    if quantization == "fp8":
        for module in model.modules():
            if isinstance(module, MoE) and isinstance(module.experts, Experts):
                module.experts = Fp8Experts.quantize(module.experts)
    return model


class MoE(nn.Module):
    """Router + routed experts (+ shared experts), in place of a layer's MLP.

    Parameter names follow Hugging Face's but for the stacked experts (``experts.w13``,
    ``experts.w2``) and the fused shared gate/up (``shared_experts.gate_up_proj``);
    ``moe_weight_target`` maps checkpoint names onto them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.gate = Router(config.hidden_size, moe)
        self.experts = Experts(moe.num_experts, config.hidden_size, moe.intermediate_size)
        self.shared_experts = (
            LlamaMLP(_with_width(config, moe.num_shared_experts * moe.intermediate_size))
            if moe.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def feed_forward(config: ModelConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP: the MoE on MoE layers, the dense gated MLP elsewhere."""
    if config.moe is not None and config.moe.is_moe_layer(layer):
        return MoE(config)
    return LlamaMLP(config)


def _with_width(config: ModelConfig, intermediate_size: int) -> ModelConfig:
    return dataclasses.replace(config, intermediate_size=intermediate_size)


_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_SHARED = re.compile(r"\.mlp\.shared_experts\.(gate|up)_proj\.weight$")


def moe_weight_target(name: str, moe: MoEConfig) -> tuple[str, object] | None:
    """(parameter name, index into it) that checkpoint tensor ``name`` fills, for the
    per-expert and shared-expert gate/up/down tensors; None for any other name."""
    size = moe.intermediate_size
    if match := _EXPERT.search(name):
        expert, part = int(match.group(1)), match.group(2)
        prefix = name[: match.start()]
        if part == "down":
            return f"{prefix}.mlp.experts.w2", expert
        rows = slice(0, size) if part == "gate" else slice(size, 2 * size)
        return f"{prefix}.mlp.experts.w13", (expert, rows)
    if match := _SHARED.search(name):
        shared = moe.num_shared_experts * size
        rows = slice(0, shared) if match.group(1) == "gate" else slice(shared, 2 * shared)
        return f"{name[: match.start()]}.mlp.shared_experts.gate_up_proj.weight", rows
    return None
