"""Prometheus metrics of one server, in a registry of its own (never the process-global default).

Latencies are observed by the engine thread as outputs arrive; engine-side numbers (running / waiting
requests, token counters, KV-block and state-slot usage) are read from `engine.get_stats()` at scrape
time, so they are current without a polling loop.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger(__name__)

PREFIX = "deltaserve"
OUTCOMES = ("stop", "length", "abort", "rejected", "error")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# (EngineStats attribute, metric name, help); gauges first, then counters.
_GAUGES = (
    ("num_running", "num_requests_running", "Requests currently scheduled (prefill or decode)."),
    ("num_waiting", "num_requests_waiting", "Requests waiting to be scheduled."),
    ("kv_blocks_total", "kv_blocks_total", "Paged KV-cache blocks in the pool."),
    ("kv_blocks_used", "kv_blocks_used", "Paged KV-cache blocks in use."),
    ("state_slots_total", "state_slots_total", "GDN recurrent-state slots in the pool."),
    ("state_slots_used", "state_slots_used", "GDN recurrent-state slots in use."),
    ("prefix_cache_blocks", "prefix_cache_blocks", "KV blocks the prefix cache holds."),
    ("prefix_cache_snapshots_total", "prefix_cache_snapshots_total", "Prefix-cache GDN state snapshot slots."),
    ("prefix_cache_snapshots_used", "prefix_cache_snapshots_used", "Prefix-cache GDN state snapshots held."),
)
_COUNTERS = (
    ("prompt_tokens_total", "prompt_tokens", "Prompt tokens processed."),
    ("generation_tokens_total", "generation_tokens", "Tokens generated."),
    ("num_preempted_total", "num_preemptions", "Requests preempted (their cache dropped, recomputed later)."),
    ("prefix_cache_queries_total", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits_total", "prefix_cache_hits", "Prompt tokens resumed from the prefix cache."),
    ("prefix_cache_snapshot_evictions_total", "prefix_cache_snapshot_evictions",
     "Prefix-cache GDN state snapshots evicted."),
    ("spec_num_drafts_total", "spec_decode_num_drafts", "Speculative decoding: verify chunks run (one per "
     "sequence and step with drafts)."),
    ("spec_num_draft_tokens_total", "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."),
    ("spec_num_accepted_tokens_total", "spec_decode_num_accepted_tokens",
     "Speculative decoding: draft tokens accepted."),
)


class ServerMetrics:
    def __init__(self, get_stats: Callable[[], Any] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests by outcome (rejected: invalid "
                                "input, error: server failure, abort: client gone or engine abort).",
                                ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        hist = lambda name, doc: Histogram(f"{PREFIX}_{name}", doc, buckets=_LATENCY_BUCKETS,  # noqa: E731
                                           registry=self.registry)
        self.time_to_first_token = hist("time_to_first_token_seconds", "Arrival to first generated token.")
        self.inter_token_latency = hist("inter_token_latency_seconds", "Time between generated tokens.")
        self.e2e_latency = hist("e2e_request_latency_seconds", "Arrival to last token of finished requests.")
        if get_stats is not None:
            self.registry.register(_EngineStatsCollector(get_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineStatsCollector:
    def __init__(self, get_stats: Callable[[], Any]):
        self._get_stats = get_stats

    def describe(self):
        return []  # names are only known from the live stats object

    def collect(self):
        try:
            stats = self._get_stats()
        except Exception:  # a scrape must never take the server down
            logger.exception("engine.get_stats() failed")
            return
        for attr, name, doc in _GAUGES:
            value = getattr(stats, attr, None)
            if value is not None:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        total, used = getattr(stats, "kv_blocks_total", None), getattr(stats, "kv_blocks_used", None)
        if total and used is not None:
            yield GaugeMetricFamily(f"{PREFIX}_kv_cache_usage_ratio", "Fraction of KV blocks in use.",
                                    value=used / total)
        for attr, name, doc in _COUNTERS:
            value = getattr(stats, attr, None)
            if value is not None:
                yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        per_pos = getattr(stats, "spec_num_accepted_tokens_per_pos", None)
        if per_pos:
            family = CounterMetricFamily(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                         "Speculative decoding: draft tokens accepted at each draft position "
                                         "(0: the first draft).", labels=["position"])
            for position, value in sorted(per_pos.items()):
                family.add_metric([str(position)], float(value))
            yield family
