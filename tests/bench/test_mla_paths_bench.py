"""``bench.mla_paths`` on the CPU at a toy width: both MLA paths of a chunk agree, and each
point is timed."""

from __future__ import annotations

import argparse

import pytest

from bench.mla_paths import point


@pytest.mark.parametrize("queries", [1, 5])
def test_both_mla_paths_of_a_chunk_agree_and_are_timed(queries):
    args = argparse.Namespace(device="cpu", dtype="float32", heads=2, block=16, repeats=1,
                              calls=1)  # fmt: skip
    p = point(args, context=40, queries=queries)
    assert p["rel_err"] < 1e-5
    assert p["decompressed_ms"] > 0 and p["absorbed_ms"] > 0
