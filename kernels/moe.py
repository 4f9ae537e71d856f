"""Mixture-of-experts expert compute: a grouped GEMM over the tokens each expert received.

``fused_moe(hidden, topk_ids, topk_weights, w13, w2)`` computes, for every token t,
``sum_k topk_weights[t, k] * w2[e] (silu(gate_e(x_t)) * up_e(x_t))`` with ``e =
topk_ids[t, k]``; ``w13 [E, 2I, H]`` holds each expert's gate rows then its up rows, ``w2
[E, H, I]`` its down projection (``engine.models.moe``'s layout). Three steps, none of
which reads anything back to the host, so a decode step captures in a CUDA graph:

1. ``moe_align`` (torch ops): the T*K (token, expert) pairs sorted by expert, each
   expert's run padded to a multiple of ``block_m`` rows, as ``sorted_ids`` (the pair in
   each padded row; ``T*K`` in padding rows) and ``block_expert`` (the expert of each
   ``block_m``-row block; ``E`` for blocks past the last). Their sizes are upper bounds
   that depend on T only: ``T*K + min(E, T*K) * (block_m - 1)`` rows.
2. The tokens are gathered into that order (``index_select``), so every block of rows
   is one contiguous tile: the kernels load it with the copy engine like the weights.
3. Two TileLang kernels, one CTA per (row block, output tile):
   ``gate_up``: ``h = silu(x w_gate^T) * (x w_up^T)`` with both products accumulated in
   float32 and the SiLU in the epilogue, one rounding; ``down``: ``y = h w2^T`` times each
   row's routing weight, written in place (whole rows of the block: scattering each row to
   its pair made the kernel four times slower, bench/results/moe_gemm_probe_h200.json).
   Blocks past the last run no loop. torch gathers the pairs back into (token, k) order
   (``row_of_pair``) and sums their outputs ``[T, K, H]`` in float32.

CTAs are launched in panels of ``GROUP_M`` row blocks × every output tile, row block
fastest: the row blocks of one expert read each weight tile back to back (from L2 after
the first), and a panel's token tiles stay in L2 while its output tiles go by. Decode
(a few rows per expert) uses 16-row blocks, so a step reads each chosen expert's weights
once at nearly the copy rate; prefill 64- or 128-row blocks on the warpgroup MMA.
"""

import functools
import math
from dataclasses import dataclass

import torch

from kernels._tl import (
    ATTENTION_DTYPES,
    KernelCache,
    TileLangBuild,
    check_tensor,
    kernels_usable,
    tl_dtype,
)
from kernels.activation import silu_and_mul, silu_and_mul_fp8
from kernels.fp8 import FP8, dequantize_rows, quantize_rows, quantize_rows_ref

GROUP_M = 8  # row blocks per launch panel


@dataclass(frozen=True)
class GroupedGemmConfig:
    """One of the two kernels (``gate_up`` or ``down``), specialised on shapes and tiles.

    ``n`` output features (``I`` for gate_up, ``H`` for down), ``k`` the reduction
    (``H``, resp. ``I``), ``experts`` E."""

    kind: str  # "gate_up" | "down"
    experts: int
    n: int
    k: int
    dtype: str
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    threads: int

    def __post_init__(self) -> None:
        if self.kind not in ("gate_up", "down"):
            raise ValueError(f"unknown grouped GEMM kind {self.kind!r}")
        if self.n % self.block_n or self.k % self.block_k:
            raise ValueError(f"tiles {self.block_n}x{self.block_k} do not divide {self.n}x{self.k}")


