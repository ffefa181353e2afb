"""The GPU tests' shared fixture: which decode-graph replays carried a draft's verify rows."""

from __future__ import annotations

import pytest

from hsserve.engine.executor import Executor


@pytest.fixture
def verified_in_graphs(monkeypatch) -> list[bool]:
    """Per graph replay while the test runs: whether a chunk of it verified a draft."""
    seen: list[bool] = []
    original = Executor._forward_graph

    def forward_graph(self, chunks, *args, **kwargs):
        seen.append(any(c.draft for c in chunks))
        return original(self, chunks, *args, **kwargs)

    monkeypatch.setattr(Executor, "_forward_graph", forward_graph)
    return seen
