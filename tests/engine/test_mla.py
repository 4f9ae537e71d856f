"""MLA's pieces on their own: absorbed decode over the paged latent cache equals attention
over decompressed keys and values; YaRN frequencies, attention factor and softmax scale,
and DeepSeek's interleaved rotary, equal transformers' (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from engine.attention import build_backend
from engine.attention.base import AttentionMetadata
from engine.attention.torch_mla import TorchMLABackend, absorbed_max_query
from engine.config import MLAConfig, ModelConfig, RopeScaling
from engine.models.rotary import (
    RotaryEmbedding,
    softmax_mscale,
    yarn_attention_factor,
    yarn_inv_freq,
)
from kvstore.layout import KVCache, KVCacheLayout

MLA = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)
HEADS, BLOCK = 4, 4


def _step(query_lens: list[int], seq_lens: list[int], num_blocks: int = 64, seed: int = 0):
    """A cache of random latents and a step of ``query_lens[i]`` new tokens at the end of
    sequence i's ``seq_lens[i]``, blocks scattered."""
    g = torch.Generator().manual_seed(seed)
    layout = KVCacheLayout.for_mla(1, MLA.kv_lora_rank, MLA.qk_rope_head_dim, BLOCK,
                                   torch.float32)  # fmt: skip
    cache = KVCache(layout, num_blocks, "cpu")
    cache.storage.copy_(torch.randn(cache.shape, generator=g))
    max_blocks = -(-max(seq_lens) // BLOCK)
    blocks = torch.randperm(num_blocks - 1, generator=g)[: len(seq_lens) * max_blocks] + 1
    tables = blocks.view(len(seq_lens), max_blocks).to(torch.int32)
    owner = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens))
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(query_lens, seq_lens)])
    slots = tables[owner, positions // BLOCK].long() * BLOCK + positions % BLOCK
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=slots, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
    )  # fmt: skip
    tokens = sum(query_lens)
    q = torch.randn(tokens, HEADS, MLA.qk_head_dim, generator=g)
    latent = torch.randn(tokens, MLA.latent_dim, generator=g)
    kv_b = torch.randn(HEADS * (MLA.qk_nope_head_dim + MLA.v_head_dim), MLA.kv_lora_rank,
                       generator=g) * 0.2  # fmt: skip
    return cache, meta, q, latent, kv_b


def _decode_batch(seq_lens: list[int], num_blocks: int = 64, seed: int = 0):
    """A cache of random latents and one query per sequence, blocks scattered."""
    return _step([1] * len(seq_lens), seq_lens, num_blocks, seed)


def test_build_backend_gives_mla_models_the_mla_backend():
    layout = KVCacheLayout.for_mla(2, 32, 8, BLOCK, torch.float32)
    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                         num_heads=HEADS, num_kv_heads=HEADS, head_dim=24, mla=MLA)  # fmt: skip
    backend = build_backend(KVCache(layout, 8, "cpu"), config, 0.1, "cpu")
    assert isinstance(backend, TorchMLABackend) and backend.mla == MLA


@pytest.mark.parametrize("seq_lens", [[1], [5, 17, 9], [16, 3, 30, 8]])
def test_absorbed_decode_equals_attention_over_decompressed_keys_and_values(seq_lens):
    cache, meta, q, latent, kv_b = _decode_batch(seq_lens)
    backend = TorchMLABackend(cache, HEADS, MLA, scale=0.2)
    absorbed = backend.forward(0, q, latent, kv_b, meta)  # a pure decode step: absorbed
    layer = cache.layers[0]
    assert torch.equal(layer.view(-1, MLA.latent_dim)[meta.slot_mapping], latent)
    decompressed = backend.prefill(layer, q, kv_b, meta)
    assert absorbed.shape == (len(seq_lens), HEADS, MLA.v_head_dim)
    torch.testing.assert_close(absorbed, decompressed, rtol=1e-5, atol=1e-5)


