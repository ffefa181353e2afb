"""Prometheus gauges through the Python backend's metrics API, refreshed off the hot path."""

from __future__ import annotations


class EngineGauges:
    """llm_requests_running / waiting, llm_kv_blocks_in_use / total, labelled by model+version."""

    def __init__(self, pb_utils, labels: dict[str, str]):
        gauge = pb_utils.MetricFamily.GAUGE
        names = {
            "running": ("llm_requests_running", "Requests being computed by the engine"),
            "waiting": ("llm_requests_waiting", "Requests queued in the engine"),
            "blocks_used": ("llm_kv_blocks_in_use", "KV-cache blocks held by requests"),
            "blocks_total": ("llm_kv_blocks_total", "KV-cache blocks in the pool"),
        }
        # NOTE: a family must outlive its metrics: both are kept
        self._families = {
            key: pb_utils.MetricFamily(name=n, description=d, kind=gauge)
            for key, (n, d) in names.items()
        }
        self._metrics = {key: f.Metric(labels=labels) for key, f in self._families.items()}

    def refresh(self, engine) -> None:
        m = self._metrics
        m["running"].set(engine.num_running)
        m["waiting"].set(engine.num_waiting)
        m["blocks_used"].set(engine.pool.num_used)
        m["blocks_total"].set(engine.pool.num_blocks)
