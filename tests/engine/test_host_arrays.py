"""Host arrays on their way to a step's device tensors: several index arrays in one copy
(``device_indices``), block tables padded in one pass (``padded_tables``)."""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.base import device_indices, padded_tables


def test_device_indices_gives_each_array_back_in_its_shape():
    a, b, c, d = device_indices(torch.device("cpu"), [3, 1, 2], np.arange(6).reshape(2, 3),
                                [], [[7], [8]])  # fmt: skip
    assert a.tolist() == [3, 1, 2] and a.dtype == torch.long
    assert b.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert c.shape == (0,)
    assert d.tolist() == [[7], [8]]
    a[0] = 9  # a view of the one copy: writing it leaves the others as they were
    assert b.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_padded_tables_pads_with_the_null_block_to_the_width_asked():
    tables = [[4, 5, 6], [7], [], [8, 9]]
    assert padded_tables(tables).tolist() == [[4, 5, 6], [7, 0, 0], [0, 0, 0], [8, 9, 0]]
    assert padded_tables(tables, 5)[:, 3:].tolist() == [[0, 0]] * 4
    assert padded_tables([]).shape == (0, 1)
    assert padded_tables(tables).dtype == np.int32
