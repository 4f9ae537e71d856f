"""Host arrays on their way to a step's device tensors: several index arrays in one copy
(``device_indices``), block tables padded in one pass (``padded_tables``), a step's
inputs built a chunk at a time (``step_inputs``)."""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.base import ALIGN_BYTES, device_arrays, device_indices, padded_tables


def test_device_indices_gives_each_array_back_in_its_shape():
    a, b, c, d = device_indices(torch.device("cpu"), [3, 1, 2], np.arange(6).reshape(2, 3),
                                [], [[7], [8]])  # fmt: skip
    assert a.tolist() == [3, 1, 2] and a.dtype == torch.long
    assert b.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert c.shape == (0,)
    assert d.tolist() == [[7], [8]]
    a[0] = 9  # a view of the one copy: writing it leaves the others as they were
    assert b.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_each_array_of_a_packed_copy_starts_aligned():
    arrays = device_arrays(torch.device("cpu"), np.int32, [1, 2, 3], [[4], [5]], [], [6] * 17)
    base = arrays[0].data_ptr()
    assert all((a.data_ptr() - base) % ALIGN_BYTES == 0 for a in arrays if a.numel())
    assert [a.tolist() for a in arrays] == [[1, 2, 3], [[4], [5]], [], [6] * 17]
    assert all(a.dtype == torch.int32 for a in arrays)


def test_padded_tables_pads_with_the_null_block_to_the_width_asked():
    tables = [[4, 5, 6], [7], [], [8, 9]]
    assert padded_tables(tables).tolist() == [[4, 5, 6], [7, 0, 0], [0, 0, 0], [8, 9, 0]]
    assert padded_tables(tables, 5)[:, 3:].tolist() == [[0, 0]] * 4
    assert padded_tables([]).shape == (0, 1)
    assert padded_tables(tables).dtype == np.int32


def test_step_inputs_of_mixed_chunks_match_a_row_by_row_reading():
    """A prompt chunk that does not sample, one that does, a decode row and a row with
    drafts: every row's id, position, slot, and the sampled rows, as read off each chunk."""
    from engine.plan import ScheduledChunk
    from engine.runner import step_inputs

    bs = 4
    chunks = [
        ScheduledChunk("a", [11, 12, 13, 14, 15], 0, [3, 9], sample=False),
        ScheduledChunk("b", [21, 22, 23], 6, [5, 6, 1], sample=True),
        ScheduledChunk("c", [31], 9, [2, 8, 7], sample=True),
        ScheduledChunk("d", [41, 42, 43], 2, [4, 10], sample=True, num_draft=2),
    ]
    inputs, host_ids = step_inputs(chunks, bs, torch.device("cpu"))
    ids, positions, slots, sampled, row = [], [], [], [], 0
    for c in chunks:
        for j, token in enumerate(c.token_ids):
            pos = c.start_pos + j
            ids.append(token)
            positions.append(pos)
            slots.append(c.block_ids[pos // bs] * bs + pos % bs)
            if c.sample and j >= c.num_tokens - (c.num_draft + 1):
                sampled.append(row)
            row += 1
    meta = inputs.meta
    assert host_ids.tolist() == ids == inputs.input_ids.tolist()
    assert inputs.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    assert inputs.sample_rows.tolist() == sampled == [7, 8, 9, 10, 11]
    assert inputs.sample_ids == ["b", "c", "d"]
    assert meta.query_start_loc.tolist() == [0, 5, 8, 9, 12]
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [5, 9, 10, 5]
    assert meta.query_lens_cpu == [5, 3, 1, 3] and meta.max_query_len == 5
    assert meta.max_seq_len == 10
    assert meta.block_tables.tolist() == [[3, 9, 0], [5, 6, 1], [2, 8, 7], [4, 10, 0]]
    assert meta.block_tables.dtype == meta.seq_lens.dtype == torch.int32
    assert inputs.input_ids.dtype == meta.slot_mapping.dtype == torch.long
