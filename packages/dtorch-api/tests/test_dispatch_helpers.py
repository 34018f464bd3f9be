"""Planning helpers that need no cluster: out= arguments and their functional overloads."""

from __future__ import annotations

import torch

from dtorch import _planner

aten = torch.ops.aten


def test_out_names_and_functional_overloads():
    assert _planner.outs(aten.cumsum.out) == ("out",)
    assert _planner.outs(aten.sort.values) == ("values", "indices")
    assert _planner.outs(aten.add.Tensor) == ()
    assert _planner.functional(aten.cumsum.out) is aten.cumsum.default
    assert _planner.functional(aten.add.out) is aten.add.Tensor
    assert _planner.functional(aten.sort.values) is aten.sort.default
    assert _planner.functional(aten.nonzero.out) is aten.nonzero.default


def test_writes_lists_in_place_and_out_arguments():
    assert _planner.writes(aten.add_.Tensor) == [(0, "self")]
    assert [n for _, n in _planner.writes(aten.sort.values)] == ["values", "indices"]
    assert _planner.writes(aten.add.Tensor) == []
