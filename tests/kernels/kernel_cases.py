"""Random paged-attention problems shared by the reference tests and the CUDA sweeps.

Contexts are written densely first and then scattered into shuffled cache blocks, so a
test can check the paged readers against attention over the dense tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class PagedProblem:
    """B sequences over one layer's cache; ``k[b]``/``v[b]`` are the dense contexts."""

    q: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [num_blocks, block_size, 2 * Hkv * D]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    k: list[torch.Tensor]  # per sequence [L, Hkv, D]
    v: list[torch.Tensor]
    num_kv_heads: int
    scale: float

    @property
    def query_lens(self) -> list[int]:
        starts = self.query_start_loc.tolist()
        return [b - a for a, b in zip(starts, starts[1:])]


@dataclass
class PagedRows:
    """Dense per-sequence rows scattered into shuffled blocks of one layer's cache."""

    cache: torch.Tensor  # [num_blocks, block_size, width]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    rows: list[torch.Tensor]  # per sequence [L, width]


def scatter_rows(
    seq_lens: list[int],
    width: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    extra_blocks: int = 3,
) -> PagedRows:
    """Random rows per sequence in distinct, shuffled blocks, never block 0 (the null
    block); unused cache rows and blocks hold noise, the tables one padding column."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 1 + sum(needed) + extra_blocks
    cache = torch.randn(num_blocks, block_size, width, generator=gen).to(dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(needed + [1]) + 1  # one padding column of null blocks
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    rows = []
    for b, (length, nb) in enumerate(zip(seq_lens, needed)):
        blocks = [order.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(blocks, dtype=torch.int32)
        seq = torch.randn(length, width, generator=gen).to(dtype)
        flat = cache[blocks].flatten(0, 1) if blocks else cache[:0].flatten(0, 1)
        flat[:length] = seq
        if blocks:
            cache[blocks] = flat.view(nb, block_size, -1)
        rows.append(seq)
    return PagedRows(cache, tables, rows)


def _generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)


def make_problem(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    extra_blocks: int = 3,
    seed: int | None = None,
) -> PagedProblem:
    """Fresh random problem; every sequence's blocks are distinct, shuffled, never block 0."""
    gen = _generator(seed)
    width = num_kv_heads * head_dim
    paged = scatter_rows(seq_lens, 2 * width, block_size, dtype, gen, extra_blocks)
    ks = [kv[:, :width].view(-1, num_kv_heads, head_dim) for kv in paged.rows]
    vs = [kv[:, width:].view(-1, num_kv_heads, head_dim) for kv in paged.rows]
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda t: t.to(device)
    return PagedProblem(
        to(q),
        to(paged.cache),
        to(paged.block_tables),
        to(torch.tensor(seq_lens, dtype=torch.int32)),
        to(starts),
        ks,
        vs,
        num_kv_heads,
        head_dim**-0.5,
    )


@dataclass
class MLAProblem:
    """One absorbed query per sequence over a paged latent cache; ``latents[b]`` dense."""

    q: torch.Tensor  # [B, H, R + P]
    kv_cache: torch.Tensor  # [num_blocks, block_size, R + P]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    latents: list[torch.Tensor]  # per sequence [L, R + P]
    kv_lora_rank: int
    scale: float


def make_mla_problem(
    seq_lens: list[int],
    *,
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int | None = None,
) -> MLAProblem:
    """Fresh random MLA decode problem (blocks as ``make_problem``'s)."""
    gen = _generator(seed)
    width = kv_lora_rank + rope_dim
    paged = scatter_rows(seq_lens, width, block_size, dtype, gen)
    q = torch.randn(len(seq_lens), num_heads, width, generator=gen).to(dtype)
    to = lambda t: t.to(device)
    return MLAProblem(
        to(q),
        to(paged.cache),
        to(paged.block_tables),
        to(torch.tensor(seq_lens, dtype=torch.int32)),
        paged.rows,
        kv_lora_rank,
        (kv_lora_rank // 4 + rope_dim) ** -0.5,  # DeepSeek-V3: (128 + 64) ** -0.5
    )


def dense_mla_attention(p: MLAProblem) -> torch.Tensor:
    """Attention of every head over its sequence's latents (keys [c, k_pe], values c),
    float64 on the CPU: [B, H, R]; zeros for an empty context."""
    batch, heads, _ = p.q.shape
    out = torch.zeros(batch, heads, p.kv_lora_rank, dtype=torch.float64)
    for b, latent in enumerate(p.latents):
        if latent.shape[0]:
            lat = latent.double()
            weights = (p.q[b].cpu().double() @ lat.T * p.scale).softmax(dim=-1)
            out[b] = weights @ lat[:, : p.kv_lora_rank]
    return out


def dense_attention(p: PagedProblem) -> torch.Tensor:
    """Causal attention over the dense contexts, float64 on the CPU: [T, Hq, D]."""
    out = torch.zeros(p.q.shape, dtype=torch.float64)
    q = p.q.cpu().double()
    groups = q.shape[1] // p.num_kv_heads
    start = 0
    for k, v, q_len in zip(p.k, p.v, p.query_lens):
        length = k.shape[0]
        for r in range(q_len):
            pos = length - q_len + r
            kk = k[: pos + 1].double().repeat_interleave(groups, dim=1)  # [pos+1, Hq, D]
            vv = v[: pos + 1].double().repeat_interleave(groups, dim=1)
            scores = (kk * q[start + r][None]).sum(-1) * p.scale  # [pos+1, Hq]
            weights = scores.softmax(dim=0)
            out[start + r] = (weights[..., None] * vv).sum(0)
        start += q_len
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives inf."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
