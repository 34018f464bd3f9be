"""`dtorch.debug` on the embedded cluster: CommDebugMode counts a block's collectives as torch's CommDebugMode does
(per kind, per module and phase; under automatic capture and compiled steps too), and visualize_sharding prints
which devices hold which part."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.debug import CommDebugMode, visualize_sharding
from dtorch.debug._visualize_sharding import render
from dtorch.nn import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

c10d = torch.ops.c10d_functional


def _counts(fn):
    with CommDebugMode() as comm:
        out = fn()
    return dict(comm.get_comm_counts()), out


def test_each_redistribution_counts_the_collective_torch_issues_for_it(mesh1, mesh2d):
    full = torch.randn(8, 6)
    x = dtorch.distribute_tensor(full, mesh1, [Shard(0)])
    p = dtorch.DTensor.from_local(full, mesh1, [Partial()])  # (one summand per device: the value is 2 x full)
    cases = [
        (lambda: x.redistribute(mesh1, [Replicate()]), {c10d.all_gather_into_tensor: 1}, full),
        (lambda: x.redistribute(mesh1, [Shard(1)]), {c10d.all_to_all_single: 1}, full),
        (lambda: p.redistribute(mesh1, [Replicate()]), {c10d.all_reduce: 1}, 2 * full),
        (lambda: p.redistribute(mesh1, [Shard(0)]), {c10d.reduce_scatter_tensor: 1}, 2 * full),
        (lambda: x.redistribute(mesh1, [Replicate()]).redistribute(mesh1, [Shard(1)]),
         {c10d.all_gather_into_tensor: 1}, full),  # Replicate -> Shard is a local slice
        (lambda: x + 1, {}, full + 1),
    ]
    for fn, expected, value in cases:
        counts, out = _counts(fn)
        assert counts == expected, fn
        torch.testing.assert_close(out.to_torch(), value)
    # a read and a small upload move data between the client and the workers: no collective (rule 2)
    assert _counts(lambda: (x.sum().item(), dtorch.distribute_tensor(full, mesh1, [Replicate()])))[0] == {}
    # a 2-D mesh: one collective per mesh dim that changes
    y = dtorch.distribute_tensor(full, mesh2d, [Shard(0), Shard(1)])
    counts, out = _counts(lambda: y.redistribute(mesh2d, [Replicate(), Replicate()]))
    assert counts == {c10d.all_gather_into_tensor: 2}
    torch.testing.assert_close(out.to_torch(), full)
    counts, _ = _counts(lambda: y.redistribute(mesh2d, [Shard(0), Replicate()]))
    assert counts == {c10d.all_gather_into_tensor: 1}
    # a mesh dim of one device moves nothing; a move between meshes is one point-to-point move
    column = dtorch.DeviceMesh("cpu", [[0], [1]])
    z = dtorch.distribute_tensor(full, column, [Shard(0), Shard(1)])
    assert _counts(lambda: z.redistribute(column, [Shard(0), Replicate()]))[0] == {}
    counts, out = _counts(lambda: x.redistribute(dtorch.DeviceMesh("cpu", [2, 3]), [Shard(0)]))
    assert counts == {"point_to_point": 1}
    torch.testing.assert_close(out.to_torch(), full)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.w1, self.w2 = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(self.norm(x))))


def test_counts_go_to_the_running_modules_by_phase_as_torch_names_them(mesh1):
    """Sequence parallel around a Megatron MLP. torch's CommDebugMode on 2 gloo ranks, the same model and plan,
    counts forward: MLP.w1 one all_gather (its input's sequence), MLP.w2 one reduce_scatter (its output's);
    backward: MLP.w1 one reduce_scatter. (Backward, torch's also counts MLP.w2 an all_gather, where DTorch's
    gradient of the sum is already replicated, and DTorch counts MLP.norm two all_reduces: its replicated
    weight and bias get their gradients laid out as they are, where torch's stay Partial.)"""
    torch.manual_seed(0)
    model, full = MLP(), torch.randn(2, 6, 8)
    expected_out = model(full)
    expected_out.sum().backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad()
    parallelize_module(model, mesh1, {"norm": SequenceParallel(), "w1": ColwiseParallel(input_layouts=Shard(1)),
                                      "w2": RowwiseParallel(output_layouts=Shard(1))})
    x = dtorch.distribute_tensor(full, mesh1, [Shard(1)])
    with CommDebugMode() as comm:
        out = model(x)
        out.sum().backward()
    counts = {name: {phase: dict(c) for phase, c in phases.items()}
              for name, phases in comm.comm_module_counts.items()}
    assert counts["MLP.w1"] == {"forward": {c10d.all_gather_into_tensor: 1},
                                "backward": {c10d.reduce_scatter_tensor: 1}}
    assert counts["MLP.w2"] == {"forward": {c10d.reduce_scatter_tensor: 1}, "backward": {}}
    assert counts["MLP.norm"] == {"forward": {}, "backward": {c10d.all_reduce: 2}}
    assert counts["Global"] == counts["MLP"] == {
        "forward": {c10d.all_gather_into_tensor: 1, c10d.reduce_scatter_tensor: 1},
        "backward": {c10d.reduce_scatter_tensor: 1, c10d.all_reduce: 2}}
    assert comm.get_total_counts() == 5 and "5" in repr(comm)
    assert comm.get_sharding_info()["MLP.w1.weight"] == (Shard(0),)
    assert comm.get_sharding_info()["MLP.w2.weight"] == (Shard(1),)
    assert set(comm.get_parameter_info()["MLP.w1"]) == {"weight", "bias"}
    table = comm.generate_comm_debug_tracing_table(noise_level=2)
    assert "MLP.w2" in table and "*weight: (Shard(dim=1),)" in table and "test_debug.py" in table
    torch.testing.assert_close(out.to_torch(), expected_out)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.to_torch(), expected[name])


