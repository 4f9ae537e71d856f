"""Prometheus metrics of the disaggregated topology, registered in the frontend's registry
(``server.metrics.Metrics``): KV transferred, transfer latency, per-role queue depths."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_TRANSFER_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class TransferMetrics:
    """Counters fed by the frontend as prefill workers report finished transfers."""

    def __init__(self) -> None:
        self.bytes = Counter("ferry_kv_transfer_bytes", "KV bytes moved from prefill to decode",
                             registry=None)  # fmt: skip
        self.blocks = Counter("ferry_kv_transfer_blocks", "KV blocks moved from prefill to decode",
                              registry=None)  # fmt: skip
        self.seconds = Histogram(
            "ferry_kv_transfer_seconds", "Time to move one request's KV",
            buckets=_TRANSFER_BUCKETS, registry=None,
        )  # fmt: skip
        self.streamed = Counter(
            "ferry_kv_transfer_streamed_blocks",
            "KV blocks sent while their prompt was still being prefilled", registry=None,
        )  # fmt: skip
        self.failures = Counter("ferry_kv_transfer_failures", "KV transfers that failed",
                                registry=None)  # fmt: skip
        self.kv_events = Counter("ferry_kv_events", "KV events published by workers",
                                 ["role", "kind"], registry=None)  # fmt: skip

    def record(
        self, num_blocks: int, num_bytes: int, seconds: float, num_streamed: int = 0
    ) -> None:
        if num_blocks:
            self.bytes.inc(num_bytes)
            self.blocks.inc(num_blocks)
            self.streamed.inc(num_streamed)
            self.seconds.observe(seconds)

    def collectors(self) -> list[Collector]:
        return [self.bytes, self.blocks, self.streamed, self.seconds, self.failures,
                self.kv_events]  # fmt: skip


_DECISION_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
)  # fmt: skip


class RouterMetrics:
    """Routing decisions, what the index predicted vs what the workers found, retries."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.decisions = Counter("ferry_router_decisions", "Workers chosen, by pool and policy",
                                 ["pool", "policy"], registry=None)  # fmt: skip
        self.decision_seconds = Histogram(
            "ferry_router_decision_seconds", "Time to choose a worker (index lookup + policy)",
            buckets=_DECISION_BUCKETS, registry=None,
        )  # fmt: skip
        self.predicted_hit_tokens = Counter(
            "ferry_router_predicted_hit_tokens",
            "Prompt tokens the prefix index said the chosen workers hold", registry=None,
        )  # fmt: skip
        self.actual_hit_tokens = Counter(
            "ferry_router_actual_hit_tokens",
            "Prompt tokens the chosen workers found in a cache", registry=None,
        )  # fmt: skip
        self.retries = Counter("ferry_router_prefill_retries",
                               "Prefills retried on another prefill worker",
                               registry=None)  # fmt: skip
        self.migrations = Counter("ferry_router_migrations",
                                  "Requests resumed on another decode worker",
                                  registry=None)  # fmt: skip

    def decided(self, pool: str, seconds: float) -> None:
        self.decisions.labels(pool, self.policy).inc()
        self.decision_seconds.observe(seconds)

    def hits(self, predicted: int, actual: int) -> None:
        self.predicted_hit_tokens.inc(predicted)
        self.actual_hit_tokens.inc(actual)

    def collectors(self) -> list[Collector]:
        return [self.decisions, self.decision_seconds, self.predicted_hit_tokens,
                self.actual_hit_tokens, self.retries, self.migrations]  # fmt: skip


_ENCODE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class EncodeMetrics:
    """The encode pool, as this frontend sees its images end (``router.encoding``)."""

    def __init__(self) -> None:
        self.images = Counter("ferry_encode_images", "Images an encode worker delivered, by "
                              "where their embeddings came from (encoded now: none; its "
                              "cache: memory, file)", ["cache"], registry=None)  # fmt: skip
        self.cache_hits = Counter("ferry_encode_cache_hits", "Images served from an encode "
                                  "worker's embedding cache", ["tier"], registry=None)  # fmt: skip
        self.seconds = Histogram(
            "ferry_encode_seconds", "From sending an image to an encode worker until its "
            "embeddings are in the prefill worker", buckets=_ENCODE_BUCKETS, registry=None,
        )  # fmt: skip
        self.compute_seconds = Histogram(
            "ferry_encode_compute_seconds", "An image's share of decoding, preprocessing "
            "and the vision tower (images encoded now)", buckets=_ENCODE_BUCKETS,
            registry=None,
        )  # fmt: skip
        self.bytes = Counter("ferry_encode_transfer_bytes", "Embedding bytes moved from "
                             "encode to prefill workers", registry=None)  # fmt: skip
        self.failures = Counter("ferry_encode_failures", "Images no encode worker delivered",
                                registry=None)  # fmt: skip
        self.retries = Counter("ferry_encode_retries", "Images sent to another encode worker "
                               "after one failed or died", registry=None)  # fmt: skip

    def delivered(self, cache: str, seconds: float, compute_seconds: float,
                  num_bytes: int) -> None:  # fmt: skip
        self.images.labels(cache or "none").inc()
        if cache:
            self.cache_hits.labels(cache).inc()
        else:
            self.compute_seconds.observe(compute_seconds)
        self.seconds.observe(seconds)
        self.bytes.inc(num_bytes)

    def collectors(self) -> list[Collector]:
        return [self.images, self.cache_hits, self.seconds, self.compute_seconds, self.bytes,
                self.failures, self.retries]  # fmt: skip


