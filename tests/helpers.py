"""Shared test utilities (importable as ``helpers``: tests/ is on sys.path via conftest).

Runs a model over one sequence through the paged KV cache; reads a server's metrics and
waits for its KV block files.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import torch

from engine.attention import build_backend
from engine.attention.base import AttentionMetadata, ForwardContext
from engine.models.base import CausalLM
from kvstore.layout import KVCache


def single_sequence_metadata(
    start: int, num_new: int, block_table: torch.Tensor, block_size: int
) -> AttentionMetadata:
    """Metadata for one sequence whose tokens ``start:start+num_new`` are new this step."""
    seq_len = start + num_new
    device = block_table.device
    positions = torch.arange(start, seq_len, device=device)
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, num_new], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
        block_tables=block_table[None, :].to(torch.int32),
        slot_mapping=slots,
        max_query_len=num_new,
        max_seq_len=seq_len,
        query_lens_cpu=[num_new],
        seq_lens_cpu=[seq_len],
    )


class SequenceRunner:
    """Runs one sequence step by step through a fresh paged KV cache.

    Blocks are handed out in reverse order so the block table is not the identity.
    """

    def __init__(self, model: CausalLM, max_tokens: int, block_size: int = 16) -> None:
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.block_size = block_size
        num_blocks = -(-max_tokens // block_size)
        cache = KVCache(model.kv_layout(block_size, param.dtype), num_blocks + 1, self.device)
        self.backend = build_backend(cache, model.config, model.attention_scale, "cpu", "torch")
        self.block_table = torch.arange(num_blocks, 0, -1, dtype=torch.int32, device=self.device)
        self.num_cached = 0

    @torch.no_grad()
    def step(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed the next tokens; returns their float32 logits [len(token_ids), vocab]."""
        start, size = self.num_cached, len(token_ids)
        meta = single_sequence_metadata(start, size, self.block_table, self.block_size)
        ctx = ForwardContext(meta=meta, backend=self.backend)
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + size, device=self.device)
        hidden = self.model(ids, positions, ctx)
        self.num_cached += size
        return self.model.compute_logits(hidden)


def forward_tokens(
    model: CausalLM,
    token_ids: Sequence[int],
    chunk_sizes: Sequence[int] | None = None,
    block_size: int = 16,
) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float32) of one sequence run in chunks.

    ``chunk_sizes`` split the prompt into steps (default: one step); each step writes its
    k/v into the paged cache and attends over the cached prefix.
    """
    chunk_sizes = list(chunk_sizes or [len(token_ids)])
    if sum(chunk_sizes) != len(token_ids):
        raise ValueError("chunk_sizes must add up to the number of tokens")
    runner = SequenceRunner(model, len(token_ids), block_size)
    outputs, start = [], 0
    for size in chunk_sizes:
        outputs.append(runner.step(token_ids[start : start + size]))
        start += size
    return torch.cat(outputs)


def greedy_generate(
    model: CausalLM, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (prefill once, then one token per step)."""
    runner = SequenceRunner(model, len(prompt_ids) + max_new_tokens)
    logits = runner.step(prompt_ids)
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(logits[-1].argmax())
        out.append(token)
        if token in stop_ids:
            break
        logits = runner.step([token])
    return out


def hf_named_weights(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """A Llama-family model's parameters under Hugging Face names (fused q/k/v and
    gate/up split back into their parts)."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, param in model.named_parameters():
        if ".qkv_proj." in name:
            for part, chunk in zip("qkv", param.split([q, kv, kv]), strict=True):
                yield name.replace(".qkv_proj.", f".{part}_proj."), chunk
        elif ".gate_up_proj." in name:
            for part, chunk in zip(("gate", "up"), param.chunk(2), strict=True):
                yield name.replace(".gate_up_proj.", f".{part}_proj."), chunk
        else:
            yield name, param


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def default_gguf() -> Path:
    """The default model's GGUF file."""
    from engine.loader import default_model_path

    return default_model_path()


def metric(server, name: str, **labels: str) -> float:
    """The value of one series on ``server``'s ``/metrics``."""
    body = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name + (f"{{{sel}}}" if sel else "")) + r" ([0-9.e+]+)"
    match = re.search(pattern, body)
    assert match, f"{name} {labels} not in /metrics"
    return float(match.group(1))


def wait_for_files(kv_dir: Path, count: int, timeout: float = 60.0) -> None:
    """Wait until the file tier under ``kv_dir`` holds ``count`` block files."""
    deadline = time.monotonic() + timeout
    while len(list(kv_dir.rglob("*.kv"))) < count:
        assert time.monotonic() < deadline, f"fewer than {count} block files in {kv_dir}"
        time.sleep(0.2)


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ferry_command() -> list[str]:
    """The ``ferry`` command of this environment (its console script, else the module)."""
    script = Path(sys.executable).with_name("ferry")
    return [str(script)] if script.exists() else [sys.executable, "-m", "server.cli"]


# -- chi-square tests (no scipy here) ----------------------------------------------------------


def _upper_gamma(a: float, x: float) -> float:
    """The regularised upper incomplete gamma function Q(a, x) (series below a + 1, a
    continued fraction above, as in Numerical Recipes' ``gammq``)."""
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b, c, d = x + 1 - a, 1 / tiny, 1 / (x + 1 - a)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def chi_square_p(observed: Sequence[float], expected: Sequence[float], min_expected=5.0) -> float:
    """p-value of observed counts against expected counts (cells expected below
    ``min_expected`` are pooled into one)."""
    cells, pool_o, pool_e = [], 0.0, 0.0
    for o, e in zip(observed, expected, strict=True):
        if e < min_expected:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            cells.append((o, e))
    if pool_e > 0:
        cells.append((pool_o, pool_e))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return _upper_gamma((len(cells) - 1) / 2, stat / 2)


def chi_square_two_sample_p(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """p-value that counts ``a`` and ``b`` come from one distribution (a 2 x k contingency
    table; categories expected below ``min_expected`` in either row are pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    rows, pool = [], [0, 0]
    for k in keys:
        total = a[k] + b[k]
        if min(total * na, total * nb) / (na + nb) < min_expected:
            pool[0] += a[k]
            pool[1] += b[k]
        else:
            rows.append((a[k], b[k]))
    if sum(pool):
        rows.append(tuple(pool))
    stat = 0.0
    for oa, ob in rows:
        total = oa + ob
        for o, n in ((oa, na), (ob, nb)):
            e = total * n / (na + nb)
            stat += (o - e) ** 2 / e
    return _upper_gamma((len(rows) - 1) / 2, stat / 2)
