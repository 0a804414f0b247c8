"""Prometheus metrics for one server, in its own CollectorRegistry (several servers can share a process).

Engine state (requests, KV blocks, token counts, prefix cache) is read at scrape
time from the last ``engine.usage()`` the engine core published (after each step,
lmport.engine.client); latencies are observed as each job's outputs arrive (lmport.server.streaming).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads the engine core's latest usage snapshot on every scrape (at most one step old)."""

    def __init__(self, usage_fn):
        self.usage_fn = usage_fn

    def collect(self):
        usage = self.usage_fn()
        for name, key, doc in (
                ("lmport_requests_running", "running", "Requests in the running batch"),
                ("lmport_requests_waiting", "waiting", "Requests queued, not yet admitted (or preempted)"),
                ("lmport_kv_blocks_used", "blocks_used", "KV cache blocks in use"),
                ("lmport_kv_blocks_total", "blocks_total", "KV cache blocks in the pool")):
            yield GaugeMetricFamily(name, doc, value=usage[key])
        if usage["blocks_total"]:
            yield GaugeMetricFamily("lmport_kv_cache_usage_ratio", "Share of KV cache blocks in use",
                                    value=usage["blocks_used"] / usage["blocks_total"])
        for name, key, doc in (
                ("lmport_generation_tokens", "generated_tokens", "Tokens generated"),
                ("lmport_prompt_tokens", "prompt_tokens", "Prompt tokens received"),
                ("lmport_preemptions", "preemptions", "Sequences preempted for lack of KV blocks"),
                ("lmport_engine_steps", "steps", "Engine steps run")):
            if key in usage:
                yield CounterMetricFamily(name, doc, value=usage[key])
        if "prefix_cache_hit_rate" in usage:   # Engine.usage() has it (lmport.kv.usage)
            yield GaugeMetricFamily("lmport_prefix_cache_hit_rate", "Prefix cache hit rate",
                                    value=float(usage["prefix_cache_hit_rate"]))
        if "spec_verifications" in usage:   # speculative decoding is on (lmport.speculative)
            for name, key, doc in (
                    ("lmport_spec_decode_proposed_tokens", "spec_proposed_tokens", "Proposed tokens verified"),
                    ("lmport_spec_decode_accepted_tokens", "spec_accepted_tokens", "Proposed tokens accepted"),
                    ("lmport_spec_decode_verifications", "spec_verifications",
                     "Sequence steps that verified a proposal")):
                yield CounterMetricFamily(name, doc, value=usage[key])
            yield GaugeMetricFamily("lmport_spec_decode_acceptance_rate", "Accepted / proposed tokens",
                                    value=float(usage["spec_acceptance_rate"]))
            yield GaugeMetricFamily("lmport_spec_decode_mean_acceptance_length",
                                    "Tokens a sequence gains per verifying step, its own token included",
                                    value=float(usage["spec_mean_acceptance_length"]))
        # Everything else the engine reports (prefix cache, host tier, ...), under its own key.
        other = GaugeMetricFamily("lmport_engine_stat", "Other numbers from engine.usage()", labels=["key"])
        for key, value in sorted(usage.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                other.add_metric([key], value)
        yield other


class ReplicaCollector:
    """Each data-parallel replica's health, requests in flight, restarts and usage, labelled by replica."""

    def __init__(self, status_fn):
        self.status_fn = status_fn

    def collect(self):
        replicas = self.status_fn()
        healthy = GaugeMetricFamily("lmport_replica_healthy", "1 while the replica is in rotation", labels=["replica"])
        flight = GaugeMetricFamily("lmport_replica_requests_in_flight", "Requests routed to the replica and not "
                                   "finished", labels=["replica"])
        routed = CounterMetricFamily("lmport_replica_requests_routed", "Requests routed to the replica",
                                     labels=["replica"])
        restarts = CounterMetricFamily("lmport_replica_restarts", "Times the replica was restarted",
                                       labels=["replica"])
        stat = GaugeMetricFamily("lmport_replica_stat", "The replica's engine.usage() numbers",
                                 labels=["replica", "key"])
        for r in replicas:
            label = [str(r["replica"])]
            healthy.add_metric(label, 1.0 if r["healthy"] else 0.0)
            flight.add_metric(label, r["in_flight"])
            routed.add_metric(label, r["routed"])
            restarts.add_metric(label, r["restarts"])
            for key, value in sorted(r["usage"].items()):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    stat.add_metric(label + [key], value)
        yield from (healthy, flight, routed, restarts, stat)


class Metrics:
    def __init__(self, usage_fn):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(usage_fn))
        self.ttft = Histogram("lmport_time_to_first_token_seconds", "Time from request received to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("lmport_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("lmport_request_latency_seconds", "Time from request received to its last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("lmport_requests_finished", "Generations ended, by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.rejected = Counter("lmport_requests_rejected", "HTTP requests refused, by status code",
                                ["status"], registry=self.registry)
