"""Structured output through the whole engine, on the default model: every output of 30+
JSON schemas parses and validates, greedy and at temperature 1.0; regex and EBNF outputs
match; matchers survive preemption by recompute; a slow compile does not hold up others."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from structured_schemas import SCHEMAS

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core import EngineCore
from engine.llm import LLM
from engine.messages import EngineRequest
from engine.sampling_params import GrammarSpec, SamplingParams
from engine.structured import json_spec

pytestmark = pytest.mark.slow
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm(one_torch_thread):
    config = EngineConfig(
        cache=CacheConfig(block_size=16, memory_gb=0.5),
        scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096),
    )
    return LLM(config)


def _prompt(llm: LLM, schema: dict) -> list[int]:
    """A short prompt naming the schema's top-level keys: the grammar does the rest, and
    prompts that share their start share prefix-cache blocks."""
    keys = ", ".join(schema.get("properties", {})) or "a value"
    return llm.chat_prompt([{"role": "user", "content": f"Reply in JSON with {keys}."}])


def _validator(schema: dict) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_every_schema_output_parses_and_validates(llm):
    """All schemas, greedy and at temperature 1.0, in one batched generate call."""
    assert len(SCHEMAS) >= 30
    names = list(SCHEMAS)
    prompts, params = [], []
    for temperature in (0.0, 1.0):
        for i, name in enumerate(names):
            prompts.append(_prompt(llm, SCHEMAS[name]))
            params.append(
                SamplingParams(
                    temperature=temperature,
                    seed=i,
                    max_tokens=MAX_TOKENS,
                    grammar=json_spec(SCHEMAS[name]),
                )
            )
    outs = llm.generate(prompts, params)
    failures = []
    for k, out in enumerate(outs):
        name, temperature = names[k % len(names)], params[k].temperature
        text = llm.tokenizer.decode(out.token_ids)
        try:
            assert out.finish_reason == "stop", f"finish {out.finish_reason}"
            _validator(SCHEMAS[name]).validate(json.loads(text))
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name} @ t={temperature}: {text!r}: {exc}")
    assert not failures, "\n".join(failures)


REGEX = r"(red|green|blue) [0-9]{2}-[a-z]{3}"
EBNF = """
root ::= "The answer is " number " (" word ")."
number ::= [1-9] [0-9]?
word ::= "yes" | "no" | "maybe"
"""
EBNF_MATCH = r"The answer is [1-9][0-9]? \((yes|no|maybe)\)\."


def test_regex_and_ebnf_outputs_match_their_grammar(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "Answer briefly."}])
    specs = [GrammarSpec("regex", REGEX), GrammarSpec("grammar", EBNF)]
    patterns = [REGEX, EBNF_MATCH]
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=40, grammar=spec, logprobs=2)
        for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))
        for spec in specs
    ]
    outs = llm.generate([prompt] * len(params), params)
    for out, pattern in zip(outs, patterns * 3):
        text = llm.tokenizer.decode(out.token_ids)
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, text), text
        assert len(out.logprobs) == len(out.token_ids)  # logprobs come as usual
        assert all(lp.logprob <= 0 and len(lp.top_ids) == 2 for lp in out.logprobs)


def test_stop_token_ids_and_min_tokens_leave_the_grammar_in_charge(llm):
    """A grammar decides where the output ends: min_tokens cannot force tokens past its end,
    ignore_eos cannot keep a finished grammar going."""
    prompt = llm.chat_prompt([{"role": "user", "content": "Pick a colour."}])
    spec = GrammarSpec("regex", "(red|green|blue)")
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, grammar=spec, min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=20, grammar=spec, ignore_eos=True),
    ]
    for out in llm.generate([prompt, prompt], params):
        assert out.finish_reason == "stop"
        assert llm.tokenizer.decode(out.token_ids) in ("red", "green", "blue")


def test_matchers_survive_preemption_by_recompute():
    """A KV cache too small for the batch preempts requests; their matchers keep the tokens
    generated before, so every output still validates."""
    config = EngineConfig(
        num_threads=1,
        cache=CacheConfig(block_size=16, num_blocks=24),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024),
    )
    llm = LLM(config)
    names = ["nested_object", "array_of_objects", "ref_defs", "mixed_everything"] * 2
    prompts = [_prompt(llm, SCHEMAS[n]) for n in names]
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=MAX_TOKENS, grammar=json_spec(SCHEMAS[n])
        )
        for i, n in enumerate(names)
    ]
    outs = llm.generate(prompts, params)
    assert llm.core.scheduler.num_preemptions > 0
    for name, out in zip(names, outs):
        assert out.finish_reason == "stop"
        _validator(SCHEMAS[name]).validate(json.loads(llm.tokenizer.decode(out.token_ids)))
    llm.core.check_integrity()


def slow_schema(n: int = 300) -> dict:
    """Compiles for seconds (hundreds of distinct patterns), generates in a few tokens."""
    patterns = [f"^x{i}[a-z]{{2,{i % 9 + 2}}}[0-9]{{1,3}}$" for i in range(n)]
    branches = [
        {
            "type": "object",
            "properties": {f"k{i}": {"type": "string", "pattern": p}},
            "required": [f"k{i}"],
            "additionalProperties": False,
        }
        for i, p in enumerate(patterns)
    ]
    return {"anyOf": branches}


def test_a_slow_compile_does_not_hold_up_other_requests(llm):
    core: EngineCore = llm.core
    prompt = llm.chat_prompt([{"role": "user", "content": "Say hello."}])
    slow = SamplingParams(temperature=0.0, max_tokens=4, grammar=json_spec(slow_schema()))
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert core.add_request(EngineRequest("slow", prompt, slow)) is None
    assert core.add_request(EngineRequest("plain", prompt, plain)) is None
    start, finished = time.monotonic(), {}
    while core.has_work:
        for out in core.step():
            if out.finish_reason:
                finished[out.request_id] = time.monotonic() - start
    assert list(finished) == ["plain", "slow"], finished