def _largest_divisor(size: int, choices: tuple[int, ...]) -> int:
    return next(c for c in choices if size % c == 0)


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 while experts average a few rows each (decode), 64 or 128 once
    they receive enough tokens for the warpgroup MMA to pay (prefill)."""
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 24 else 64 if per_expert <= 96 else 128


def kernel_configs(
    experts: int, hidden: int, inter: int, dtype: torch.dtype, block_m: int
) -> tuple[GroupedGemmConfig, GroupedGemmConfig]:
    """The (gate_up, down) configs ``fused_moe`` uses for these shapes and rows per block."""
    name = tl_dtype(dtype)
    small = block_m < 64
    threads = 128 if block_m <= 64 else 256
    stages = 4 if small else 3
    gate_up = GroupedGemmConfig(
        "gate_up", experts, inter, hidden, name, block_m,
        _largest_divisor(inter, (128, 64, 32, 16)), _largest_divisor(hidden, (64, 32, 16)),
        stages, threads,
    )  # fmt: skip
    down = GroupedGemmConfig(
        "down", experts, hidden, inter, name, block_m,
        _largest_divisor(hidden, (128, 64, 32, 16)), _largest_divisor(inter, (64, 32, 16)),
        stages + 1 if small else stages, threads,
    )  # fmt: skip
    return gate_up, down


def grouped_gemm_build(cfg: GroupedGemmConfig) -> TileLangBuild:
    """One of the two kernels for ``cfg``."""
    program = _gate_up_program if cfg.kind == "gate_up" else _down_program
    return TileLangBuild(program, (
        cfg.experts, cfg.n, cfg.k, cfg.dtype, cfg.block_m, cfg.block_n, cfg.block_k,
        cfg.num_stages, cfg.threads,
    ))  # fmt: skip


def _tile_of(bid, m_blocks, n_tiles):
    """(row block, output tile) of CTA ``bid`` in panels of ``GROUP_M`` row blocks."""
    import tilelang.language as T

    per_panel = GROUP_M * n_tiles
    panel = bid // per_panel
    in_panel = bid % per_panel
    panel_m = T.min(GROUP_M, m_blocks - panel * GROUP_M)
    return panel * GROUP_M + in_panel % panel_m, in_panel // panel_m


def _gate_up_program(
    experts, inter, hidden, dtype, block_m, block_n, block_k, stages, threads, fixed_steps=False
):
    """``fixed_steps``: every CTA runs the whole loop (a trip count known when compiling),
    for a caller that launches only the blocks holding rows (bench.moe_gemm_probe)."""
    import tilelang.language as T

    accum = "float32"
    rows = T.dynamic("rows")
    m_blocks = T.dynamic("m_blocks")
    n_tiles = inter // block_n

    @T.prim_func
    def main(
        X: T.Tensor([rows, hidden], dtype),
        W13: T.Tensor([experts, 2 * inter, hidden], dtype),
        block_expert: T.Tensor([m_blocks], "int32"),
        Out: T.Tensor([rows, inter], dtype),
    ):
        with T.Kernel(m_blocks * n_tiles, threads=threads) as bid:
            a_s = T.alloc_shared([block_m, block_k], dtype)
            wg_s = T.alloc_shared([block_n, block_k], dtype)
            wu_s = T.alloc_shared([block_n, block_k], dtype)
            acc_g = T.alloc_fragment([block_m, block_n], accum)
            acc_u = T.alloc_fragment([block_m, block_n], accum)
            h = T.alloc_fragment([block_m, block_n], dtype)

            mb, nb = _tile_of(bid, m_blocks, n_tiles)
            expert = block_expert[mb]
            e = T.min(expert, experts - 1)
            steps = (
                hidden // block_k
                if fixed_steps
                else T.if_then_else(expert < experts, hidden // block_k, 0)
            )
            T.clear(acc_g)
            T.clear(acc_u)
            for k in T.Pipelined(steps, num_stages=stages):
                T.copy(X[mb * block_m, k * block_k], a_s)
                T.copy(W13[e, nb * block_n, k * block_k], wg_s)
                T.copy(W13[e, inter + nb * block_n, k * block_k], wu_s)
                T.gemm(a_s, wg_s, acc_g, transpose_B=True)
                T.gemm(a_s, wu_s, acc_u, transpose_B=True)
            for i, j in T.Parallel(block_m, block_n):
                h[i, j] = T.cast(acc_g[i, j] / (1.0 + T.exp(-acc_g[i, j])) * acc_u[i, j], dtype)
            T.copy(h, Out[mb * block_m, nb * block_n])

    return main


def _down_program(experts, hidden, inter, dtype, block_m, block_n, block_k, stages, threads):
    import tilelang.language as T

    accum = "float32"
    rows = T.dynamic("rows")
    m_blocks = T.dynamic("m_blocks")
    n_tiles = hidden // block_n

    @T.prim_func
    def main(
        Hs: T.Tensor([rows, inter], dtype),
        W2: T.Tensor([experts, hidden, inter], dtype),
        block_expert: T.Tensor([m_blocks], "int32"),
        row_weights: T.Tensor([rows], accum),
        Y: T.Tensor([rows, hidden], dtype),
    ):
        with T.Kernel(m_blocks * n_tiles, threads=threads) as bid:
            a_s = T.alloc_shared([block_m, block_k], dtype)
            w_s = T.alloc_shared([block_n, block_k], dtype)
            acc = T.alloc_fragment([block_m, block_n], accum)
            out = T.alloc_fragment([block_m, block_n], dtype)

            mb, nb = _tile_of(bid, m_blocks, n_tiles)
            expert = block_expert[mb]
            e = T.min(expert, experts - 1)
            steps = T.if_then_else(expert < experts, inter // block_k, 0)
            T.clear(acc)
            for k in T.Pipelined(steps, num_stages=stages):
                T.copy(Hs[mb * block_m, k * block_k], a_s)
                T.copy(W2[e, nb * block_n, k * block_k], w_s)
                T.gemm(a_s, w_s, acc, transpose_B=True)
            for i, j in T.Parallel(block_m, block_n):
                out[i, j] = T.cast(acc[i, j] * row_weights[mb * block_m + i], dtype)
            T.copy(out, Y[mb * block_m, nb * block_n])

    return main


_KERNELS = KernelCache()


@dataclass(frozen=True)
class MoEAlignment:
    """The pairs in expert order, padded per expert to whole blocks (module docstring)."""

    sorted_ids: torch.Tensor  # [rows] int32: the pair (t * K + k) in each row; T*K = padding
    block_expert: torch.Tensor  # [rows // block_m] int32: each block's expert; E = no expert
    row_of_pair: torch.Tensor  # [T*K] int64: the row of each pair (sorted_ids' inverse)
    block_m: int

    @property
    def rows(self) -> int:
        return self.sorted_ids.shape[0]


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the padded order can need at most (every expert's run padded to a block)."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return math.ceil(rows / block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the pairs of ``topk_ids [T, K]`` by expert, each expert's run starting on a
    block of ``block_m`` rows. Torch ops only, no host synchronisation (any device)."""
    flat = topk_ids.flatten().long()
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = flat.argsort(stable=True)
    experts = flat[order]
    rank = torch.arange(pairs, device=device) - start[experts]
    rows = max_rows(pairs, num_experts, block_m)
    sorted_ids = torch.full((rows,), pairs, dtype=torch.int32, device=device)
    placed = padded_start[experts] + rank
    sorted_ids[placed] = order.to(torch.int32)
    row_of_pair = torch.empty_like(placed).scatter_(0, order, placed)
    block_starts = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return MoEAlignment(sorted_ids, block_expert, row_of_pair, block_m)


