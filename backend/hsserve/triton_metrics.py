"""Prometheus gauges and counters through the Python backend's metrics API, refreshed off the
hot path (the engine's own counters are read and the counters advanced by the difference)."""

from __future__ import annotations


_GAUGES = {
    "running": ("llm_requests_running", "Sequences being computed by the engine"),
    "waiting": ("llm_requests_waiting", "Sequences queued in the engine"),
    "blocks_used": ("llm_kv_blocks_in_use", "KV-cache blocks held by requests"),
    "blocks_total": ("llm_kv_blocks_total", "KV-cache blocks in the pool"),
    "blocks_cached": ("llm_kv_blocks_cached", "KV-cache blocks indexed by the prefix cache"),
}
_COUNTERS = {
    "query_tokens": ("llm_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
    "hit_tokens": ("llm_prefix_cache_hits_total", "Prompt tokens found in the prefix cache"),
}


class EngineGauges:
    """The engine's gauges and counters (names above), labelled by model + version."""

    def __init__(self, pb_utils, labels: dict[str, str]):
        kinds = {**{k: pb_utils.MetricFamily.GAUGE for k in _GAUGES},
                 **{k: pb_utils.MetricFamily.COUNTER for k in _COUNTERS}}
        # NOTE: a family must outlive its metrics: both are kept
        self._families = {
            key: pb_utils.MetricFamily(name=n, description=d, kind=kinds[key])
            for key, (n, d) in {**_GAUGES, **_COUNTERS}.items()
        }
        self._metrics = {key: f.Metric(labels=labels) for key, f in self._families.items()}
        self._counted = dict.fromkeys(_COUNTERS, 0)

    def refresh(self, engine) -> None:
        m, pool = self._metrics, engine.pool
        m["running"].set(engine.num_running)
        m["waiting"].set(engine.num_waiting)
        m["blocks_used"].set(pool.num_used)
        m["blocks_total"].set(pool.num_blocks)
        m["blocks_cached"].set(pool.num_cached)
        for key, now in (("query_tokens", pool.num_query_tokens), ("hit_tokens", pool.num_hit_tokens)):
            if now > self._counted[key]:
                m[key].increment(now - self._counted[key])
                self._counted[key] = now
