"""Aggregates over a run's request results.

Definitions (times reported in milliseconds, rates per second of ``duration_s``):

- percentiles use linear interpolation between closest ranks (Hyndman & Fan type 7,
  numpy's default): for sorted ``x`` of length n, ``p`` maps to rank ``h = (n-1)p/100``
  and the value is ``x[floor h] + (h - floor h)(x[floor h + 1] - x[floor h])``;
- TTFT and E2E are taken over successful requests; ITL pools every gap of every
  successful request; TPOT is each request's ``(E2E - TTFT) / (output_tokens - 1)``;
- throughput: completed requests, output tokens, and prompt + output tokens, each
  divided by ``duration_s`` (first request sent to last request finished);
- per-user tok/s: the mean over successful requests of ``1 / TPOT`` (the decode speed one
  user sees);
- goodput: successful requests with TTFT <= ``slo_ttft_ms`` and TPOT <= ``slo_itl_ms``
  (an SLO left as None is not checked), divided by ``duration_s``. Requests with one
  output token have no TPOT and meet the ITL SLO.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.load.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    itl_ms: float | None = None

    def met_by(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft_s is None:
            return False
        if self.ttft_ms is not None and r.ttft_s * 1e3 > self.ttft_ms:
            return False
        tpot = r.tpot_s
        return self.itl_ms is None or tpot is None or tpot * 1e3 <= self.itl_ms


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) by linear interpolation (type 7); NaN if empty."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    h = (len(xs) - 1) * p / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def distribution_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean and p50/p90/p99 in milliseconds of values given in seconds (NaN if empty)."""
    ms = [v * 1e3 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    out.update({f"p{p}": percentile(ms, p) for p in PERCENTILES})
    return out


def summarize(
    results: Sequence[RequestResult], duration_s: float, slo: SLO | None = None
) -> dict[str, Any]:
    """The run's aggregate figures (see the module docstring for each definition)."""
    slo = slo or SLO()
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for t in (r.tpot_s for r in ok) if t]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    rate = lambda n: n / duration_s if duration_s > 0 else math.nan
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": duration_s,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(out_tokens + prompt_tokens),
        "per_user_output_tok_s": sum(1 / t for t in tpots) / len(tpots) if tpots else math.nan,
        "goodput": rate(sum(slo.met_by(r) for r in ok)),
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms},
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "total_cached_tokens": cached,
        "cache_hit_rate": cached / prompt_tokens if prompt_tokens else math.nan,
        "ttft_ms": distribution_ms(ttfts),
        "itl_ms": distribution_ms([g for r in ok for g in r.itl_s]),
        "tpot_ms": distribution_ms(tpots),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok]),
    }


def format_summary(s: dict[str, Any]) -> str:
    """A plain-text table of a summary, for the terminal."""
    rows = [
        ("requests ok / failed", f"{s['completed']} / {s['failed']}"),
        ("errors", ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"),
        ("duration (s)", f"{s['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("goodput (req/s)", f"{s['goodput']:.2f}"),
        ("output throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}"),
        ("per-user output (tok/s)", f"{s['per_user_output_tok_s']:.1f}"),
        ("prompt / cached tokens", f"{s['total_prompt_tokens']} / {s['total_cached_tokens']}"),
    ]
    lines = [f"{name:<32}{value:>20}" for name, value in rows]
    lines.append(f"{'(ms)':<12}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p99")))
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        d = s[key]
        cells = "".join(f"{d[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{key[:-3].upper():<12}{cells}")
    return "\n".join(lines)