def fused_moe_supported(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """True when ``fused_moe`` takes these operands (device, dtypes, shapes)."""
    if not (hidden.dim() == 2 and w13.dim() == 3 and w2.dim() == 3):
        return False
    experts, two_inter, width = w13.shape
    inter = two_inter // 2
    return (
        kernels_usable(hidden.device)
        and hidden.dtype in ATTENTION_DTYPES
        and w13.dtype == hidden.dtype
        and w2.dtype == hidden.dtype
        and width == hidden.shape[1]
        and tuple(w2.shape) == (experts, width, inter)
        and two_inter % 2 == 0
        and width % 16 == 0
        and inter % 16 == 0
        and w13.is_contiguous()
        and w2.is_contiguous()
    )


def fused_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    block_m: int | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum per token (module docstring): ``hidden [T, H]``,
    ``topk_ids [T, K]`` (any integer dtype), ``topk_weights [T, K]`` → ``[T, H]`` in
    ``hidden``'s dtype. ``block_m`` overrides the rows per block (benchmarks)."""
    check_tensor("w13", w13, dtype=ATTENTION_DTYPES, ndim=3, device=hidden.device)
    check_tensor("w2", w2, dtype=w13.dtype, ndim=3, device=hidden.device)
    if not fused_moe_supported(hidden, w13, w2):
        raise ValueError(
            f"fused_moe takes hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] (bf16/fp16 on "
            f"CUDA, H and I multiples of 16); got {tuple(hidden.shape)}, {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}"
        )
    tokens, top_k = topk_ids.shape
    experts, width = w13.shape[0], w13.shape[2]
    if tokens == 0:
        return hidden.new_zeros(0, width)
    pairs = tokens * top_k
    block_m = block_m or block_m_for(pairs, experts)
    gate_up_cfg, down_cfg = kernel_configs(experts, width, w2.shape[2], hidden.dtype, block_m)
    align = moe_align(topk_ids, experts, block_m)
    pair_of_row = align.sorted_ids.clamp(max=pairs - 1)  # padding rows: any pair, never read back
    x = hidden.contiguous().index_select(0, pair_of_row // top_k)
    h = torch.empty(align.rows, w2.shape[2], dtype=hidden.dtype, device=hidden.device)
    _KERNELS.get(gate_up_cfg, grouped_gemm_build)(x, w13, align.block_expert, h)
    y = torch.empty(align.rows, width, dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.flatten().float()[pair_of_row]  # each row's routing weight
    _KERNELS.get(down_cfg, grouped_gemm_build)(h, w2, align.block_expert, weights, y)
    return sum_pairs(y, align.row_of_pair, top_k, hidden.dtype)  # via (token, k) order


@functools.cache
def grouped_mm_available(device_index: int) -> bool:
    """Whether ``torch._grouped_mm`` exists and runs on that GPU (Hopper or newer)."""
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device_index) >= (
        9,
        0,
    )


def sort_pairs(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, k) pairs sorted by expert for a grouped product, on the device: their
    ``order`` (pair ``order[i]`` is row ``i``; its token ``order[i] // k``), the
    ``inverse`` order (back to (token, k) order) and each expert's end row (``offsets``,
    int32 cumulative counts, the grouped products' ``offs``)."""
    flat = topk_ids.flatten().long()
    order = flat.argsort(stable=True)
    inverse = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device)
    )
    counts = torch.zeros(num_experts, dtype=torch.int32, device=topk_ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, inverse, counts.cumsum(0, dtype=torch.int32)


def sum_pairs(y: torch.Tensor, inverse: torch.Tensor, top_k: int, dtype: torch.dtype):
    """Each token's sum of its pairs' rows ``y`` (in expert order; ``sort_pairs``'s
    ``inverse`` takes them back to (token, k) order, so the sum is deterministic), in
    float32, returned in ``dtype``: [T, H]."""
    per_pair = y.index_select(0, inverse)
    return per_pair.view(-1, top_k, y.shape[1]).sum(dim=1, dtype=torch.float32).to(dtype)


def grouped_mm_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """``fused_moe``'s function through torch's own grouped GEMM (``torch._grouped_mm``):
    the pairs sorted by expert, one grouped product per projection over the experts' row
    offsets, SiLU-and-mul between them with each pair's routing weight applied to its row
    there (``kernels.activation.silu_and_mul``'s ``row_scale`` on CUDA; half the bytes of
    the down product's output), then the pairs gathered
    back into (token, k) order and summed per token in float32 as ``fused_moe`` does. No
    host synchronisation. Writing the pairs back by index (``out[order] = y``) took 7.4 of
    a 16k-token prefill's 30 ms; the gather by the inverse order takes ~1
    (bench/results/moe_prefill_parts_h200.json)."""
    top_k = topk_ids.shape[1]
    order, inverse, offsets = sort_pairs(topk_ids, w13.shape[0])
    token_of = order // top_k
    gate_up = torch._grouped_mm(hidden[token_of], w13.transpose(1, 2), offs=offsets)
    weights = topk_weights.flatten()[order].float()
    if kernels_usable(hidden.device):
        h = silu_and_mul(gate_up, row_scale=weights)  # one pass, one rounding
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate).mul_(up).mul_(weights[:, None].to(gate.dtype))
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets)
    return sum_pairs(y, inverse, top_k, hidden.dtype)


