"""Prometheus metrics of the front door, in their own registry, all named ``ferry_*``.

The server records what it sees (requests by endpoint and status, TTFT, inter-token
and end-to-end latency, prompt and generated tokens). Engine-side numbers (running and
waiting requests, KV blocks, prefix-cache tokens, preemptions, the KV tiers' hits, bytes
and evictions) are read from the engine client's latest ``EngineStats`` at scrape time by
``EngineStatsCollector``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine import heap
from engine.messages import EngineStats, GcStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class EngineStatsCollector(Collector):
    """Exposes the engine's latest stats, read through ``get_stats`` at each scrape."""

    def __init__(self, get_stats: Callable[[], EngineStats | None]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats() or EngineStats()
        for name, doc, value in (
            ("num_requests_running", "Requests the engine is running", stats.num_running),
            ("num_requests_waiting", "Requests queued in the engine", stats.num_waiting),
            ("kv_blocks_used", "KV cache blocks referenced by requests", stats.kv_blocks_used),
            ("kv_blocks_total", "KV cache blocks in the pool", stats.kv_blocks_total),
        ):
            yield GaugeMetricFamily(f"ferry_{name}", doc, value=value)
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             stats.prefix_query_tokens),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache",
             stats.prefix_hit_tokens),
            ("num_preemptions", "Requests preempted by the engine", stats.num_preemptions),
        ):  # fmt: skip
            yield CounterMetricFamily(f"ferry_{name}", doc, value=value)
        yield from _tier_metrics(stats)
        yield from _spec_metrics(stats)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _spec_metrics(s: EngineStats) -> Iterator[Metric]:
    """Speculative decoding: drafts by position, acceptance length, verify budget, and how
    far the verify policy's estimates were from what happened."""
    for name, doc, values in (
        ("spec_draft_tokens_proposed", "Draft tokens the drafter proposed, by position",
         s.spec_draft_proposed),
        ("spec_draft_tokens_verified", "Draft tokens verified, by position",
         s.spec_draft_verified),
        ("spec_draft_tokens_accepted", "Draft tokens kept, by position", s.spec_draft_accepted),
    ):  # fmt: skip
        family = CounterMetricFamily(f"ferry_{name}", doc, labels=["position"])
        for i, value in enumerate(values):
            family.add_metric([str(i + 1)], value)
        yield family
    groups, steps = s.spec_verify_groups, s.spec_verify_steps
    accepted, verified = sum(s.spec_draft_accepted), sum(s.spec_draft_verified)
    for name, doc, value in (
        ("spec_mean_acceptance_length", "Tokens a request gets per step that verifies its "
         "drafts: 1 + the mean drafts kept", 1 + accepted / groups if groups else 0.0),
        ("spec_mean_verify_budget", "Draft tokens verified per step that verifies any",
         verified / steps if steps else 0.0),
        ("spec_acceptance_estimate_error", "Mean |expected - kept| drafts per request and "
         "step, from the verify policy's acceptance estimates",
         s.spec_error_milli / 1000 / groups if groups else 0.0),
        ("spec_step_time_estimate_error", "Mean relative error of the step-cost model's "
         "predicted step time", s.spec_time_error_us / s.spec_time_us if s.spec_time_us else 0.0),
    ):  # fmt: skip
        yield GaugeMetricFamily(f"ferry_{name}", doc, value=value)
    yield CounterMetricFamily("ferry_spec_verify_steps", "Steps that verified drafts",
                              value=steps)  # fmt: skip
    for name, doc, value in (
        ("spec_guard_blocked_steps", "Steps the realized-gain guard ran without the verify "
         "policy's drafts (speculation measured slower there)", s.spec_guard_blocked_steps),
        ("spec_guard_probe_steps", "The realized-gain guard's probe steps, either mode",
         s.spec_guard_probe_steps),
        ("spec_explored_steps", "Steps that verified a total of a step size the cost model "
         "had not measured", s.spec_explored_steps),
    ):  # fmt: skip
        yield CounterMetricFamily(f"ferry_{name}", doc, value=value)