def test_the_block_leaves_nothing_on_the_programs_tensors(mesh1):
    """The block's gradient hooks go with it: one left on a tensor that lives on (here the input, which needs a
    gradient) held the mode, and through it every parameter it noted, with their shards on the workers, for as long
    as that tensor lived (a later test's count of the session's tensors saw 42 of them freed in its middle)."""
    model = nn.Sequential(nn.Linear(8, 8))
    parallelize_module(model, mesh1, {"0": ColwiseParallel()})
    x = dtorch.distribute_tensor(torch.randn(4, 8), mesh1, [Replicate()]).requires_grad_()
    with CommDebugMode() as comm:
        model(x).sum().backward()
    assert comm.get_parameter_info()["Sequential.0"]["weight"] is model[0].weight
    mode, weight = weakref.ref(comm), weakref.ref(model[0].weight)
    del comm, model
    gc.collect()
    assert mode() is None and weight() is None
    assert x.grad is not None


def _train(mesh1, steps, block_at=None):
    """A TP MLP trained by a plain loop (automatic capture replays it from its fourth step on); step `block_at` runs
    inside CommDebugMode. The losses, the block's counts and the capture's replays."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    parallelize_module(model, mesh1, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses, counts = [], None
    dtorch.auto_compile(False)
    auto = dtorch.auto_compile(True)
    for i in range(steps):
        x = dtorch.distribute_tensor(torch.randn(4, 8, generator=gen), mesh1, [Replicate()])
        comm = CommDebugMode() if i == block_at else None
        if comm is not None:
            comm.__enter__()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if comm is not None:
            comm.__exit__(None, None, None)
            counts = dict(comm.get_comm_counts())
    return losses, counts, auto.replays


def test_a_replayed_loop_counts_what_its_program_runs_and_replays_again_after_the_block(mesh1):
    losses, _, replays = _train(mesh1, 8)
    assert replays == 5  # steps 4-8
    block_losses, counts, block_replays = _train(mesh1, 8, block_at=5)
    # the rowwise output's all_reduce, and the mean's (its Partial sum is reduced for the division)
    assert counts and counts[c10d.all_reduce] >= 1 and counts == _train(mesh1, 3, block_at=2)[1]
    assert block_replays == 4  # the block's step (the 6th) ran eagerly; the steps after it replay again
    assert block_losses == losses


def test_a_compiled_step_runs_eagerly_in_the_block_and_the_block_refuses_to_start_inside_one(mesh1):
    x = dtorch.distribute_tensor(torch.randn(8, 6), mesh1, [Shard(0)])

    @dtorch.compile
    def step(t):
        return (t.redistribute(mesh1, [Replicate()]) * 2).sum()

    values = [step(x).item() for _ in range(4)]
    assert step.replays >= 2
    replays = step.replays
    counts, out = _counts(lambda: step(x))
    assert counts == {c10d.all_gather_into_tensor: 1} and step.replays == replays
    assert out.item() == pytest.approx(values[0], rel=1e-6) == pytest.approx((x.to_torch() * 2).sum().item(),
                                                                               rel=1e-6)

    @dtorch.compile(warmup=0)
    def nested(t):
        with CommDebugMode():
            return t + 1

    with pytest.raises(RuntimeError, match="cannot start inside a dtorch.compile step"):
        nested(x)
    with CommDebugMode() as outer:  # blocks nest, as torch's modes do; each counts what ran inside it
        with CommDebugMode() as inner:
            x.redistribute(mesh1, [Replicate()])
        x.redistribute(mesh1, [Shard(1)])
    assert dict(inner.get_comm_counts()) == {c10d.all_gather_into_tensor: 1}
    assert dict(outer.get_comm_counts()) == {c10d.all_gather_into_tensor: 1, c10d.all_to_all_single: 1}


def test_visualize_sharding_prints_the_parts_and_their_devices(mesh1, mesh2d, capsys):
    x = dtorch.distribute_tensor(torch.randn(5, 4), mesh2d, [Shard(0), Shard(1)])
    visualize_sharding(x, header="x")
    assert capsys.readouterr().out.splitlines() == [
        "x",
        "         Col 0-1  Col 2-3",
        "-------  -------  -------",
        "Row 0-2  cpu:0    cpu:1",
        "Row 3-4  cpu:2    cpu:3",
    ]
    assert render(dtorch.distribute_tensor(torch.randn(5, 4), mesh2d, [Replicate(), Shard(1)]))[2:] == [
        "Row 0-4  cpu:0,2  cpu:1,3"]
    assert render(dtorch.distribute_tensor(torch.randn(5), mesh1, [Shard(0)]))[2:] == ["Row 0-0  cpu:0    cpu:1"]
    assert render(dtorch.distribute_tensor(torch.randn(2, 4, 3), mesh2d, [Replicate(), Shard(1)])) == [
        "cpu:0,2: [0-1] x [0-1] x [0-2]", "cpu:1,3: [0-1] x [2-3] x [0-2]"]
    partial = render(dtorch.DTensor.from_local(torch.randn(4), mesh1, [Partial()]))
    assert partial[0].startswith("partial values") and "mesh dim 0: Partial(sum)" in partial[0]
    assert render(dtorch.distribute_tensor(torch.randn(0, 3), mesh1, [Shard(0)])) == ["(empty)"]
