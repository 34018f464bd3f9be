"""Planning helpers that need no cluster: out= arguments and their functional overloads."""

from __future__ import annotations

import torch

from dtorch import _dispatch

aten = torch.ops.aten


def test_out_names_and_functional_overloads():
    assert _dispatch._outs(aten.cumsum.out) == ("out",)
    assert _dispatch._outs(aten.sort.values) == ("values", "indices")
    assert _dispatch._outs(aten.add.Tensor) == ()
    assert _dispatch._functional(aten.cumsum.out) is aten.cumsum.default
    assert _dispatch._functional(aten.add.out) is aten.add.Tensor
    assert _dispatch._functional(aten.sort.values) is aten.sort.default
    assert _dispatch._functional(aten.nonzero.out) is aten.nonzero.default


def test_writes_lists_in_place_and_out_arguments():
    assert _dispatch._writes(aten.add_.Tensor) == [(0, "self")]
    assert [n for _, n in _dispatch._writes(aten.sort.values)] == ["values", "indices"]
    assert _dispatch._writes(aten.add.Tensor) == []
