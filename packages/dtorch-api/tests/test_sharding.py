"""`_sharding`'s corners, through the planner: CPU batch-norm statistics, strided shards of a flattened sharded
dim, the copy_ that torch refuses to plan, value-dependent ops called with keyword arguments. Shapes are
compared with what plain torch gives on the full tensors."""

from __future__ import annotations

import pytest
import torch

from dtorch._planner import plan
from dtorch._sharding import local_shape
from dtorch._spec import StridedShard
from dtorch_protocol.placement_types import Replicate, Shard

aten = torch.ops.aten

_STATS = [  # (op, its arguments after the five tensors): training False and True where the op takes the flag
    (aten.native_batch_norm.default, (False, 0.1, 1e-5)),
    (aten.native_batch_norm.default, (True, 0.1, 1e-5)),
    (aten._native_batch_norm_legit.default, (False, 0.1, 1e-5)),
    (aten._native_batch_norm_legit.default, (True, 0.1, 1e-5)),
    (aten._native_batch_norm_legit_no_training.default, (0.1, 1e-5)),
    (aten._batch_norm_no_update.default, (0.1, 1e-5)),
]


@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["sharded", "replicated"])
@pytest.mark.parametrize("op, rest", _STATS, ids=[f"{op._opname}-{rest[0]}" for op, rest in _STATS])
def test_batch_norm_statistics_have_the_shapes_the_cpu_kernel_gives(spec, mesh2, op, rest, placement):
    """CPU kernels return empty save_mean/save_invstd when not training where the meta kernels say [C]
    (`_CPU_EMPTY_STATS`): every batch-norm op's planned outputs have the shapes plain torch gives."""
    x, c = spec((4, 3, 5), [placement], mesh2), spec((3,), [Replicate()], mesh2)
    real = op(torch.randn(4, 3, 5), torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3), *rest)
    p = plan(op, (x, c, c, c, c, *rest), {})
    assert [tuple(o.shape) for o in p.flat_outputs] == [tuple(t.shape) for t in real]


def test_a_flattened_dim_whose_inner_part_is_sharded_stays_sharded_as_a_strided_shard(spec, mesh2):
    """[2, 4] sharded on dim 1, viewed as [8]: torch's rule gives _StridedShard(0, split_factor=2); nothing moves,
    and each device's shard is its [2, 2] block flattened, as in torch."""
    x = spec((2, 4), [Shard(1)], mesh2)
    p = plan(aten.view.default, (x, [8]), {})
    assert p.route == "sharded" and p.inputs == [None]
    assert p.outputs.placements == (StridedShard(0, 2),) and p.outputs.shape == (8,)
    full = torch.arange(8.0).reshape(2, 4)
    assert [local_shape(p.outputs, (d,)) for d in range(2)] == \
        [tuple(full[:, 2 * d:2 * d + 2].reshape(-1).shape) for d in range(2)]


def test_a_copy_torch_will_not_plan_moves_the_source_to_the_destinations_layout(spec, mesh2):
    """torch has no copy_ strategy for a self sharded on a dim smaller than the mesh: self stays where it is (moving
    it would be written back with copy_ again), the source moves to self's layout, and the output is self."""
    self, src = spec((1, 4), [Shard(0)], mesh2), spec((1, 4), [Replicate()], mesh2)
    p = plan(aten.copy_.default, (self, src), {})
    assert p.route == "sharded" and p.inputs[0] is None
    assert p.inputs[1].placements == (Shard(0),) and p.inputs[1].shape == (1, 4)
    assert p.outputs.placements == (Shard(0),) and p.outputs.shape == (1, 4)


@pytest.mark.parametrize("op, args, kwargs", [
    (aten._unique2.default, "x", {"sorted": True, "return_inverse": True}),
    (aten.repeat_interleave.Tensor, "r", {"output_size": None}),
], ids=["unique", "repeat_interleave"])
def test_value_dependent_ops_with_keyword_arguments_take_the_local_route(spec, mesh2, op, args, kwargs):
    """The fake-tensor check that tells value-dependent shapes from refusals gets the keyword arguments too."""
    leaf = spec((6,), [Shard(0)], mesh2) if args == "x" else spec((4,), [Shard(0)], mesh2, torch.int64)
    p = plan(op, (leaf,), kwargs)
    assert p.route == "local" and "depend on the values" in p.why


def test_a_rule_that_answers_with_placements_for_another_mesh_rank_is_no_rule(mesh2):
    """torch versions differ in their rules' answers: placements that do not fit the mesh (one per mesh dim) make
    the op take the route for ops without a rule, instead of a layout the controller refuses at the next sync."""
    from torch.distributed.tensor import placement_types as tp

    from dtorch._registry import NoRule
    from dtorch._sharding import _placements

    assert _placements([tp.Shard(0)], mesh2) == (Shard(0),)
    with pytest.raises(NoRule, match=r"torch's rule gave 2 placements for a 1-d mesh"):
        _placements([tp.Shard(0), tp.Replicate()], mesh2)
