"""DeviceMesh and placement validation: clear one-line errors, torch-like surface."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch._spec import contiguous_stride, normalize_placements
from dtorch.device_mesh import init_device_mesh
from dtorch.errors import DTorchError


def test_mesh_shapes_and_identity():
    m1 = dtorch.DeviceMesh("cpu", [0, 1, 2, 3])
    m2 = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    assert m1.shape == (4,) and m2.shape == (2, 2) and m2.ndim == 2 and m2.size() == 4
    assert dtorch.DeviceMesh("cpu", [0, 1, 2, 3]) == m1 and m1 != m2
    assert m2["tp"].devices == (0, 1) and m2["dp"].devices == (0, 2)
    assert repr(m1) == "DeviceMesh('cpu', [0, 1, 2, 3])"
    assert init_device_mesh("cpu", (2, 2)).devices == (0, 1, 2, 3)
    assert dtorch.DeviceMesh("cpu", torch.arange(6).reshape(2, 3)).shape == (2, 3)


@pytest.mark.parametrize("ids,match", [([], "at least one"), ([0, 0], "distinct"), ([-1], "non-negative"),
                                       ([[0, 1], [2]], "rectangular"), ("01", "list of ints")])
def test_bad_meshes(ids, match):
    with pytest.raises((ValueError, TypeError), match=match):
        dtorch.DeviceMesh("cpu", ids)


def test_bad_mesh_dim_names_and_device_type():
    with pytest.raises(ValueError, match="mesh_dim_names"):
        dtorch.DeviceMesh("cpu", [0, 1], mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match="device_type"):
        dtorch.DeviceMesh("gpu", [0])


def test_flatten_names_a_dim_of_the_root_mesh_as_torchs():
    """torch's `mesh["dp", "cp"]._flatten("dp_cp")` (torchtitan's way to a data-parallel mesh over several dims),
    which the root then gives by name (before: AttributeError)."""
    root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    flat = root["dp", "cp"]._flatten("dp_cp")
    assert flat.tolist() == [0, 2, 4, 6] and flat.mesh_dim_names == ("dp_cp",)
    assert root["dp_cp"] == flat and root["tp"]["dp_cp"] == flat
    assert root["cp", "tp"]._flatten().mesh_dim_names == ("cp_tp",)
    assert root["dp", "cp"]._flatten("dp_cp") == flat  # again, the same: allowed
    with pytest.raises(ValueError, match="'dp_cp' already names another dim"):
        root["cp", "tp"]._flatten("dp_cp")
    with pytest.raises(ValueError, match="'tp' already names another dim"):
        root["dp", "cp"]._flatten("tp")


@pytest.mark.parametrize("call", [lambda m: m.get_rank(), lambda m: m.get_local_rank("tp"),
                                  lambda m: m.get_coordinate(), lambda m: m.get_group("tp"),
                                  lambda m: m.get_all_groups()])
def test_per_rank_questions_get_one_line_that_says_why(call):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(DTorchError, match="the client has no rank and no process group"):
        call(mesh)


def test_torchs_own_entry_points_given_a_dtorch_mesh_name_dtorchs():
    """A ported program that still imports torch's fully_shard or parallelize_module got only "the client has no
    rank"; the line now names the DTorch function to call."""
    import torch.distributed.fsdp as fsdp
    import torch.distributed.tensor.parallel as tp

    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    with pytest.raises(DTorchError, match="torch's fully_shard was given a dtorch.DeviceMesh: call "
                                          "dtorch.nn.fully_shard"):
        fsdp.fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
    with pytest.raises(DTorchError, match="torch's parallelize_module was given a dtorch.DeviceMesh: call "
                                          "dtorch.nn.parallelize_module"):
        tp.parallelize_module(torch.nn.Linear(4, 4), mesh, tp.ColwiseParallel())
    with pytest.raises(DTorchError, match="no process group \\(the program runs once, and the workers form the groups "
                                          "its moves need\\); placements say what each device holds$"):
        mesh.get_rank()


def test_placements_are_checked_and_normalized():
    mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]])
    assert normalize_placements([dtorch.Shard(-1), dtorch.Replicate()], mesh, 3)[0] == dtorch.Shard(2)
    assert normalize_placements(None, mesh, 2) == (dtorch.Replicate(), dtorch.Replicate())
    with pytest.raises(ValueError, match="got 3 placements for a 2-d mesh"):
        normalize_placements([dtorch.Shard(0)] * 3, mesh, 2)
    with pytest.raises(ValueError, match="out of range"):
        normalize_placements([dtorch.Shard(2), dtorch.Replicate()], mesh, 2)
    with pytest.raises(TypeError, match="Shard"):
        normalize_placements(["S0", dtorch.Replicate()], mesh, 2)


def test_torchs_own_placements_are_taken_as_dtorchs():
    """A program written for torch.distributed.tensor imports torch's Shard/Replicate/Partial; they were refused with
    "placements must be Shard(dim), ..., got Shard(dim=0)", which reads as a contradiction."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]])
    assert normalize_placements([Shard(-1), Replicate()], mesh, 3) == (dtorch.Shard(2), dtorch.Replicate())
    assert normalize_placements([Partial("max"), Partial()], mesh, 1) == (dtorch.Partial("max"), dtorch.Partial())
    with pytest.raises(TypeError, match=r"\(DTorch's or torch's\), got torch.distributed.tensor.placement_types._S"):
        normalize_placements([_StridedShard(0, split_factor=2), Replicate()], mesh, 2)


def test_contiguous_stride():
    assert contiguous_stride((2, 3, 4)) == (12, 4, 1)
    assert contiguous_stride(()) == ()


def test_spec_ids_are_equal_for_equal_specs_and_never_reused(monkeypatch):
    from dtorch import _spec
    from dtorch._spec import Spec

    monkeypatch.setattr(_spec, "_sids", {})  # specs interned by earlier tests (in any order) are not new here
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    a = Spec(mesh, (dtorch.Shard(0),), (4, 2), (2, 1), torch.float32)
    assert Spec(mesh, (dtorch.Shard(0),), (4, 2), (2, 1), torch.float32).sid == a.sid
    assert Spec(mesh, (dtorch.Replicate(),), (4, 2), (2, 1), torch.float32).sid != a.sid
    assert Spec(mesh, (dtorch.Shard(0),), (4, 2), (2, 1), torch.float64).sid != a.sid
    assert a.contiguous and not Spec(mesh, (dtorch.Shard(0),), (4, 2), (1, 4), torch.float32).contiguous
    monkeypatch.setattr(_spec, "SID_TABLE_MAX", 1)  # the table starts over: ids go on, never back
    b = Spec(mesh, (dtorch.Shard(1),), (4, 2), (2, 1), torch.float32)
    again = Spec(mesh, (dtorch.Shard(0),), (4, 2), (2, 1), torch.float32)
    assert len({a.sid, b.sid, again.sid}) == 3 and again.sid > b.sid > a.sid
    assert again == a and hash(again) == hash(a) and b != a  # equality is of the specs, not of their ids
    assert {a: 1}[again] == 1 and a != Spec(mesh, (dtorch.Shard(0),), (4, 2), (2, 1), torch.float64)
