"""CPU engine throughput: ferry's engine vs transformers' ``generate``, in one run.

    .venv/bin/python -m bench.cpu_engine [--model default] [--dtype float32|bfloat16]

Measures, on the same model and prompts: prefill tok/s (one 512-token prompt),
decode tok/s at batch 1 and at batch 16 (128 new tokens per sequence, EOS ignored).
Decode time excludes the prefill (a max_tokens=1 run of the same prompts is
subtracted). Each figure is the median of --repeats runs after a warm-up; the two engines take
turns on every repeat so that shifting machine load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import machine_info
from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.loader import default_model_path
from engine.sampling_params import SamplingParams


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch, length), generator=g).tolist()


Runner = Callable[[list[list[int]], int], Callable[[], object]]


def measure(engines: dict[str, Runner], vocab: int, args) -> dict[str, dict[str, float]]:
    """Prefill and decode throughput of each engine. ``engines[name](prompts, n)`` returns
    a call that greedily generates exactly ``n`` tokens for every prompt. The engines
    take turns on every repeat, so a change in machine load hits all of them alike."""
    times: dict[tuple[str, str], list[float]] = {}

    def timed(key: str, prompts: list[list[int]], n: int) -> None:
        runs = {name: make(prompts, n) for name, make in engines.items()}
        for run in runs.values():
            run()  # warm-up
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times.setdefault((name, key), []).append(time.perf_counter() - start)

    timed("prefill", _prompts(1, args.prefill_len, vocab, 0), 1)
    for batch in (1, 16):
        prompts = _prompts(batch, args.prompt_len, vocab, batch)
        timed(f"first_b{batch}", prompts, 1)
        timed(f"all_b{batch}", prompts, args.new_tokens + 1)
    out = {}
    for name in engines:
        t = {key: statistics.median(v) for (n, key), v in times.items() if n == name}
        out[name] = {"prefill_tok_s": args.prefill_len / t["prefill"]}
        for batch in (1, 16):
            decode = t[f"all_b{batch}"] - t[f"first_b{batch}"]
            out[name][f"decode_b{batch}_tok_s"] = batch * args.new_tokens / decode
    return out


def ferry_engine(args) -> tuple[Runner, int]:
    config = EngineConfig(
        model=args.model, dtype=args.dtype, cache=CacheConfig(enable_prefix_caching=False)
    )
    llm = LLM(config)

    def make_run(prompts, n):
        sampling = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return lambda: llm.generate(prompts, sampling)

    return make_run, llm.core.model_config.vocab_size


def transformers_engine(args) -> Runner:
    import transformers

    path = Path(default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, args.dtype)
    )
    model.generation_config.eos_token_id = None

    def make_run(prompts, n):
        ids = torch.tensor(prompts)
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n)

        def run():
            with torch.inference_mode():
                return model.generate(ids, do_sample=False, **kw)

        return run

    return make_run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="bench/results/cpu_engine.json")
    args = parser.parse_args()

    ferry, vocab = ferry_engine(args)
    engines = {"ferry": ferry}
    if not args.skip_transformers:
        engines["transformers"] = transformers_engine(args)
    results = measure(engines, vocab, args)
    if "transformers" in results:
        results["ratio_ferry_over_transformers"] = {
            k: results["ferry"][k] / results["transformers"][k] for k in results["ferry"]
        }
    report = {
        "benchmark": "cpu_engine",
        **machine_info(),
        "model": args.model,
        "dtype": args.dtype,
        "settings": {
            k: getattr(args, k) for k in ("prefill_len", "prompt_len", "new_tokens", "repeats")
        },
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'metric':<18}{'ferry':>10}{'transformers':>14}{'ratio':>8}")
    for key, value in results["ferry"].items():
        ref = results.get("transformers", {}).get(key)
        ratio = f"{value / ref:8.2f}" if ref else ""
        ref_s = f"{ref:14.1f}" if ref else ""
        print(f"{key:<18}{value:10.1f}{ref_s}{ratio}")


if __name__ == "__main__":
    main()
