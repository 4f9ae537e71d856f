"""engine.structured on the default tokenizer: checking, compiling, the gate, matcher state
and the token mask the sampler applies."""

from __future__ import annotations

import json
import time

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import GrammarSpec, SamplingParams
from engine.structured import (
    BATCH_FILL_ROWS,
    GrammarCompiler,
    GrammarError,
    GrammarGate,
    GrammarState,
    build_mask,
    check,
    json_spec,
)

VOCAB = 49152
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    c = GrammarCompiler(smollm2_tokenizer, VOCAB, cache_bytes=16 << 20)
    yield c
    c.shutdown()


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (GrammarSpec("json", '{"type": "bogus"}'), 'Unsupported type "bogus"'),
        (GrammarSpec("regex", "a(b"), "parenthesis is not closed"),
        (GrammarSpec("grammar", "root ::= missing"), 'Rule "missing" is not defined'),
    ],
)
def test_check_rejects_with_xgrammars_reason(spec, reason):
    with pytest.raises(GrammarError, match=reason) as info:
        check(spec)
    assert ".cc:" not in str(info.value)


def test_check_accepts_valid_specs():
    check(json_spec(PERSON))
    check(GrammarSpec("regex", "[a-z]+"))
    check(GrammarSpec("grammar", 'root ::= "yes" | "no"'))


def test_json_spec_is_compact_and_keeps_key_order():
    spec = json_spec('{"b": 1,  "a": {"d": 2, "c": 3}}')
    assert spec == GrammarSpec("json", '{"b":1,"a":{"d":2,"c":3}}')
    assert json_spec({"b": 1, "a": {"d": 2, "c": 3}}) == spec


def test_compiled_grammar_constrains_and_ends_with_eos(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    compiled = compiler.submit(json_spec(PERSON)).result(timeout=60)
    state = GrammarState(compiled)
    for token in tok.encode('{"name": "Ann", "age": 7}'):
        assert state.accept(token)
    assert not state.is_terminated
    assert not state.accept(tok.encode(",")[0])  # the object is complete
    assert state.accept(tok.eos_token_id)
    assert state.is_terminated


def test_special_tokens_are_never_allowed_inside_a_grammar(compiler, smollm2_tokenizer):
    compiled = compiler.submit(GrammarSpec("regex", "(.|\n)*")).result(timeout=60)
    mask = build_mask([GrammarState(compiled)], VOCAB)
    logits = torch.zeros(1, VOCAB)
    mask.apply(logits)
    eos = set(smollm2_tokenizer.eos_token_ids)
    forbidden = set(torch.nonzero(logits[0] == float("-inf")).flatten().tolist())
    assert set(smollm2_tokenizer.all_special_ids) - eos <= forbidden
    assert not eos & forbidden  # ".*" may end anywhere


def test_resume_rebuilds_the_state_from_generated_tokens(compiler, smollm2_tokenizer):
    """What a decode worker does when it takes over a request from prefill."""
    compiled = compiler.submit(json_spec(PERSON)).result(timeout=60)
    tokens = smollm2_tokenizer.encode('{"name": "Bo", "a')
    step_by_step = GrammarState(compiled)
    for t in tokens:
        assert step_by_step.accept(t)
    resumed = GrammarState.resume(compiled, tokens)
    assert resumed.num_accepted == len(tokens)
    a, b = build_mask([step_by_step], VOCAB), build_mask([resumed], VOCAB)
    assert torch.equal(a.bitmask, b.bitmask)
    with pytest.raises(GrammarError, match="breaks the grammar"):
        GrammarState.resume(compiled, smollm2_tokenizer.encode("[1]"))


def test_a_batch_of_masks_filled_together_equals_each_filled_alone(compiler, smollm2_tokenizer):
    """From ``BATCH_FILL_ROWS`` constrained rows on, the masks are filled in one batched
    call: the same bits as row by row, for different grammars at different points, with
    unconstrained rows between them and one whose grammar is complete."""
    specs = [json_spec(PERSON), GrammarSpec("regex", "[a-z ]{1,40}"),
             GrammarSpec("regex", "yes|no")]  # fmt: skip
    compiled = [compiler.submit(spec).result(timeout=60) for spec in specs]
    prefixes = ['{"name": "Bo', "hello wor", "", '{"na', "ye", "yes"]
    states: list[GrammarState | None] = [None]
    for i, prefix in enumerate(prefixes):
        states.append(GrammarState.resume(compiled[i % 3], smollm2_tokenizer.encode(prefix)))
        states.append(None)
    assert len([s for s in states if s is not None]) >= BATCH_FILL_ROWS
    together = build_mask(states, VOCAB)
    alone = [build_mask([s], VOCAB) for s in states]
    for i, mask in enumerate(alone):
        expected = mask.bitmask[0] if mask is not None else torch.full_like(together.bitmask[i], -1)
        assert torch.equal(together.bitmask[i], expected), i


def test_mask_touches_only_constrained_rows_and_logprobs_stay_raw(compiler, smollm2_tokenizer):
    compiled = compiler.submit(GrammarSpec("regex", "yes|no")).result(timeout=60)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    assert build_mask([None, None, None], VOCAB) is None
    mask = build_mask([None, GrammarState(compiled), None], VOCAB)
    spec = GrammarSpec("regex", "yes|no")
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=0)),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=0, grammar=spec)),
        SamplingRow(SamplingParams(temperature=1.0, logprobs=0, seed=1)),
    ]
    sampler = Sampler(VOCAB)
    before = logits.clone()
    out = sampler(logits, rows, mask)
    assert torch.equal(logits, before)  # the input is never modified
    plain = Sampler(VOCAB)(logits[[0, 2]], [rows[0], rows[2]])
    assert [out.token_ids[0], out.token_ids[2]] == plain.token_ids
    assert smollm2_tokenizer.decode([out.token_ids[1]]) in ("yes", "no", "y", "n", "ye")
    raw = logits.log_softmax(-1)
    assert out.logprobs[1].logprob == pytest.approx(raw[1, out.token_ids[1]].item(), abs=1e-5)


def _request(rid: str, spec: GrammarSpec) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(grammar=spec))


def test_gate_hands_over_ready_requests_and_reports_failures(compiler):
    gate = GrammarGate(compiler)
    gate.add(_request("ok", json_spec(PERSON)))
    gate.add(_request("bad", GrammarSpec("grammar", "root ::= nope")))
    gate.add(_request("gone", GrammarSpec("regex", "x+")))
    gate.abort(["gone"])
    ready, failed = [], []
    deadline = time.monotonic() + 60
    while gate and time.monotonic() < deadline:
        gate.wait(0.05)
        r, f = gate.take_ready()
        ready += r
        failed += f
    assert [r.request_id for r in ready] == ["ok"] and ready[0].grammar is not None
    assert [(f.request_id, f.finish_reason) for f in failed] == [("bad", "error")]
    assert "nope" in failed[0].error


def test_equal_specs_compile_once(compiler):
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
    first = compiler.compile(json_spec(schema))
    size = compiler.cache_bytes
    again = compiler.compile(json_spec(json.dumps(schema, indent=2)))
    assert compiler.cache_bytes == size > 0
    assert again.memory_size_bytes == first.memory_size_bytes
