"""``engine.spec.chain``: drafting several requests one token at a time, each to its own
depth, with the device read back once at the end."""

from __future__ import annotations

import warnings

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.spec.chain import ChainStart, confidences, launch_chain

VOCAB = 40


def toy(device: str):
    """A next-token table (logits of the token after each token) and first logits."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, VOCAB + 3, generator=g).to(device)  # 3 padded columns
    first = torch.randn(4, VOCAB + 3, generator=g).to(device)
    return table, first


STARTS = [ChainStart(2, 10, 5, 100), ChainStart(0, 20, 3, 100), ChainStart(3, 30, 5, 32),
          ChainStart(1, 7, 1, 100)]  # fmt: skip


def reference(table, first, config):
    """Each start on its own: follow the table from its row's argmax for min(room, slots
    left) drafts (a draft at position p needs p < limit to feed the next one)."""
    out = []
    for s in STARTS:
        logits, tokens, conf = first[s.row, :VOCAB], [], []
        for depth in range(s.room):
            token = int(logits.argmax())
            tokens.append(token)
            conf.append(confidences(logits[None], torch.tensor([token]).to(logits.device),
                                    config.temperature(depth)).item())  # fmt: skip
            if s.position + depth >= s.limit:
                break
            logits = table[token, :VOCAB]
        out.append((tokens, conf))
    return out


def run_chain(table, first, config):
    calls = []

    def forward(active, tokens, positions):
        calls.append((list(active), list(positions)))
        return table[tokens]

    return launch_chain(config, first, STARTS, forward, VOCAB).to_host(), calls


def test_each_request_drafts_to_its_own_depth_as_if_alone():
    table, first = toy("cpu")
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    drafted, calls = run_chain(table, first, config)
    want = reference(table, first, config)
    assert [t for t, _ in drafted] == [t for t, _ in want]
    for (_, got), (_, exp) in zip(drafted, want):
        assert got == pytest.approx(exp, rel=1e-6)
    assert [len(t) for t, _ in drafted] == [5, 3, 3, 1]  # room 5; room 3; slots to 32; room 1
    assert calls[0] == ([0, 1, 2], [10, 20, 30])  # depth 1 of those with room and slots
    assert calls[-1] == ([0], [13])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_chain_reads_the_device_back_once_whatever_its_depth():
    table, first = toy("cuda")
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    run_chain(table, first, config)  # warm up
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            drafted, _ = run_chain(table, first, config)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 2, [str(w.message) for w in syncs]  # tokens, then confidences
    assert [t for t, _ in drafted] == [t for t, _ in reference(table, first, config)]
