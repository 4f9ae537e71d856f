"""The sampler: each processing step, the filters, logprobs and per-request reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import (
    PendingTokens,
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_p,
    distinct_ids,
    process_logits,
)
from engine.sampling_params import SamplingParams

VOCAB = 32


def row(generator: torch.Generator | None = None, **params) -> SamplingRow:
    prompt = params.pop("prompt", ())
    output = params.pop("output", ())
    eos = params.pop("eos", ())
    return SamplingRow(SamplingParams(**params), generator, prompt, output, eos)


def seeded(seed: int, **params) -> SamplingRow:
    return row(torch.Generator().manual_seed(seed), **params)


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


def draws(logits: torch.Tensor, n: int, **params) -> torch.Tensor:
    """``n`` independent samples from one row of logits, as a tensor of token ids."""
    out = Sampler(logits.shape[-1], seed=1)(logits.expand(n, -1), [row(**params)] * n)
    return torch.tensor(out.token_ids)


# -- greedy and temperature ---------------------------------------------------------------------


def test_greedy_takes_argmax_with_ties_to_lowest_id():
    logits = torch.randn(5, VOCAB)
    logits[4, 7] = logits[4, 11] = logits[4].max() + 1.0
    out = Sampler(VOCAB)(logits, [row(temperature=0.0)] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[4] == 7


def test_top_k_one_is_greedy():
    logits = torch.randn(3, VOCAB)
    out = Sampler(VOCAB)(logits, [row(temperature=1.0, top_k=1)] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.01, 1e-9])
def test_temperature_near_zero_approaches_greedy(temperature):
    logits = torch.randn(VOCAB)
    logits[9] = logits.max() + 1.0
    assert set(draws(logits, 500, temperature=temperature).tolist()) == {9}


def test_temperature_one_matches_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n = 30_000
    counts = torch.bincount(draws(logits, n, temperature=1.0), minlength=6).double()
    expected = logits.double().softmax(-1) * n
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 20.5  # 5 degrees of freedom, p = 0.001


def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0])
    n = 30_000
    counts = torch.bincount(draws(logits, n, temperature=0.5), minlength=3).double()
    expected = (logits.double() / 0.5).softmax(-1) * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 13.8  # 2 dof, p = 0.001


# -- filters ------------------------------------------------------------------------------------


def test_top_k_restricts_support_to_the_k_best():
    logits = torch.randn(VOCAB)
    best = set(logits.topk(4).indices.tolist())
    assert set(draws(logits, 4000, top_k=4).tolist()) == best


def known_distribution() -> torch.Tensor:
    """Probabilities 0.5, 0.3, 0.15, 0.05 on ids 3, 0, 2, 1 (not in id order)."""
    return torch.tensor([0.3, 0.05, 0.15, 0.5]).log()


@pytest.mark.parametrize(
    ("top_p", "nucleus"), [(0.4, {3}), (0.75, {3, 0}), (0.85, {3, 0, 2}), (0.99, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_smallest_nucleus(top_p, nucleus):
    logits = known_distribution().unsqueeze(0)
    apply_top_p(logits, [top_p])
    assert kept(logits[0]) == nucleus


def test_top_p_sampling_stays_in_the_nucleus_and_renormalises():
    samples = draws(known_distribution(), 20_000, top_p=0.75)
    assert set(samples.tolist()) == {0, 3}
    assert abs(float((samples == 3).double().mean()) - 0.5 / 0.8) < 0.02


def test_top_p_leaves_other_rows_alone():
    logits = torch.stack([known_distribution(), known_distribution()])
    apply_top_p(logits, [1.0, 0.4])
    assert kept(logits[0]) == {0, 1, 2, 3}
    assert kept(logits[1]) == {3}


@pytest.mark.parametrize(("min_p", "survivors"), [(0.2, {3, 0, 2}), (0.5, {3, 0}), (1.0, {3})])
def test_min_p_drops_tokens_below_a_fraction_of_the_best(min_p, survivors):
    logits = known_distribution().unsqueeze(0)
    apply_min_p(logits, [min_p])
    assert kept(logits[0]) == survivors


def test_min_p_sampling_support():
    assert set(draws(known_distribution(), 4000, min_p=0.5).tolist()) == {0, 3}


# -- logits processing --------------------------------------------------------------------------


def test_logit_bias_forces_and_forbids_tokens():
    logits = torch.randn(2, VOCAB)
    worst, best = int(logits[0].argmin()), int(logits[1].argmax())
    rows = [
        row(temperature=0.0, logit_bias={worst: 100.0}),
        row(temperature=0.0, logit_bias={best: -100.0}),
    ]
    out = Sampler(VOCAB)(logits, rows)
    assert out.token_ids[0] == worst
    assert out.token_ids[1] == int(logits[1].topk(2).indices[1])


def test_logit_bias_adds_exactly_and_ignores_ids_outside_the_vocab():
    logits = torch.zeros(1, 4)
    out = process_logits(logits, [row(logit_bias={1: 2.5, 3: -1.0, 99: 5.0})])
    assert out.tolist() == [[0.0, 2.5, 0.0, -1.0]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    apply_penalties(logits, [row(repetition_penalty=2.0, prompt=[0], output=[1, 1])])
    assert logits.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]


def test_frequency_and_presence_penalties_subtract_exact_amounts_over_output_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    rows = [row(frequency_penalty=0.5, presence_penalty=0.25, prompt=[0, 1], output=[2, 2, 3])]
    apply_penalties(logits, rows)
    assert logits.tolist() == [[1.0, 1.0, 1.0 - 1.25, 1.0 - 0.75]]


def test_repetition_penalty_applies_before_frequency_and_presence():
    logits = torch.tensor([[4.0, -4.0]])
    rows = [row(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5, output=[0, 1])]
    apply_penalties(logits, rows)
    assert logits.tolist() == [[2.0 - 1.5, -8.0 - 1.5]]


def test_penalties_touch_only_the_rows_that_ask():
    logits = torch.ones(3, 4)
    rows = [row(output=[0]), row(presence_penalty=1.0, output=[0]), row(output=[1])]
    apply_penalties(logits, rows)
    assert logits.tolist() == [[1.0] * 4, [0.0, 1.0, 1.0, 1.0], [1.0] * 4]


def test_pending_tokens_count_as_the_history_they_continue():
    """Tokens known on the device only (``PendingTokens``) weigh in penalties and
    min_tokens exactly as the same tokens at the end of the host's history do; invalid
    entries not at all."""
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    params = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2,
                  min_tokens=4, eos=(2,))  # fmt: skip
    known = [row(prompt=[9], output=[1, 5, 5, 7], **params), row(output=[3], **params),
             row(output=[], **params)]  # fmt: skip
    pending = PendingTokens(torch.tensor([[5, 7, 0], [3, 3, 8], [4, 4, 4]]),
                            torch.tensor([[True, True, False], [True, False, False],
                                          [False, False, False]]))  # fmt: skip
    split = [row(prompt=[9], output=[1, 5], **params), row(output=[], **params),
             row(output=[], **params)]  # fmt: skip
    assert torch.equal(process_logits(logits, split, pending), process_logits(logits, known))
    assert not torch.isfinite(process_logits(logits, split, pending)[2, 2])  # 0 of 4 yet
    assert torch.isfinite(process_logits(logits, split, pending)[0, 2])  # 2 + 2 pending


def test_a_prompt_kept_as_its_distinct_ids_penalises_as_the_prompt_itself():
    """``distinct_ids`` (a prompt converted once, kept on the logits' device) beside rows
    whose prompt is a list and rows with none: the same logits as every prompt a list."""
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    params = dict(repetition_penalty=1.3, frequency_penalty=0.2)
    prompts = [[3, 9, 3, 12], [5], [], [7, 7, 1]]
    outputs = [[1, 2, 2], [], [4], [9]]
    as_lists = [row(prompt=p, output=o, **params) for p, o in zip(prompts, outputs)]
    kept = [row(prompt=distinct_ids(p, logits.device) if i % 2 == 0 else p, output=o, **params)
            for i, (p, o) in enumerate(zip(prompts, outputs))]  # fmt: skip
    assert torch.equal(process_logits(logits, kept), process_logits(logits, as_lists))


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = logits[0, 5] = 10.0

    def choose(output, **params):
        rows = [row(temperature=0.0, min_tokens=3, eos=(2,), output=output, **params)]
        return Sampler(VOCAB)(logits, rows).token_ids[0]

    assert choose([7, 7], stop_token_ids=(5,)) not in (2, 5)
    assert choose([7, 7, 7], stop_token_ids=(5,)) == 2
    assert choose([7], ignore_eos=True) == 2


def test_input_logits_are_not_modified():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    rows = [
        row(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logit_bias={1: 3.0}),
        row(temperature=0.0, repetition_penalty=1.5, output=[1, 2], presence_penalty=1.0),
        row(temperature=1.0, min_tokens=2, eos=(0,)),
    ]
    Sampler(VOCAB)(logits, rows)
    assert torch.equal(logits, before)


def test_padding_columns_past_the_vocab_are_never_chosen():
    logits = torch.zeros(4, VOCAB + 8)
    logits[:, VOCAB:] = 50.0
    rows = [row(temperature=0.0), row(), row(top_p=0.5), row(logprobs=3)]
    out = Sampler(VOCAB)(logits, rows)
    assert all(t < VOCAB for t in out.token_ids)
    assert all(t < VOCAB for t in out.logprobs[3].top_ids)


# -- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_with_sorted_top_alternatives():
    logits = torch.randn(3, VOCAB)
    rows = [
        row(temperature=0.5, top_k=3, presence_penalty=2.0, output=[0, 1], logprobs=5),
        row(temperature=0.0, logprobs=0),
        row(),
    ]
    out = Sampler(VOCAB)(logits, rows)
    raw = logits.log_softmax(-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(float(raw[0, first.token_id]), abs=1e-6)
    assert first.top_ids == raw[0].topk(5).indices.tolist()
    assert first.top_logprobs == pytest.approx(raw[0].topk(5).values.tolist(), abs=1e-6)
    assert first.top_logprobs == sorted(first.top_logprobs, reverse=True)
    assert out.logprobs[1].top_ids == [] and out.logprobs[1].top_logprobs == []
    assert out.logprobs[1].logprob == pytest.approx(float(raw[1].max()), abs=1e-6)
    assert out.logprobs[2] is None
    assert math.isclose(sum(math.exp(v) for v in raw[0].tolist()), 1.0, rel_tol=1e-5)


# -- reproducibility ----------------------------------------------------------------------------

STEPS = 12
SEEDED = {
    "temperature": 0.9,
    "top_k": 20,
    "top_p": 0.95,
    "min_p": 0.01,
    "presence_penalty": 0.5,
    "repetition_penalty": 1.1,
}


def step_logits(request: int, step: int) -> torch.Tensor:
    """Fixed logits for one request at one step, independent of the batch around it."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 * request + step)) * 2


def other_row(request: int, output: list[int]) -> SamplingRow:
    kinds = [
        lambda: row(temperature=1.0, output=output),
        lambda: row(temperature=0.0, output=output),
        lambda: seeded(request, temperature=0.7, top_p=0.8, output=output),
        lambda: row(temperature=1.3, top_k=5, repetition_penalty=1.2, output=output),
        lambda: seeded(request, temperature=1.0, min_p=0.1, output=output, logprobs=2),
    ]
    return kinds[request % len(kinds)]()


def generate(seed: int, batch: int, position: int, params=None) -> list[int]:
    """Tokens of one seeded request over ``STEPS`` steps, sampled at ``position`` in a batch."""
    params = params or SEEDED
    sampler = Sampler(VOCAB, seed=batch * 31 + position)
    generator = sampler.new_generator(seed)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    for step in range(STEPS):
        rows = [other_row(r, outputs[r]) for r in range(batch)]
        rows[position] = SamplingRow(SamplingParams(**params), generator, [1, 2], outputs[position])
        logits = torch.stack([step_logits(r if r != position else -1, step) for r in range(batch)])
        for r, token in enumerate(sampler(logits, rows).token_ids):
            outputs[r].append(token)
    return outputs[position]


def test_seeded_request_gives_the_same_tokens_alone_and_at_any_batch_position():
    alone = generate(seed=7, batch=1, position=0)
    for position in range(8):
        assert generate(seed=7, batch=8, position=position) == alone


def test_seeded_plain_temperature_request_is_batch_independent():
    plain = {"temperature": 1.0}
    alone = generate(seed=3, batch=1, position=0, params=plain)
    assert generate(seed=3, batch=8, position=5, params=plain) == alone
    assert generate(seed=3, batch=3, position=1, params=plain) == alone


def test_different_seeds_give_different_sequences():
    assert generate(seed=1, batch=1, position=0) != generate(seed=2, batch=1, position=0)
