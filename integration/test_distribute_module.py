"""`dtorch.distribute_module`, torch's lowest-level module API: a partition function, the rest replicated, input
and output hooks; a forward and a training step equal to plain torch's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import dtorch
from dtorch import Replicate, Shard


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 4))


def shard_first_linear(name: str, module: nn.Module, mesh: dtorch.DeviceMesh) -> None:
    if name == "0":  # colwise: the output features split over the mesh
        for key, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(key, nn.Parameter(dtorch.distribute_tensor(param.data, mesh, [Shard(0)])))


def test_distribute_module_runs_and_trains_as_torch(mesh1):
    ref, model = _model(), _model()
    dmodel = dtorch.distribute_module(
        model, mesh1, shard_first_linear,
        input_fn=lambda _mod, inputs, mesh: tuple(dtorch.distribute_tensor(x, mesh, [Shard(0)]) for x in inputs),
        output_fn=lambda _mod, outputs, mesh: outputs.redistribute(mesh, [Replicate()]))
    assert dmodel is model
    assert model[0].weight.placements == (Shard(0),) and model[0].bias.placements == (Shard(0),)
    assert model[3].weight.placements == (Replicate(),)  # left plain by partition_fn: replicated
    assert isinstance(model[2].running_mean, dtorch.DTensor)  # buffers too

    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    opt, dopt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        out, dout = ref(x), model(x)  # a plain input: input_fn distributes it
        assert isinstance(dout, dtorch.DTensor) and dout.placements == (Replicate(),)
        torch.testing.assert_close(dout.full_tensor(), out, rtol=1e-5, atol=1e-6)
        out.square().mean().backward()
        dout.square().mean().backward()
        opt.step(), dopt.step()
        opt.zero_grad(), dopt.zero_grad()
    for (name, p), dp in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(dp.full_tensor(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(model[2].running_mean.full_tensor(), ref[2].running_mean, rtol=1e-5, atol=1e-6)


def test_distribute_module_refuses_a_second_call_and_bad_hooks(mesh1):
    model = dtorch.distribute_module(nn.Linear(4, 4), mesh1)  # no partition_fn: all replicated
    assert model.weight.placements == (Replicate(),)
    with pytest.raises(RuntimeError, match="only be called once"):
        dtorch.distribute_module(model, mesh1)
    with pytest.raises(ValueError, match=r"input_fn\(module, inputs, device_mesh\) takes 3 arguments; this one takes"):
        dtorch.distribute_module(copy.deepcopy(nn.Linear(4, 4)), mesh1, input_fn=lambda inputs, mesh: inputs)
    with pytest.raises(ValueError, match="needs a device_mesh"):
        dtorch.distribute_module(nn.Linear(4, 4))


class _Seen(nn.Module):
    """Records the placements of what its forward receives, and returns it plus its own weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(6))
        self.seen: list = []

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor) -> torch.Tensor:
        self.seen = [getattr(t, "placements", None) for t in (x, bias)]  # None: a plain tensor
        return x * self.weight + bias


@pytest.mark.parametrize("style,inside,out", [
    (dtorch.nn.PrepareModuleInput(desired_input_layouts=Shard(0), desired_input_kwarg_layouts={"bias": Shard(1)}),
     [(Shard(0),), (Shard(1),)], None),
    (dtorch.nn.PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate()),
     [(Replicate(),), None], (Replicate(),)),
    (dtorch.nn.PrepareModuleInputOutput(desired_input_layouts=Shard(0), desired_input_kwarg_layouts={"bias": Shard(1)},
                                        output_layouts=Shard(0), desired_output_layouts=Replicate()),
     [(Shard(0),), (Shard(1),)], (Replicate(),)),
], ids=["input", "output", "input_output"])
def test_prepare_module_styles_move_inputs_and_outputs_as_torchs(mesh1, style, inside, out):
    """torch's PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput (the last was missing): the module's
    forward sees its inputs in the desired layouts, its caller the output in the desired one, the values unchanged."""
    x, bias = torch.randn(4, 6), torch.randn(4, 6)
    module = dtorch.nn.parallelize_module(_Seen(), mesh1, style)
    got = module(dtorch.distribute_tensor(x, mesh1, [Replicate()]), bias=bias)
    assert module.seen == inside
    if out is not None:
        assert got.placements == out
    torch.testing.assert_close(got.full_tensor(), x + bias)


def test_torchs_own_parallel_styles_and_placements_lay_out_as_dtorchs(mesh1):
    """A plan written for torch (`torch.distributed.tensor.parallel` styles, torch's placements) ran into
    "'ColwiseParallel' object has no attribute 'items'"; it now lays the model out as the DTorch styles do."""
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import parallel as tp

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = dtorch.nn.parallelize_module(copy.deepcopy(ref), mesh1, {  # (torch's src_data_rank too: changes nothing)
        "0": tp.ColwiseParallel(), "2": tp.RowwiseParallel(output_layouts=TorchShard(0))}, src_data_rank=None)
    assert model[0].weight.placements == (Shard(0),) and model[2].weight.placements == (Shard(1),)
    x = torch.randn(6, 8)
    out = model(x)
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), ref(x))
    with pytest.raises(TypeError, match="parallelize_plan must be a ParallelStyle or a {submodule name: style} dict, "
                                        "got str"):
        dtorch.nn.parallelize_module(nn.Linear(4, 4), mesh1, "colwise")
    for style in (dtorch.nn.ColwiseParallel(), tp.RowwiseParallel()):  # on a module with no parameters too: torch
        with pytest.raises(NotImplementedError, match=r"^\w+Parallel supports nn.Linear and nn.Embedding, got ReLU "
                                                      r"\('1'\)$"):  # refuses it; until 2026-12-07 it did nothing
            dtorch.nn.parallelize_module(copy.deepcopy(ref), mesh1, {"1": style})