def moe_experts_cuda(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The faster of the two grouped GEMMs for this many pairs, as measured on the H200 at
    DeepSeek-V3's shape (bench/results/mla_moe_h200.json): the TileLang kernel while its
    16-row blocks serve, up to 24 pairs per expert on average (decode: 1 / 64 / 256 tokens
    0.27 / 4.9 / 5.7 ms, 63-98 % of the chosen experts' weights at the copy rate, against
    torch's 0.35 / 6.3 / 7.1; 512 tokens 6.7 against 7.1, and at 1,024 torch's 7.3 against
    9.7), torch's grouped GEMM above where it exists (prefill: 4k tokens 10.8 ms against
    17.3, 16k 25.3 against 39.8). Both are free of host synchronisation."""
    pairs, experts = topk_ids.numel(), w13.shape[0]
    if block_m_for(pairs, experts) > 16 and grouped_mm_available(hidden.device.index or 0):
        return grouped_mm_moe(hidden, topk_ids, topk_weights, w13, w2)
    return fused_moe(hidden, topk_ids, topk_weights, w13, w2)


def fp8_grouped_moe_supported(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> bool:
    """True when ``fp8_grouped_moe`` takes these operands: bf16 tokens on a Hopper GPU
    with TileLang, e4m3 weights of matching shapes, widths multiples of 16."""
    if not (hidden.dim() == 2 and w13.dim() == 3 and w2.dim() == 3):
        return False
    experts, two_inter, width = w13.shape
    return (
        kernels_usable(hidden.device)
        and hidden.dtype == torch.bfloat16
        and w13.dtype == FP8
        and w2.dtype == FP8
        and hasattr(torch, "_scaled_grouped_mm")
        and grouped_mm_available(hidden.device.index or 0)
        and width == hidden.shape[1]
        and tuple(w2.shape) == (experts, width, two_inter // 2)
        and width % 16 == 0
        and two_inter % 32 == 0
    )


def fp8_grouped_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
) -> torch.Tensor:
    """``grouped_mm_moe`` with FP8 products: ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in e4m3
    with a float32 scale per output channel (``w13_scale [E, 2I]``, ``w2_scale [E, H]``:
    ``kernels.fp8``'s rows), the tokens quantized the same way per row
    (``kernels.fp8.quantize_rows``) before the sort, and SiLU-and-mul writing FP8 rows
    for the down product (``silu_and_mul_fp8``, the routing weight applied before its
    scale is taken); both products are ``torch._scaled_grouped_mm`` with fast
    accumulation, out in bf16. ``fp8_moe_ref`` is its function in float32. No host
    synchronisation."""
    top_k = topk_ids.shape[1]
    order, inverse, offsets = sort_pairs(topk_ids, w13.shape[0])
    xq, xs = quantize_rows(hidden.contiguous())
    token_of = order // top_k
    gate_up = torch._scaled_grouped_mm(
        xq[token_of], w13.transpose(1, 2), xs[token_of], w13_scale, offs=offsets,
        out_dtype=torch.bfloat16, use_fast_accum=True,
    )  # fmt: skip
    hq, hs = silu_and_mul_fp8(gate_up, topk_weights.flatten()[order].float())
    y = torch._scaled_grouped_mm(
        hq, w2.transpose(1, 2), hs, w2_scale, offs=offsets, out_dtype=torch.bfloat16,
        use_fast_accum=True,
    )  # fmt: skip
    return sum_pairs(y, inverse, top_k, hidden.dtype)


def fp8_moe_ref(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
) -> torch.Tensor:
    """``fp8_grouped_moe``'s function in float32 torch ops on any device, expert by expert:
    the tokens and SiLU-and-mul's output rounded to FP8 rows as there, every product and
    sum in float32. Returns float32 [T, H]."""
    x = dequantize_rows(*quantize_rows_ref(hidden))
    out = torch.zeros(hidden.shape[0], w13.shape[2], dtype=torch.float32, device=hidden.device)
    inter = w2.shape[2]
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = x[token] @ dequantize_rows(w13[expert], w13_scale[expert]).T
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        h = dequantize_rows(*quantize_rows_ref(h * topk_weights[token, slot, None].float()))
        out.index_add_(0, token, h @ dequantize_rows(w2[expert], w2_scale[expert]).T)
    return out


def fused_moe_ref(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The same function in float32 torch ops, expert by expert; returns float32 [T, H]."""
    out = torch.zeros(hidden.shape[0], w13.shape[2], dtype=torch.float32, device=hidden.device)
    inter = w2.shape[2]
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        x = hidden[token].float()
        gate_up = x @ w13[expert].float().T
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = h @ w2[expert].float().T
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out
