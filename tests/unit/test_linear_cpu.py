"""CPU linears without the compiled product serve every row count; pack_for_cpu chooses as told.

CPU linears without the compiled product (its library unavailable; the compiled one is tested in
tests/kernels/test_cpu_ops.py): the oneDNN-packed weight for several rows, the dense one (MKL)
for one row where it is kept, MKL's packed one for 17-32 rows where made, and pack_for_cpu's
choices (by the CPU's vendor and the model's size, never by timing)."""

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
    assert pack_for_cpu(model, keep_dense=keep, compiled=False)
    for m in [*model.a, model.b]:
        assert m.packed is not None
        assert (m.weight is not None) == keep


@pytest.mark.parametrize("intel", [True, False])
def test_pack_for_cpu_keeps_dense_weights_where_mkl_is_preferred(monkeypatch, intel):
    monkeypatch.setattr(linear_mod, "mkl_gemv_preferred", lambda: intel)
    model = _model()
    assert pack_for_cpu(model, compiled=False)
    assert all((m.weight is not None) == intel for m in [*model.a, model.b])


def test_models_too_large_to_hold_twice_keep_no_dense_weight(monkeypatch):
    monkeypatch.setattr(linear_mod, "_KEEP_DENSE_MAX_BYTES", 1000)
    monkeypatch.setattr(linear_mod, "mkl_gemv_preferred", lambda: True)
    model = _model()
    assert pack_for_cpu(model, compiled=False)
    assert all(m.weight is None for m in [*model.a, model.b])


_mkl = pytest.mark.skipif(not linear_mod._mkl_packing_available(), reason="no MKL packing")


@_mkl
def test_mkl_packed_weight_serves_17_to_32_rows_padded():
    m = _linear(48, 32, 2)
    w = m.weight.detach().clone()
    m.pack(mkl_rows=True)
    assert m.weight is not None and m.mkl_packed is not None, "MKL's product needs the dense weight"
    # NOTE: MKL's packed copy made of another weight tells the paths apart
    m.mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(3 * w, linear_mod._MKL_ROWS)
    for rows in (17, 20, 32):
        x = torch.randn(rows, 32)
        y = m(x)
        assert y.shape == (rows, 48) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, 3 * w), rtol=1e-5, atol=1e-5)
        into = torch.ones(rows, 48)
        torch.testing.assert_close(m(x, into=into), 1 + F.linear(x, 3 * w), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 10, 32)  # NOTE: leading dims flattened to 20 rows and restored
    torch.testing.assert_close(m(x), F.linear(x, 3 * w), rtol=1e-5, atol=1e-5)
    for rows in (1, 16, 33):  # NOTE: outside 17..32 the other paths (the true weight)
        x = torch.randn(rows, 32)
        torch.testing.assert_close(m(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


@_mkl
def test_a_rows_result_does_not_depend_on_the_other_rows_padded_with_it():
    m = _linear(96, 64, 3)
    m.pack(mkl_rows=True)
    x = torch.randn(32, 64)
    full = m(x)
    for rows in (17, 25):
        assert torch.equal(m(x[:rows]), full[:rows])


@pytest.mark.parametrize("intel", [True, False])
def test_pack_for_cpu_adds_mkl_packs_on_intel_for_small_models(monkeypatch, intel):
    monkeypatch.setattr(linear_mod, "mkl_gemv_preferred", lambda: intel)
    model = _model()
    assert pack_for_cpu(model, compiled=False)
    want = intel and linear_mod._mkl_packing_available()
    assert all((m.mkl_packed is not None) == want for m in [*model.a, model.b])
    monkeypatch.setattr(linear_mod, "_MKL_PACK_MAX_BYTES", 1000)
    model = _model()
    assert pack_for_cpu(model, compiled=False)
    assert all(m.mkl_packed is None for m in [*model.a, model.b]), "too large: no MKL packs"


@_mkl
def test_mkl_packed_weight_with_bias():
    m = Linear(32, 48, bias=True)
    g = torch.Generator().manual_seed(4)
    m.weight.data = torch.randn(48, 32, generator=g)
    m.bias.data = torch.randn(48, generator=g)
    w, b = m.weight.detach().clone(), m.bias.detach().clone()
    m.pack(mkl_rows=True)
    for rows in (1, 17, 32, 40):
        x = torch.randn(rows, 32, generator=g)
        torch.testing.assert_close(m(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