class WorkerQueueCollector(Collector):
    """Per-worker queue depths and health, read from the workers' latest stats."""

    def __init__(self, workers: Callable[[], list]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "worker"]
        families = {
            "waiting": GaugeMetricFamily("ferry_worker_requests_waiting",
                                         "Requests queued in a worker", labels=labels),
            "running": GaugeMetricFamily("ferry_worker_requests_running",
                                         "Requests a worker is running", labels=labels),
            "transferring": GaugeMetricFamily(
                "ferry_worker_requests_transferring",
                "Requests whose KV is reserved for or in a transfer", labels=labels),
            "healthy": GaugeMetricFamily("ferry_worker_healthy", "1 while a worker is alive",
                                         labels=labels),
            "inflight": GaugeMetricFamily(
                "ferry_worker_requests_inflight",
                "Requests this frontend has sent a worker and not seen finish", labels=labels),
            "queued": GaugeMetricFamily(
                "ferry_worker_queued_prompt_tokens",
                "Prompt tokens this frontend has sent a worker to compute, not yet computed",
                labels=labels),
        }  # fmt: skip
        for w in self._workers():
            key = [w.role, w.name]
            stats = w.stats
            families["waiting"].add_metric(key, stats.num_waiting if stats else 0)
            families["running"].add_metric(key, stats.num_running if stats else 0)
            families["transferring"].add_metric(key, w.num_transferring)
            families["healthy"].add_metric(key, 1 if w.alive else 0)
            families["inflight"].add_metric(key, w.inflight)
            families["queued"].add_metric(key, w.queued_tokens)
        yield from families.values()

    def describe(self) -> Iterator[Metric]:
        return iter(())


class ExpertLoadCollector(Collector):
    """Expert-parallel groups: each group's ranks and health, each rank's computed
    (token, expert) pairs, the pairs the group routed to each logical expert of each MoE
    layer (summed over its ranks), its rebalances and the balancer's latest max/mean rank
    load; read from the ranks' latest ``ExpertStats``."""

    def __init__(self, groups: Callable[[], dict[str, list]]) -> None:
        self._groups = groups

    def collect(self) -> Iterator[Metric]:
        size = GaugeMetricFamily("ferry_ep_group_ranks", "Ranks of an expert-parallel group",
                                 labels=["group", "role"])
        healthy = GaugeMetricFamily("ferry_ep_group_healthy",
                                    "1 while every rank of an expert-parallel group is alive",
                                    labels=["group"])
        computed = CounterMetricFamily(
            "ferry_ep_rank_computed_pairs",
            "(token, expert) pairs a rank's expert slots computed (its load)",
            labels=["group", "worker"])
        routed = CounterMetricFamily(
            "ferry_expert_routed_pairs",
            "(token, expert) pairs a group's tokens routed to each logical expert",
            labels=["group", "layer", "expert"])
        rebalances = CounterMetricFamily("ferry_eplb_rebalances",
                                         "Expert placements a group switched to",
                                         labels=["group"])
        imbalance = GaugeMetricFamily(
            "ferry_eplb_imbalance",
            "Max/mean rank load the balancer expects after its latest rebalance",
            labels=["group"])  # fmt: skip
        for name, ranks in self._groups().items():
            if not ranks:
                continue
            size.add_metric([name, ranks[0].role], len(ranks))
            healthy.add_metric([name], int(all(r.alive for r in ranks)))
            reports = [(r, r.experts) for r in ranks if r.alive and r.experts is not None]
            for rank, stats in reports:
                computed.add_metric([name, rank.name], stats.computed)
            if not reports:
                continue
            first = reports[0][1]
            total = [sum(col) for col in zip(*(s.routed for _, s in reports))]
            for i, count in enumerate(total):
                layer, expert = divmod(i, first.num_experts)
                routed.add_metric([name, str(first.moe_layers[layer]), str(expert)], count)
            rebalances.add_metric([name], max(s.rebalances for _, s in reports))
            imbalance.add_metric([name], first.imbalance)
        yield from (size, healthy, computed, routed, rebalances, imbalance)

    def describe(self) -> Iterator[Metric]:
        return iter(())
