"""Async scheduling (a decode step queued before the previous one is read) changes nothing a client
sees (async_cases). On the CPU the steps do not overlap in time, but the engine takes the same
path: steps queued ahead, their inputs read from the device, void samples of stopped sequences,
the last token's row taken from the step ahead, preemption after draining."""

from __future__ import annotations

from async_cases import check_async_equals_sync


def test_async_equals_sync(tiny_model_dir):
    check_async_equals_sync(tiny_model_dir("llama"), "cpu", vocab=40000, tol=1e-4)
