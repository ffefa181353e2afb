"""CPU linears: the oneDNN-packed weight for several rows, the dense one (MKL) for one row where
it is kept, and pack_for_cpu's choice (by the CPU's vendor, never by timing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hsserve.models import linear as linear_mod
from hsserve.models.linear import Linear, pack_for_cpu

pytestmark = pytest.mark.skipif(not linear_mod._packing_available(), reason="no oneDNN packing")


def _linear(n: int, k: int, seed: int) -> Linear:
    m = Linear(k, n)
    m.weight.data = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return m


def test_kept_dense_weight_serves_one_row_packed_serves_more():
    m = _linear(48, 32, 0)
    w = m.weight.detach().clone()
    m.pack(keep_dense=True)
    # NOTE: the packed copy made of another weight tells the two paths apart
    m.packed = torch.ops.mkldnn._reorder_linear_weight(2 * w, 32)
    x = torch.randn(3, 32)
    assert torch.equal(m(x[:1]), F.linear(x[:1], w)), "one row: the dense weight"
    torch.testing.assert_close(m(x), F.linear(x, 2 * w), rtol=1e-5, atol=1e-5)
    into = torch.ones(1, 48)
    assert torch.equal(m(x[:1], into=into), 1 + F.linear(x[:1], w)), "one row added in place"


def test_packed_only_serves_every_row_count():
    m = _linear(48, 32, 1)
    w = m.weight.detach().clone()
    m.pack(keep_dense=False)
    assert m.weight is None and m.packed is not None
    for rows in (1, 2, 7):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(m(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


def _model() -> nn.Module:
    model = nn.Module()
    model.a = nn.ModuleList(_linear(64, 32, i) for i in range(3))
    model.b = _linear(16, 64, 9)
    return model


@pytest.mark.parametrize("keep", [True, False])
def test_pack_for_cpu_keeps_or_drops_the_dense_weights_as_told(keep):
    model = _model()
    assert pack_for_cpu(model, keep_dense=keep)
    for m in [*model.a, model.b]:
        assert m.packed is not None
        assert (m.weight is not None) == keep


@pytest.mark.parametrize("intel", [True, False])
def test_pack_for_cpu_keeps_dense_weights_where_mkl_is_preferred(monkeypatch, intel):
    monkeypatch.setattr(linear_mod, "mkl_gemv_preferred", lambda: intel)
    model = _model()
    assert pack_for_cpu(model)
    assert all((m.weight is not None) == intel for m in [*model.a, model.b])


def test_models_too_large_to_hold_twice_keep_no_dense_weight(monkeypatch):
    monkeypatch.setattr(linear_mod, "_KEEP_DENSE_MAX_BYTES", 1000)
    monkeypatch.setattr(linear_mod, "mkl_gemv_preferred", lambda: True)
    model = _model()
    assert pack_for_cpu(model)
    assert all(m.weight is None for m in [*model.a, model.b])
