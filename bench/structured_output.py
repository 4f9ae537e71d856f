"""Structured output cost: JSON-schema-constrained vs unconstrained decoding, in one run.

    .venv/bin/python -m bench.structured_output [--threads 1] [--new-tokens 48]

Output tok/s of the in-process engine (``engine.llm.LLM``) at concurrency 1 and 16 (that
many requests batched together), each request generating exactly ``--new-tokens`` tokens:
unconstrained with EOS ignored, constrained by a JSON schema whose shortest valid output
is longer than that, so both end by length. Wall time includes the short prompt's prefill,
the same for both. The two kinds run alternately, ``--repeats`` times each after a
warm-up; each figure is a median, and the ratio is the median of the paired runs' ratios.

Grammar compile time, cold (a fresh compiler; the tokenizer info is built before the
clock starts) and cached (the same spec again), for the test suite's JSON schemas and one
large schema (300 patterned alternatives).

The CPU machine is shared and noisy: compare the ratios within one run, not the absolute
figures across runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import machine_info
from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.sampling_params import GrammarSpec, SamplingParams
from engine.structured import GrammarCompiler, json_spec

# At least 30 objects of 2 fields: far more than --new-tokens tokens before it may end.
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 30,
            "maxItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "name": {"type": "string", "minLength": 1, "maxLength": 12},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def large_schema(n: int = 300) -> dict:
    patterns = [f"^x{i}[a-z]{{2,{i % 9 + 2}}}[0-9]{{1,3}}$" for i in range(n)]
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {f"k{i}": {"type": "string", "pattern": p}},
                "required": [f"k{i}"],
                "additionalProperties": False,
            }
            for i, p in enumerate(patterns)
        ]
    }


def bench_decode(llm: LLM, args) -> dict:
    prompt = llm.chat_prompt([{"role": "user", "content": "List some products as JSON."}])
    plain = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0, max_tokens=args.new_tokens, grammar=json_spec(LONG_SCHEMA)
    )
    out = {}
    for c in (1, 16):
        prompts = [prompt] * c
        for sampling in (plain, constrained):  # warm-up, and both must run to length
            done = llm.generate(prompts, sampling)
            assert all(len(x.token_ids) == args.new_tokens for x in done), "ended early"
        pairs = [
            (_tok_s(llm, prompts, plain, args), _tok_s(llm, prompts, constrained, args))
            for _ in range(args.repeats)
        ]
        out[f"unconstrained_c{c}_tok_s"] = statistics.median(p[0] for p in pairs)
        out[f"json_schema_c{c}_tok_s"] = statistics.median(p[1] for p in pairs)
        out[f"ratio_c{c}"] = statistics.median(p[1] / p[0] for p in pairs)
    return out


def _tok_s(llm: LLM, prompts: list[list[int]], sampling: SamplingParams, args) -> float:
    start = time.perf_counter()
    llm.generate(prompts, sampling)
    return len(prompts) * args.new_tokens / (time.perf_counter() - start)


def _schemas() -> dict[str, dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from structured_schemas import SCHEMAS

    return SCHEMAS


def bench_compile(llm: LLM) -> dict:
    compiler = GrammarCompiler(llm.tokenizer, llm.core.model_config.vocab_size, 256 << 20)
    compiler.compile(GrammarSpec("regex", "warm-up"))  # tokenizer info + import, untimed

    def timed(spec: GrammarSpec) -> float:
        start = time.perf_counter()
        compiler.compile(spec)
        return (time.perf_counter() - start) * 1e3

    specs = [json_spec(s) for s in _schemas().values()]
    cold = [timed(s) for s in specs]
    cached = [timed(s) for s in specs]
    big = json_spec(large_schema())
    big_cold, big_cached = timed(big), timed(big)
    compiler.shutdown()
    return {
        "test_schemas": len(specs),
        "test_schemas_cold_ms_median": statistics.median(cold),
        "test_schemas_cold_ms_max": max(cold),
        "test_schemas_cached_ms_median": statistics.median(cached),
        "large_schema_cold_ms": big_cold,
        "large_schema_cached_ms": big_cached,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/structured_output.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    llm = LLM(
        EngineConfig(model=args.model, num_threads=args.threads, cache=CacheConfig(memory_gb=0.25))
    )
    results = {"decode": bench_decode(llm, args), "compile": bench_compile(llm)}
    report = {
        "benchmark": "structured_output",
        **machine_info(),
        "model": args.model,
        "settings": {k: getattr(args, k) for k in ("threads", "new_tokens", "repeats")},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for section, figures in results.items():
        for key, value in figures.items():
            print(f"{section:<8}{key:<34}{value:12.3f}")


if __name__ == "__main__":
    main()
