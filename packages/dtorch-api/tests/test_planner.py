"""The planner (`_planner`): an op and the specs of its DTensors give a plan, with no session and no cluster;
the bounded plan cache; the rule registry it reads through `_sharding`."""

from __future__ import annotations

import pytest
import torch

from dtorch import _planner, _registry
from dtorch._planner import MixedMeshes, Planner, plan
from dtorch._registry import NoRule, Propagation, Refused
from dtorch.device_mesh import DeviceMesh
from dtorch_protocol.placement_types import Partial, Replicate, Shard

aten = torch.ops.aten


def test_a_sharded_add_moves_nothing_and_takes_the_fast_path(spec, mesh2):
    a, b = spec((4, 3), [Shard(0)], mesh2), spec((4, 3), [Shard(0)], mesh2)
    p = plan(aten.add.Tensor, (a, b), {})
    assert p.route == "sharded" and p.op_name == "aten.add.Tensor"
    assert p.inputs == [None, None]
    assert p.outputs.placements == (Shard(0),) and p.outputs.shape == (4, 3)
    assert p.args == [{"$t": 0}, {"$t": 1}] and p.kwargs == {}
    assert p.encode is not None


def test_inputs_that_must_move_are_named_with_their_target_layout(spec, mesh2):
    a, b = spec((4, 3), [Shard(0)], mesh2), spec((4, 3), [Shard(1)], mesh2)
    p = plan(aten.add.Tensor, (a, b), {})
    moved = [i for i, target in enumerate(p.inputs) if target is not None]
    assert len(moved) == 1
    target = p.inputs[moved[0]]
    assert target.placements == p.outputs.placements and target.shape == (4, 3)
    assert p.encode is None  # moves go through the general path


def test_matmul_of_a_contracted_shard_gives_a_partial_sum(spec, mesh2):
    x, w = spec((8, 4), [Shard(1)], mesh2), spec((4, 6), [Shard(0)], mesh2)
    p = plan(aten.mm.default, (x, w), {})
    assert p.route == "sharded" and p.inputs == [None, None]
    assert p.outputs.placements == (Partial("sum"),) and p.outputs.shape == (8, 6)


def test_scalars_are_part_of_the_wire_template(spec, mesh2):
    a = spec((4,), [Shard(0)], mesh2)
    p = plan(aten.add.Scalar, (a, 2.5), {})
    assert p.args == [{"$t": 0}, 2.5]


def test_python_values_are_sync_points_and_value_shaped_outputs_take_the_local_route(spec, mesh2):
    a = spec((4,), [Shard(0)], mesh2)
    assert plan(aten._local_scalar_dense.default, (spec((), None, mesh2),), {}).route == "sync"
    assert plan(aten.nonzero.default, (a,), {}).route == "local"


def test_random_ops_run_replicated_under_a_seed(spec, mesh2):
    a = spec((4, 4), [Shard(0)], mesh2)
    p = plan(aten.bernoulli.p, (a, 0.5), {})
    assert p.route == "replicate" and p.random
    assert [t.placements for t in p.inputs] == [(Replicate(),)]
    assert p.outputs.placements == (Replicate(),)


def test_in_place_ops_name_the_leaves_they_write(spec, mesh2):
    a, b = spec((4,), [Shard(0)], mesh2), spec((4,), [Shard(0)], mesh2)
    p = plan(aten.add_.Tensor, (a, b), {})
    assert p.inplace and p.mutated == frozenset({0}) and p.encode is None


def test_out_tensors_shaped_unlike_the_result_take_the_out_route(spec, mesh2):
    a, out = spec((4,), [Shard(0)], mesh2), spec((0,), [Replicate()], mesh2)  # torch would resize out
    p = plan(aten.neg.out, (a,), {"out": out})
    assert p.route == "out" and p.func is aten.neg.default


def test_operands_on_two_meshes_are_refused_for_the_dispatcher_to_move(spec, mesh2):
    other = DeviceMesh("cpu", [2, 3])
    with pytest.raises(MixedMeshes):
        plan(aten.add.Tensor, (spec((4,), [Shard(0)], mesh2), spec((4,), [Shard(0)], other)), {})


def test_the_cache_is_bounded_and_drops_the_oldest_plan_first(spec, mesh2):
    planner = Planner(size=2)
    a = spec((4,), [Shard(0)], mesh2)
    for op in (aten.neg.default, aten.abs.default, aten.exp.default):
        planner.plan(op, op, (a,), {})
    assert len(planner) == 2
    assert planner.get(aten.neg.default) is None
    assert planner.get(aten.exp.default).op_name == "aten.exp.default"
    planner.plan(None, aten.sin.default, (a,), {})  # no key: planned, not kept
    assert len(planner) == 2


def test_a_registered_rule_is_what_the_planner_uses(spec, mesh2, monkeypatch):
    calls = []

    def rule(func, args, kwargs, mesh):
        calls.append(func)
        x = args[0]
        return Propagation(func, args, kwargs, None, x)

    monkeypatch.setitem(_registry._RULES, aten.neg.default, rule)
    p = plan(aten.neg.default, (spec((4, 2), [Shard(1)], mesh2),), {})
    assert calls == [aten.neg.default] and p.outputs.placements == (Shard(1),)

    def refuse(func, args, kwargs, mesh):
        raise NoRule("not these placements")

    monkeypatch.setitem(_registry._RULES, aten.neg.default, refuse)
    assert plan(aten.neg.default, (spec((4, 2), [Shard(1)], mesh2),), {}).route == "replicate"


