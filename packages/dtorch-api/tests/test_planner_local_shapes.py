"""Plans where a device's local shape differs from what torch's global rule assumes: empty shards of a small
dim, shards a kernel refuses, CPU kernels whose outputs differ from the meta kernel's. Each plan's output
shapes are compared with what plain torch gives on the full tensors."""

from __future__ import annotations

import pytest
import torch

from dtorch._planner import plan
from dtorch.device_mesh import DeviceMesh
from dtorch_protocol.placement_types import Partial, Replicate, Shard

aten = torch.ops.aten


def _shapes(outputs) -> list:
    return [tuple(o.shape) for o in (outputs if isinstance(outputs, (list, tuple)) else [outputs])]


@pytest.mark.parametrize("op", [aten.max.default, aten.amax.default])
def test_a_max_over_an_empty_shard_runs_replicated(spec, mesh2, op):
    """(1, 4) split over 2 devices leaves device 1 nothing, and torch refuses the max of nothing; with a row each
    the max is a Partial(max) of the shards."""
    p = plan(op, (spec((1, 4), [Shard(0)], mesh2),), {})
    assert p.route == "replicate" and p.outputs.placements == (Replicate(),)
    assert p.inputs[0].placements == (Replicate(),)
    p = plan(op, (spec((2, 4), [Shard(0)], mesh2),), {})
    assert p.route == "sharded" and p.outputs.placements == (Partial("max"),) and p.inputs == [None]
    assert _shapes(p.outputs) == [tuple(op(torch.randn(2, 4)).shape)]


def test_a_sum_over_an_empty_shard_stays_a_partial_sum(spec, mesh2):
    """The sum of nothing is 0, the identity of the sum: no need to gather."""
    p = plan(aten.sum.default, (spec((1, 4), [Shard(0)], mesh2),), {})
    assert p.route == "sharded" and p.outputs.placements == (Partial("sum"),) and p.inputs == [None]


def test_an_elementwise_op_with_an_empty_shard_stays_sharded(spec, mesh2):
    a = spec((1, 4), [Shard(0)], mesh2)
    p = plan(aten.add.Tensor, (a, a), {})
    assert p.route == "sharded" and p.inputs == [None, None] and p.outputs.placements == (Shard(0),)


def test_a_reduction_with_keyword_arguments_keeps_them_in_its_local_check(spec, mesh2):
    p = plan(aten.sum.dim_IntList, (spec((1, 4), [Shard(0)], mesh2), [1]), {"keepdim": True})
    assert p.route == "sharded" and p.outputs.placements == (Shard(0),)
    assert _shapes(p.outputs) == [tuple(torch.randn(1, 4).sum([1], keepdim=True).shape)]


def test_a_shard_the_kernel_refuses_falls_back_to_replicate(spec, mesh2):
    """pixel_unshuffle(2) of 6 rows split in 3 + 3: each device's 3 rows do not divide by 2."""
    p = plan(aten.pixel_unshuffle.default, (spec((1, 1, 6, 4), [Shard(2)], mesh2), 2), {})
    assert p.route == "replicate"
    assert _shapes(p.outputs) == [tuple(torch.pixel_unshuffle(torch.randn(1, 1, 6, 4), 2).shape)]
    p = plan(aten.pixel_unshuffle.default, (spec((1, 1, 8, 4), [Shard(2)], mesh2), 2), {})  # 4 + 4 rows
    assert p.route == "sharded"


def test_a_squeeze_of_a_dim_sharded_to_size_one_is_not_planned_sharded(spec, mesh2):
    p = plan(aten.squeeze_copy.dim, (spec((2, 4), [Shard(0)], mesh2), 0), {})
    assert p.route == "replicate"
    assert _shapes(p.outputs) == [tuple(torch.squeeze_copy(torch.randn(2, 4), 0).shape)]


def test_batch_norm_inference_on_cpu_gets_the_cpu_kernels_empty_statistics(spec, mesh2):
    x, c = spec((4, 3), [Shard(0)], mesh2), spec((3,), [Replicate()], mesh2)
    real = aten.native_batch_norm.default(torch.randn(4, 3), torch.ones(3), torch.zeros(3), torch.zeros(3),
                                          torch.ones(3), False, 0.1, 1e-5)
    p = plan(aten.native_batch_norm.default, (x, c, c, c, c, False, 0.1, 1e-5), {})
    assert _shapes(p.outputs) == [tuple(t.shape) for t in real] == [(4, 3), (0,), (0,)]
    assert [o.stride for o in p.outputs[1:]] == [(1,), (1,)]
    assert [o.dtype for o in p.outputs] == [t.dtype for t in real]


def test_a_rule_of_our_own_gives_torchs_output_shapes(spec, mesh2):
    """DTorch's own attention rule (sequence-parallel flash attention on CPU) takes its shapes from the meta
    kernel: they must be torch's."""
    q = spec((1, 2, 8, 4), [Shard(1)], mesh2)
    p = plan(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q), {})
    real = aten._scaled_dot_product_flash_attention_for_cpu.default(*(torch.randn(1, 2, 8, 4) for _ in range(3)))
    assert p.route == "sharded"
    assert _shapes(p.outputs) == [tuple(t.shape) for t in real]
    assert [o.placements for o in p.outputs] == [(Shard(1),), (Shard(1),)]


def test_filling_a_partial_sum_puts_the_value_on_one_device_of_each_group(spec, mesh2):
    """The shares of a Partial("sum") add up to the tensor: filling every share with v would make it 2v."""
    p = plan(aten.fill_.Scalar, (spec((4,), [Partial("sum")], mesh2), 3.0), {})
    assert p.route == "sharded" and p.outputs.placements == (Partial("sum"),)
    assert {d: args[1] for d, (args, _) in p.local.items()} == {0: 3.0, 1: 0.0}
    mesh4 = DeviceMesh("cpu", [[0, 1], [2, 3]])  # summed over mesh dim 0; dim 1 shards rows
    p = plan(aten.fill_.Scalar, (spec((4, 4), [Partial("sum"), Shard(0)], mesh4), 3.0), {})
    assert {d: args[1] for d, (args, _) in p.local.items()} == {0: 3.0, 1: 3.0, 2: 0.0, 3: 0.0}
    p = plan(aten.fill_.Scalar, (spec((4,), [Partial("max")], mesh2), 3.0), {})  # max of equal shares is v
    assert p.local is None and p.args == [{"$t": 0}, 3.0]


def test_a_view_of_uneven_shards_is_propagated_once_per_distinct_local_shape(spec, monkeypatch):
    """torch's rule gives each rank its local view sizes; ranks with the same local shapes get the same ones. It
    ran once per rank (0.36 ms a device: 1.5 s a view on 4,096 devices), and every op filled each device's args."""
    from dtorch import _sharding

    mesh = DeviceMesh("cpu", list(range(64)))
    real, calls = _sharding._prop.propagate_op_sharding_non_cached, []
    monkeypatch.setattr(_sharding._prop, "propagate_op_sharding_non_cached", lambda s: calls.append(s) or real(s))
    p = plan(aten.view.default, (spec((1000, 2, 3), [Shard(0)], mesh), [1000, 6]), {})
    rows = [len(c) for c in torch.arange(1000).chunk(64)] + [0]  # 62 devices of 16 rows, one of 8, one of none
    assert {d: args[1] for d, (args, _) in p.local.items()} == {d: [n, 6] for d, n in enumerate(rows)}
    assert len(calls) == 3  # the global rule, then the 8-row and the empty shard (not 63 more)
    assert len({id(t) for t in p.local.values()}) == 3  # one template per distinct set of local shapes
