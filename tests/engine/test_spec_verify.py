"""``Sampler.verify``: greedy drafts kept exactly when they are the argmax, and sampled
tokens distributed as the target's processed distribution (chi-square, many groups in one
call), whatever the drafts are; logprobs stay the raw model's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import chi_square_p, chi_square_two_sample_p

from engine.sampler import DraftGroup, Sampler, SamplingRow, process_logits, target_probs
from engine.sampling_params import SamplingParams

VOCAB = 24
GROUPS = 10_000  # identical groups verified in one call: the samples of one test


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 1.5


def exact(row_logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The distribution plain sampling draws one row's token from (contract steps 1-7)."""
    return target_probs(process_logits(row_logits[None].clone(), [row]), [row])[0]


def verify_many(sampler, rows_logits, params, drafts, history=(), groups=GROUPS):
    """Verify ``groups`` copies of one request's rows; per copy the tokens it yields."""
    k = len(drafts)
    logits = rows_logits.repeat(groups, 1)
    rows = [
        SamplingRow(params, output_token_ids=[*history, *drafts[:j]]) for j in range(k + 1)
    ] * groups
    spans = [DraftGroup(i * (k + 1), list(drafts)) for i in range(groups)]
    out = sampler.verify(logits, rows, None, spans).to_host()
    return [tokens for tokens, _ in out]


def test_greedy_keeps_exactly_the_drafts_that_are_the_argmax():
    sampler = Sampler(VOCAB)
    logits = logits_rows(4, seed=1)
    best = logits.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0)
    for drafts, kept in [
        ([best[0], best[1], best[2]], 3),
        ([best[0], (best[1] + 1) % VOCAB, best[2]], 1),
        ([(best[0] + 1) % VOCAB, best[1], best[2]], 0),
    ]:
        (tokens,) = verify_many(sampler, logits, greedy, drafts, groups=1)
        assert tokens == best[: kept + 1]  # kept drafts, then the argmax where it stopped


CASES = {
    "temperature 1": SamplingParams(temperature=1.0),
    "top-k, logit bias": SamplingParams(temperature=1.0, top_k=6, logit_bias={3: 2.0, 5: -50.0}),
    "top-p, min-p, temperature 0.7": SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.8,
                                presence_penalty=0.5),  # fmt: skip
}


@pytest.mark.parametrize("name", list(CASES))
def test_first_token_follows_the_target_distribution_whatever_the_draft(name):
    params = CASES[name]
    sampler = Sampler(VOCAB, seed=3)
    logits = logits_rows(3, seed=2)
    history = [3, 3, 7]
    q0 = exact(logits[0], SamplingRow(params, output_token_ids=history))
    likely, unlikely = int(q0.argmax()), int(q0.argmin())
    for drafts in ([likely, 4], [unlikely, 4], [9, 9]):
        got = verify_many(sampler, logits, params, drafts, history)
        counts = Counter(t[0] for t in got)
        expected = (q0 * GROUPS).tolist()
        p = chi_square_p([counts[i] for i in range(VOCAB)], expected)
        assert p > 0.01, (drafts, p)


@pytest.mark.parametrize("name", ["temperature 1", "penalties"])
def test_token_after_a_kept_draft_follows_the_next_rows_distribution(name):
    """Given the first draft kept, the second token follows row 1's distribution, which
    sees the draft in its history (penalties count it)."""
    params = CASES[name]
    sampler = Sampler(VOCAB, seed=4)
    logits = logits_rows(3, seed=5)
    q0 = exact(logits[0], SamplingRow(params))
    d1 = int(q0.argmax())  # kept often
    got = verify_many(sampler, logits, params, [d1, 2])
    after = Counter(t[1] for t in got if t[0] == d1)
    q1 = exact(logits[1], SamplingRow(params, output_token_ids=[d1]))
    n = sum(after.values())
    assert n > 2000
    assert chi_square_p([after[i] for i in range(VOCAB)], (q1 * n).tolist()) > 0.01


def test_verified_and_plain_sampling_cannot_be_told_apart():
    params = CASES["top-k, logit bias"]
    logits = logits_rows(2, seed=6)
    spec = Counter(t[0] for t in verify_many(Sampler(VOCAB, seed=7), logits, params, [1]))
    plain_sampler = Sampler(VOCAB, seed=8)
    rows = [SamplingRow(params)] * GROUPS
    plain = Counter(plain_sampler(logits[:1].repeat(GROUPS, 1), rows).token_ids)
    assert chi_square_two_sample_p(spec, plain) > 0.01


def test_a_draft_holding_all_the_mass_is_always_kept():
    sampler = Sampler(VOCAB)
    logits = torch.full((2, VOCAB), -1e4)
    logits[0, 5] = 10.0
    logits[1, 6] = 10.0
    got = verify_many(sampler, logits, SamplingParams(temperature=1.0), [5], groups=200)
    assert all(t == [5, 6] for t in got)


def test_logprobs_are_the_raw_models_at_each_yielded_tokens_row():
    sampler = Sampler(VOCAB)
    logits = logits_rows(3, seed=9)
    best = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=0, logprobs=2, logit_bias={0: 30.0})
    rows = [SamplingRow(params, output_token_ids=[best[0]][:j]) for j in range(3)]
    (tokens, lps), = sampler.verify(logits, rows, None, [DraftGroup(0, [0, 0])]).to_host()
    assert tokens == [0, 0, 0]  # the bias makes 0 the argmax of every processed row
    raw = logits.log_softmax(-1)
    for j, (token, lp) in enumerate(zip(tokens, lps)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[j, token].item(), abs=1e-5)
        assert lp.top_ids == raw[j].topk(2).indices.tolist()  # raw, not biased


def test_groups_must_cover_the_rows():
    sampler = Sampler(VOCAB)
    with pytest.raises(ValueError, match="cover"):
        sampler.verify(logits_rows(3), [SamplingRow(SamplingParams())] * 3, None,
                       [DraftGroup(0, [1])])  # fmt: skip


def test_greedy_groups_verify_alone_as_beside_sampled_groups():
    """A step of greedy groups only takes the argmax path (no distribution, no draws); the
    same groups beside a sampled one take the general path: the same tokens, the same
    counts kept."""
    g = torch.Generator().manual_seed(3)
    penalized = SamplingParams(temperature=0, repetition_penalty=1.4, logit_bias={2: 3.0})
    params = [SamplingParams(temperature=0), penalized] * 12
    groups, rows, row = [], [], 0
    logits = torch.randn(sum(1 + j % 4 for j in range(len(params))), VOCAB, generator=g)
    for j, p in enumerate(params):
        k = j % 4  # 0..3 drafts, half of them the argmax of the raw logits
        best = logits[row : row + k].argmax(-1).tolist()
        drafts = [b if torch.rand(1, generator=g) < 0.6 else (b + 1) % VOCAB for b in best]
        groups.append(DraftGroup(row, drafts))
        rows += [SamplingRow(p, output_token_ids=[5, *drafts[:i]]) for i in range(k + 1)]
        row += k + 1
    alone = Sampler(VOCAB).verify(logits, rows, None, groups)
    sampled = SamplingRow(SamplingParams(temperature=1.0))
    mixed = Sampler(VOCAB).verify(torch.cat((logits, logits_rows(3))), rows + [sampled] * 3,
                                  None, groups + [DraftGroup(row, [1, 2])])  # fmt: skip
    assert alone.kept.tolist() == mixed.kept[:-1].tolist()
    assert 0 < alone.kept.sum() < sum(g.num_draft for g in groups)  # some kept, some not
    assert alone.to_host() == mixed.to_host()[:-1]