def test_registering_a_second_rule_for_an_op_is_refused(monkeypatch):
    monkeypatch.setattr(_registry, "_RULES", {})

    @_registry.register(aten.neg.default)
    def first(func, args, kwargs, mesh):
        raise NoRule

    with pytest.raises(ValueError, match=r"aten.neg.default already has the rule .*first"):
        _registry.register(aten.neg.default)(lambda *a: None)
    assert _registry.rule_for(aten.neg.default) is first


def test_dtorchs_own_attention_rules_are_registered():
    assert _registry.rule_for(aten._scaled_dot_product_flash_attention_for_cpu.default) is not None
    assert _registry.rule_for(aten._scaled_dot_product_flash_attention_for_cpu_backward.default) is not None
    assert _planner.WORKER_NAMESPACES == ("aten", "prims")


# The ops docs/architecture.md lists under "Ops that run on the client": each takes the route it says.
def _client_ops(spec, mesh):
    f, i, b = (spec((8,), [Shard(0)], mesh, dtype) for dtype in (torch.float32, torch.int64, torch.bool))
    return [
        (aten._local_scalar_dense.default, (spec((), None, mesh),), {}, "sync"),
        (aten.is_nonzero.default, (spec((), None, mesh),), {}, "sync"),
        (aten.equal.default, (f, f), {}, "sync"),
        (aten.nonzero.default, (f,), {}, "local"),
        (aten._unique2.default, (f,), {}, "local"),
        (aten.unique_consecutive.default, (f,), {}, "local"),
        (aten.unique_dim.default, (spec((4, 2), None, mesh), 0), {}, "local"),
        (aten.masked_select.default, (f, b), {}, "local"),
        (aten.bincount.default, (i,), {}, "local"),
        (aten.repeat_interleave.Tensor, (i,), {}, "local"),
        (aten.index.Tensor, (f, [b]), {}, "local"),  # x[mask]
    ]


def test_the_documented_client_side_ops_take_the_sync_or_local_route(spec, mesh2):
    for op, args, kwargs, route in _client_ops(spec, mesh2):
        p = plan(op, args, kwargs)
        assert (p.route, p.why) == (route, _planner.PYTHON_VALUE if route == "sync" else _planner.VALUE_DEPENDENT), op


def test_shapes_or_dtypes_torch_refuses_are_refused_with_torchs_own_error(spec, mesh2):
    with pytest.raises(Refused) as info:
        plan(aten.mm.default, (spec((4, 3), [Shard(0)], mesh2), spec((5, 2), [Replicate()], mesh2)), {})
    assert info.value.error_type is RuntimeError
    assert info.value.message == "a and b must have same reduction dim, but got [4, 3] X [5, 2]."
    with pytest.raises(Refused):
        plan(aten.linalg_inv.default, (spec((3, 3), None, mesh2, torch.int64),), {})
    with pytest.raises(Refused):
        plan(aten.add.Tensor, (spec((4, 3), [Shard(0)], mesh2), spec((4, 5), [Shard(0)], mesh2)), {})


def test_an_in_place_pointwise_op_whose_result_type_self_cannot_hold_is_refused_as_torch_refuses_it(spec, mesh2):
    """`_sharding.check_inplace_cast`: meta kernels take `long.mul_(0.5)`; torch's TensorIterator refuses it. Ops
    whose result self can hold (a comparison into a float, a long added to a float) plan as before."""
    long, f32 = spec((4,), [Shard(0)], mesh2, torch.int64), spec((4,), [Shard(0)], mesh2)
    with pytest.raises(Refused) as info:
        plan(aten.mul_.Tensor, (long, 0.5), {})
    assert (info.value.error_type, info.value.message) == \
        (RuntimeError, "result type Float can't be cast to the desired output type Long")
    with pytest.raises(Refused, match="result type ComplexFloat can't be cast to the desired output type Float"):
        plan(aten.add_.Tensor, (f32, spec((4,), [Shard(0)], mesh2, torch.complex64)), {})
    assert plan(aten.add_.Tensor, (f32, long), {}).inplace
    assert plan(aten.lt_.Tensor, (f32, f32), {}).outputs.dtype == torch.float32


@pytest.mark.parametrize("op", [aten.view.default, aten._unsafe_view.default], ids=["view", "_unsafe_view"])
def test_views_go_to_the_workers_as_reshapes(spec, mesh2, op):
    """A shard's strides can differ from the global tensor's, so a view valid globally may not be locally: the
    workers run reshape (`_WIRE_NAME`), which is that view wherever one exists."""
    p = plan(op, (spec((4, 3), [Shard(0)], mesh2), [2, 6]), {})
    assert p.route == "sharded" and p.op_name == "aten.reshape.default"
    assert p.outputs.shape == tuple(op(torch.randn(4, 3), [2, 6]).shape)