def _tier_metrics(s: EngineStats) -> Iterator[Metric]:
    """The KV tiers below the cache (host memory, files): hits, bytes, evictions."""
    by_tier = (
        ("kv_tier_hit_tokens", "Prompt tokens served from each KV tier",
         (s.prefix_hit_tokens_device, s.prefix_hit_tokens_host, s.prefix_hit_tokens_file)),
        ("kv_tier_read_bytes", "Bytes read from each KV tier",
         (None, s.kv_host_bytes_read, s.kv_file_bytes_read)),
        ("kv_tier_written_bytes", "Bytes written to each KV tier",
         (None, s.kv_host_bytes_written, s.kv_file_bytes_written)),
        ("kv_tier_evictions", "Blocks evicted from each KV tier for room",
         (None, s.kv_host_evictions, s.kv_file_evictions)),
    )  # fmt: skip
    for name, doc, values in by_tier:
        family = CounterMetricFamily(f"ferry_{name}", doc, labels=["tier"])
        for tier, value in zip(("device", "host", "file"), values, strict=True):
            if value is not None:
                family.add_metric([tier], value)
        yield family
    for name, doc, value in (
        ("kv_file_expired", "KV block files removed past their TTL", s.kv_file_expired),
        ("kv_file_checksum_failures", "KV block files that failed their checksum (removed)",
         s.kv_file_checksum_failures),
        ("kv_file_writes_dropped", "KV blocks not written to files: the writer was behind "
         "or the tier degraded", s.kv_file_writes_dropped),
        ("kv_file_read_errors", "KV block file reads that failed (each a miss)",
         s.kv_file_read_errors),
        ("kv_file_write_errors", "KV block file writes that failed", s.kv_file_write_errors),
    ):  # fmt: skip
        yield CounterMetricFamily(f"ferry_{name}", doc, value=value)
    yield GaugeMetricFamily("ferry_kv_file_degraded", "Workers whose KV file tier writes "
                            "nothing: its directory is full or read-only (cleared by itself "
                            "once a probe write succeeds)", value=s.kv_file_degraded)  # fmt: skip
    yield GaugeMetricFamily("ferry_kv_host_blocks_used", "KV blocks held in host memory",
                            value=s.kv_host_blocks_used)  # fmt: skip
    yield GaugeMetricFamily("ferry_kv_host_blocks_total", "KV block slots in host memory",
                            value=s.kv_host_blocks_total)  # fmt: skip


class GcCollector(Collector):
    """Garbage collection in this frontend and in each worker (``engine.heap``): the
    collections and the seconds they stopped the process, by generation, the longest
    pause, and the objects of the startup frozen out of the collector's walk."""

    def __init__(self, workers: Callable[[], Sequence]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "worker"]
        collections = CounterMetricFamily("ferry_gc_collections", "Garbage collections of "
                                          "each process, by generation",
                                          labels=[*labels, "generation"])  # fmt: skip
        paused = CounterMetricFamily("ferry_gc_pause_seconds", "Seconds garbage collection "
                                     "stopped each process, by generation",
                                     labels=[*labels, "generation"])  # fmt: skip
        longest = GaugeMetricFamily("ferry_gc_longest_pause_seconds", "The longest garbage "
                                    "collection pause of each process", labels=labels)  # fmt: skip
        frozen = GaugeMetricFamily("ferry_gc_frozen_objects", "Objects of each process's "
                                   "startup frozen out of garbage collection",
                                   labels=labels)  # fmt: skip
        rows: list[tuple[str, str, GcStats]] = [("frontend", "frontend",
                                                 heap.pauses().snapshot())]  # fmt: skip
        rows += [(w.role, w.name, w.gc) for w in self._workers() if w.gc is not None]
        for role, name, gc in rows:
            for generation in range(3):
                key = [role, name, str(generation)]
                collections.add_metric(key, gc.collections[generation])
                paused.add_metric(key, gc.pause_s[generation])
            longest.add_metric([role, name], gc.longest_s)
            frozen.add_metric([role, name], gc.frozen)
        yield from (collections, paused, longest, frozen)

    def describe(self) -> Iterator[Metric]:
        return iter(())


class Metrics:
    """The server's metrics; one instance per app, with its own registry."""

    def __init__(self, get_stats: Callable[[], EngineStats | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "ferry_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "ferry_time_to_first_token_seconds", "Time from arrival to the first token",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "ferry_inter_token_latency_seconds", "Time between consecutive output tokens",
            buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "ferry_e2e_request_latency_seconds", "Time from arrival to the last token",
            buckets=_E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "ferry_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("ferry_generation_tokens", "Tokens generated", registry=r)
        r.register(EngineStatsCollector(get_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