CPU_CAP = absorbed_max_query(torch.device("cpu"))  # 64


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [([1, 3, 70, 1], [9, 90, 70, 33]), ([65, 64, 2], [65, 98, 7]), ([5, 80], [5, 101])],
)
def test_a_mixed_steps_short_sequences_attend_absorbed_as_the_decompressed_path_does(
    query_lens, seq_lens
):
    """Decode rows, verify chunks and short chunks beside a prompt's long chunk take the
    absorbed path, each token a row of its own (``absorbed_max_query``); the result is
    attention over decompressed keys and values, causal within each chunk."""
    cache, meta, q, latent, kv_b = _step(query_lens, seq_lens, num_blocks=128, seed=1)
    backend = TorchMLABackend(cache, HEADS, MLA, scale=0.2)
    short = meta.token_rows(CPU_CAP)
    assert short.others == tuple(i for i, n in enumerate(query_lens) if n > CPU_CAP)
    assert short.leading == {(5, 80): 5}.get(tuple(query_lens), 0)  # short ones first: rows
    assert short.meta.seq_lens_cpu == [s - n + 1 + j for n, s in zip(query_lens, seq_lens)
                                       if n <= CPU_CAP for j in range(n)]  # fmt: skip
    mixed = backend.forward(0, q, latent, kv_b, meta)
    assert meta.token_rows(CPU_CAP) is short  # built once a step
    decompressed = backend.prefill(cache.layers[0], q, kv_b, meta)
    torch.testing.assert_close(mixed, decompressed, rtol=1e-5, atol=1e-5)


def test_a_step_cut_down_to_some_sequences_attends_as_the_whole_step_does():
    """``AttentionMetadata.sequences``: the rows and metadata of some of a step's
    sequences; attending over them gives those rows of the whole step's attention."""
    query_lens, seq_lens = [1, 30, 1, 7], [9, 90, 33, 7]
    cache, meta, q, latent, kv_b = _step(query_lens, seq_lens, num_blocks=128, seed=2)
    backend = TorchMLABackend(cache, HEADS, MLA, scale=0.2)
    backend.forward(0, q, latent, kv_b, meta)  # stores the step's latents
    rows, part = meta.sequences((1, 3))
    assert rows.tolist() == [*range(1, 31), *range(32, 39)]
    assert (part.query_lens_cpu, part.seq_lens_cpu) == ([30, 7], [90, 7])
    assert part.query_start_loc.tolist() == [0, 30, 37]
    assert torch.equal(part.block_tables, meta.block_tables[[1, 3]])
    assert meta.sequences((1, 3)) is meta.sequences((1, 3))  # built once a step
    whole = backend.prefill(cache.layers[0], q, kv_b, meta)
    torch.testing.assert_close(backend.prefill(cache.layers[0], q[rows], kv_b, part), whole[rows])


def _hf_rope_config(rope: dict) -> DeepseekV3Config:
    return DeepseekV3Config(num_hidden_layers=1, max_position_embeddings=163840,
                            rope_parameters=rope)  # fmt: skip


DEEPSEEK_V3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                    "original_max_position_embeddings": 4096}  # fmt: skip
OTHER_ROPE = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "beta_fast": 16,
              "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.8,
              "original_max_position_embeddings": 256}  # fmt: skip


@pytest.mark.parametrize("rope", [DEEPSEEK_V3_ROPE, OTHER_ROPE], ids=["deepseek-v3", "other"])
def test_yarn_frequencies_factor_and_softmax_scale_match_transformers(rope):
    hf = _hf_rope_config(dict(rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = RopeScaling.from_hf(rope, 163840)
    torch.testing.assert_close(yarn_inv_freq(64, rope["rope_theta"], ours), inv_freq)
    assert yarn_attention_factor(ours) == pytest.approx(factor, rel=1e-12)
    hf_scale = hf_ds.yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim**-0.5)
    assert hf.qk_head_dim**-0.5 * softmax_mscale(ours) ** 2 == pytest.approx(hf_scale)
    assert softmax_mscale(ours) > 1


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_matches_transformers(interleaved):
    hf = _hf_rope_config(dict(OTHER_ROPE))
    hf_rotary = hf_ds.DeepseekV3RotaryEmbedding(hf)
    ours = RotaryEmbedding(64, 1024, 50000.0, RopeScaling.from_hf(OTHER_ROPE, 163840),
                           interleaved=interleaved)  # fmt: skip
    ours.reset_cache()
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 1024, (10,), generator=g)
    q, k = torch.randn(10, 4, 64, generator=g), torch.randn(10, 1, 64, generator=g)
    cos, sin = hf_rotary(q, positions[None])
    apply = hf_ds.apply_rotary_pos_emb_interleave if interleaved else hf_ds.apply_rotary_pos_emb
    hf_q, hf_k = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    our_q, our_k = ours(positions, q, k)
    torch.testing.assert_close(our_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(our_k, hf_k[0].transpose(0, 1))
