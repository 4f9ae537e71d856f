"""Steps with prompt tokens through the piecewise graph buffers (``engine.piecewise_graphs``).

On the CPU the pieces run eagerly (``capture=False``): the padding rows, the staged
attention inputs, the bucket choice and which steps take the path are the same code as on
CUDA. The CUDA tests capture the pieces and replay them; they are skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from engine.piecewise_graphs import token_buckets
from engine.plan import NewRequest, ScheduledChunk, StepPlan
from engine.runner import ModelRunner
from tests.engine.test_cuda_graphs import (
    GREEDY,
    PRESETS,
    generate,
    make_runner,
    needs_cuda,
    prompts,
)

BLOCK = 16


def test_token_buckets_end_at_the_largest_step():
    assert token_buckets(512) == (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                                  288, 320, 352, 384, 416, 448, 480, 512)  # fmt: skip
    assert token_buckets(300) == (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 288,
                                  300)  # fmt: skip
    assert token_buckets(64, (16, 32, 64, 128)) == (16, 32, 64)
    assert token_buckets(8) == (8,)
    assert token_buckets(0) == ()


def mixed_steps_logits(runner: ModelRunner, lengths: list[int], new: int) -> list[torch.Tensor]:
    """Logits of three steps: the prompts of ``lengths`` prefilled together, then each
    decodes one token beside a ``new``-token prompt's first chunk, then beside its
    second (two mixed steps)."""
    vocab = runner.sampler.vocab_size
    batch = prompts(vocab, [*lengths, 2 * new], seed=3)
    ids = [f"q{i}" for i in range(len(batch))]
    per_seq = -(-(max(map(len, batch)) + 4) // BLOCK)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(batch))]
    requests = [NewRequest(r, p, GREEDY, ()) for r, p in zip(ids, batch)]
    old = range(len(lengths))
    plan = StepPlan(chunks=[ScheduledChunk(ids[i], batch[i], 0, tables[i], True) for i in old],
                    new_requests=requests)  # fmt: skip
    out = []
    with torch.inference_mode():
        for step in range(3):
            runner._sync_states(plan)
            logits, _ = runner._logits(plan)
            out.append(logits.float())
            tokens = logits.argmax(-1).tolist()
            last = ids[-1]
            chunks = [ScheduledChunk(ids[i], [tokens[i]], lengths[i] + step, tables[i], True)
                      for i in old]  # fmt: skip
            if step < 2:  # the new prompt's chunk: sampled at its last one
                part = batch[-1][step * new : (step + 1) * new]
                chunks.insert(1, ScheduledChunk(last, part, step * new, tables[-1], step == 1))
            plan = StepPlan(chunks=chunks)
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_padded_mixed_steps_match_eager_steps_on_cpu(preset):
    eager, _ = make_runner(preset=preset)
    padded, _ = make_runner(preset=preset)
    pieces = padded.capture_piecewise_graphs(64, buckets=(16, 32, 64), capture=False)
    calls = []
    run = pieces.run
    pieces.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    expected = mixed_steps_logits(eager, [5, 17], new=9)
    got = mixed_steps_logits(padded, [5, 17], new=9)
    assert calls == [22, 11, 11]  # 22 prompt tokens, then 2 decode rows + 9 prompt tokens
    assert pieces.bucket_for(22) == 32 and pieces.bucket_for(11) == 16
    for a, b in zip(got, expected):
        assert ((a - b).norm() / b.norm()).item() < 1e-5


@pytest.mark.parametrize("preset", PRESETS)
def test_padding_rows_write_no_kv(preset):
    runner, cache = make_runner(preset=preset)
    runner.capture_piecewise_graphs(64, buckets=(16, 32, 64), capture=False)
    before = cache.storage.clone()
    generate(runner, prompts(runner.sampler.vocab_size, [20, 9, 3]), 3)  # a 32-token bucket
    changed = (cache.storage != before).any(-1).any(0)  # [num_blocks, block_size]
    used = torch.zeros_like(changed)
    for i, n in enumerate([20, 9, 3]):  # sequence i owns blocks 1 + 2i, 2 + 2i
        for pos in range(n + 2):
            used[1 + 2 * i + pos // BLOCK, pos % BLOCK] = True
    assert not (changed & ~used).any()
    assert not changed[0].any()  # not even the null block: padding never reaches attention


def test_steps_past_the_largest_bucket_run_eagerly():
    eager, _ = make_runner()
    padded, _ = make_runner()
    pieces = padded.capture_piecewise_graphs(32, buckets=(16, 32), capture=False)
    calls = []
    run = pieces.run
    pieces.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    batch = prompts(eager.sampler.vocab_size, [40, 3])  # a 43-token prefill, then decode
    assert generate(padded, batch, 4) == generate(eager, batch, 4)
    assert calls == [2, 2, 2]  # the 43-token prefill ran eagerly, the decode steps padded


@needs_cuda
@pytest.mark.parametrize("preset", ["smollm2-135m", "deepseek-v3-tiny"])
def test_cuda_piecewise_mixed_steps_match_eager(preset):
    eager, _ = make_runner("cuda", torch.bfloat16, blocks=512, preset=preset)
    graphed, _ = make_runner("cuda", torch.bfloat16, blocks=512, preset=preset)
    pieces = graphed.capture_piecewise_graphs(128, buckets=(16, 32, 64, 128))
    assert pieces.captured
    for a, b in zip(mixed_steps_logits(graphed, [5, 70, 33], new=40),
                    mixed_steps_logits(eager, [5, 70, 33], new=40)):  # fmt: skip
        assert ((a - b).norm() / b.norm()).item() < 1e-2


@needs_cuda
def test_cuda_piecewise_prefills_generate_as_eager():
    eager, _ = make_runner("cuda", torch.bfloat16, blocks=512)
    graphed, _ = make_runner("cuda", torch.bfloat16, blocks=512)
    graphed.capture_piecewise_graphs(256)
    graphed.capture_decode_graphs(max_batch=8, max_seq_len=1024)
    batch = prompts(eager.sampler.vocab_size, [12, 150, 7])
    assert generate(graphed, batch, 16) == generate(eager, batch, 16)


def test_padding_metadata_is_a_prompt_over_the_null_block():
    """``AttentionMetadata.over_null_block``: the step the runner would build for a prompt
    of zeros whose every block is block 0."""
    from engine.attention.base import AttentionMetadata
    from engine.runner import step_inputs

    for tokens in (5, 16, 40):
        chunk = ScheduledChunk("p", [0] * tokens, 0, [0] * -(-tokens // BLOCK), sample=False)
        want = step_inputs([chunk], BLOCK, torch.device("cpu"))[0].meta
        got = AttentionMetadata.over_null_block(tokens, BLOCK, "cpu")
        for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert (got.max_query_len, got.max_seq_len, got.query_lens_cpu, got.seq_lens_cpu) == (
            want.max_query_len, want.max_seq_len, want.query_lens_cpu, want.seq_lens_cpu)
