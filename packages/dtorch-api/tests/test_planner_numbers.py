"""The plan cache and float arguments: an elementwise op is planned once for every value of its numbers."""

from __future__ import annotations

import msgspec
import torch

from dtorch import _planner
from dtorch._planner import Planner, numberless
from dtorch_protocol import messages as m
from dtorch_protocol.placement_types import Partial, Shard

aten = torch.ops.aten


def test_an_elementwise_op_with_new_numbers_is_not_planned_again_and_adds_no_plans(spec, mesh2, monkeypatch):
    planned = []
    real = _planner.plan
    monkeypatch.setattr(_planner, "plan", lambda *a: planned.append(a[0]) or real(*a))
    planner, a, b = Planner(), spec((4,), [Shard(0)], mesh2), spec((4,), [Shard(0)], mesh2)
    first = planner.plan((id(aten.addcdiv_.default), 1, (float, 0.5)), aten.addcdiv_.default, (a, a, b),
                         {"value": 0.5})
    for value in (0.25, -1e-3, float("nan")):
        p = planner.plan((id(aten.addcdiv_.default), 1, (float, value)), aten.addcdiv_.default, (a, a, b),
                         {"value": value})
        assert p.kwargs == {"value": value} or value != value
        assert (p.route, p.inputs, p.outputs, p.args) == (first.route, first.inputs, first.outputs, first.args)
    assert planned == [aten.addcdiv_.default] and len(planner) == 2  # its key and its numberless key
    assert first.kwargs == {"value": 0.5}  # the kept plan keeps its own numbers


def test_a_fast_plan_with_new_numbers_encodes_them(spec, mesh2):
    planner, a = Planner(), spec((4,), [Shard(0)], mesh2)
    planner.plan((1, 2, (float, 2.0)), aten.mul.Tensor, (a, 2.0), {})
    p = planner.plan((1, 2, (float, 3.0)), aten.mul.Tensor, (a, 3.0), {})
    assert p.args == [{"$t": 0}, 3.0] and p.encode is not None
    out = p.encode((p.encode, 7, 8, None, 0))  # a record: (encode, input tid, output tid, code, offset)
    call = msgspec.msgpack.decode(out, type=m.InstrCall) if type(out) is msgspec.Raw else out
    assert call.args == [{"$t": 7}, 3.0] and call.outs[0].tid == 8


def test_other_ops_and_other_argument_types_are_keyed_by_value(spec, mesh2, monkeypatch):
    planned = []
    real = _planner.plan
    monkeypatch.setattr(_planner, "plan", lambda *a: planned.append(a[0]) or real(*a))
    planner, x = Planner(), spec((4, 4), [Shard(0)], mesh2)
    for p in (1.0, 2.0):  # a norm's order is not elementwise: it may change the plan
        planner.plan((3, 4, (float, p)), aten.linalg_vector_norm.default, (x, p), {})
    assert len(planned) == 2
    assert numberless((1, 2, (float, 0.5), (int, 3), (list, ((float, 1.0),)))) == \
        (1, 2, (float, None), (int, 3), (list, ((float, None),)))
    partial = spec((4,), [Partial()], mesh2)  # a plan's layouts come from the specs, not the numbers
    assert planner.plan((5, 6, (float, 1.0)), aten.mul.Tensor, (partial, 1.0), {}).outputs.placements == (Partial(),)
