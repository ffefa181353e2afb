"""Prometheus metrics through the Python backend's metrics API, labelled by model + version,
refreshed off the hot path by the adapter's watcher thread: gauges are set, counters advanced by
what the engine counted since the last refresh, histograms fed the latencies it recorded.

Histograms are exposed as Prometheus' histogram series (name_bucket{le}, name_sum, name_count) made
of counters: each refresh adds the new observations' bucket counts in one call per series. Every
call into the backend's metrics API is an IPC round trip from the stub, and the API's own
histogram takes one observe() per value: at 64 streams the inter-token histogram alone made about
20,000 such calls a second, each holding up the engine and the response sender.
"""

from __future__ import annotations

import bisect

from hsserve.engine.stats import EngineSnapshot

_GAUGES = {
    "running": ("llm_requests_running", "Sequences being computed by the engine"),
    "waiting": ("llm_requests_waiting", "Sequences queued in the engine"),
    "blocks_used": ("llm_kv_blocks_in_use", "KV-cache blocks held by requests"),
    "blocks_total": ("llm_kv_blocks_total", "KV-cache blocks in the pool"),
    "blocks_cached": ("llm_kv_blocks_cached", "KV-cache blocks indexed by the prefix cache"),
}
_COUNTERS = {  # key -> (name, description); advanced by the engine's running total
    "prompt_tokens": ("llm_prompt_tokens_total", "Prompt tokens of admitted requests"),
    "generation_tokens": ("llm_generation_tokens_total", "Tokens generated"),
    "draft_tokens": ("llm_spec_draft_tokens_total", "Speculative tokens proposed"),
    "accepted_tokens": ("llm_spec_accepted_tokens_total", "Speculative tokens the target accepted"),
    "query_tokens": ("llm_prefix_cache_query_tokens_total", "Prompt tokens looked up in the prefix cache"),
    "hit_tokens": ("llm_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache"),
    "graph_captures": ("llm_graph_captures_total", "CUDA graphs captured (all at start)"),
}
_HISTOGRAMS = {  # key -> (name, description, buckets in seconds)
    "ttft": ("llm_time_to_first_token_seconds", "Submit to first generated token",
             [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]),
    "itl": ("llm_inter_token_latency_seconds", "Between consecutive tokens of a sequence",
            [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]),
    "latency": ("llm_request_latency_seconds", "Submit to the request's last response",
                [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]),
}
# NOTE: every key above is a field of EngineSnapshot


class _Histogram:
    """name_bucket{le} (cumulative), name_sum, name_count as counters, advanced once per refresh."""

    def __init__(self, fam, name: str, desc: str, edges: list[float], labels: dict[str, str]):
        self.edges = sorted(edges)
        self.families = [fam(name=f"{name}_{part}", description=f"{desc} ({part})", kind=fam.COUNTER)
                         for part in ("bucket", "sum", "count")]
        les = [repr(float(e)) for e in self.edges] + ["+Inf"]
        self.buckets = [self.families[0].Metric(labels={**labels, "le": le}) for le in les]
        self.sum = self.families[1].Metric(labels=labels)
        self.count = self.families[2].Metric(labels=labels)

    def observe_all(self, values: list[float]) -> None:
        if not values:
            return
        values = sorted(values)
        # NOTE: count and +Inf first, then the buckets downwards: a scrape in between still sees
        # cumulative counts (a lower bucket never ahead of a higher one)
        self.count.increment(len(values))
        self.sum.increment(sum(values))
        self.buckets[-1].increment(len(values))
        for metric, edge in reversed(list(zip(self.buckets, self.edges))):
            below = bisect.bisect_right(values, edge)  # NOTE: le is inclusive
            if below:
                metric.increment(below)


class EngineMetrics:
    def __init__(self, pb_utils, labels: dict[str, str]):
        fam = pb_utils.MetricFamily
        self._families, self._metrics = {}, {}  # NOTE: a family must outlive its metrics
        for key, (name, desc) in _GAUGES.items():
            self._families[key] = fam(name=name, description=desc, kind=fam.GAUGE)
            self._metrics[key] = self._families[key].Metric(labels=labels)
        for key, (name, desc) in _COUNTERS.items():
            self._families[key] = fam(name=name, description=desc, kind=fam.COUNTER)
            self._metrics[key] = self._families[key].Metric(labels=labels)
        self.histograms = {key: _Histogram(fam, name, desc, buckets, labels)
                           for key, (name, desc, buckets) in _HISTOGRAMS.items()}
        self._counted = dict.fromkeys(_COUNTERS, 0)

    def refresh(self, snap: EngineSnapshot) -> None:
        for key in _GAUGES:
            self._metrics[key].set(getattr(snap, key))
        for key in _COUNTERS:
            now = getattr(snap, key)
            if now > self._counted[key]:
                self._metrics[key].increment(now - self._counted[key])
                self._counted[key] = now
        for key, histogram in self.histograms.items():
            histogram.observe_all(getattr(snap, key))
