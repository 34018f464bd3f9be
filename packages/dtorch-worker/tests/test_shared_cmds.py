"""Commands shared by a mesh's workers (protocol 1.7, `dtorch_protocol.shared`): the very same CmdRun/CmdDelete
objects go to every worker of a mesh, and each worker runs them on the devices its batch's CmdMesh names. Checked
against plain torch on the full tensors, with two logical devices per worker (virtual devices), replays and caps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dtorch_protocol.messages import (
    CmdCreate,
    CmdDelete,
    CmdMesh,
    CmdProgram,
    CmdReplay,
    CmdRun,
    ErrorKind,
    Execute,
)
from dtorch_protocol.placement_types import Shard
from dtorch_worker.executor import Executor
from dtorch_worker.store import Poison, TensorStore

S = "session-1"
MESH = 3
SHAPE = [8, 3]
HOSTS = ([0, 1], [2, 3])  # two workers, two logical devices each


@pytest.fixture
def workers() -> list[Executor]:
    pair = [Executor(TensorStore(), input_timeout_s=0.05) for _ in HOSTS]
    yield pair
    for ex in pair:
        ex.stop()


def t(tid: int) -> dict[str, int]:
    return {"$t": tid}


def batch(ex: Executor, *cmds: object, seq: int = 1, cap: int = 0) -> None:
    ex.run_batch(Execute(seq=seq, session=S, cmds=list(cmds), memory_cap=cap))  # type: ignore[arg-type]


def created(h: SimpleNamespace, workers: list[Executor], tid: int, arange: list[float]) -> dict[int, list[list[int]]]:
    """Tensor `tid` = arange(...).view(SHAPE), sharded on dim 0 over the 4 devices (each worker its boxes)."""
    boxes = h.boxes_for(SHAPE, [4], [Shard(0)])
    for ex, mine in zip(workers, HOSTS):
        batch(ex, CmdCreate(tid=tid, dtype="float32", shape=SHAPE, init="arange", arange=arange,
                            boxes={d: boxes[d] for d in mine}))
    return boxes


def gathered(h: SimpleNamespace, workers: list[Executor], tid: int, boxes: dict) -> torch.Tensor:
    shards = {}
    for ex, mine in zip(workers, HOSTS):
        shards.update(h.shards_of(ex.store, S, tid, mine))
    return h.assemble(shards, boxes, SHAPE, torch.float32)


def test_one_shared_command_runs_on_each_workers_own_devices_like_torch(workers: list[Executor],
                                                                     h: SimpleNamespace) -> None:
    boxes = created(h, workers, 1, [0, 24, 1])
    x = torch.arange(24.0).view(SHAPE)
    shared = [CmdRun(op="aten.mul.Tensor", devices=[], args=[t(1), t(1)], kwargs={}, outs=[2], mesh=MESH),
              CmdRun(op="aten.add_.Tensor", devices=[], args=[t(2), t(1)], kwargs={"alpha": 0.5}, outs=[2], mesh=MESH),
              CmdRun(op="aten.max.dim", devices=[], args=[t(2), 1], kwargs={}, outs=[3, None], mesh=MESH),
              CmdDelete(tids=[1], devices=[], mesh=MESH)]
    seen = []
    for ex, mine in zip(workers, HOSTS):
        ex.observe = lambda _s, cmd, *_rest: seen.append(cmd)  # profiles and metrics: ordinary commands
        batch(ex, CmdMesh(mesh=MESH, devices=mine), *shared)  # the same objects for both workers
    assert torch.equal(gathered(h, workers, 2, boxes), x * x + 0.5 * x)
    maxima = [ex.store.get((S, 3, d)) for ex, mine in zip(workers, HOSTS) for d in mine]
    assert torch.equal(torch.cat(maxima), (x * x + 0.5 * x).max(dim=1).values)
    assert all((S, 1, d) not in ex.store for ex, mine in zip(workers, HOSTS) for d in mine)  # deleted everywhere
    assert [(type(c).__name__, c.devices, c.mesh) for c in seen] == [
        (type(c).__name__, mine, -1) for mine in HOSTS for c in shared]
    assert all(ex.take_errors() == {} for ex in workers)


def test_a_kept_program_with_shared_commands_replays_like_torch(workers: list[Executor], h: SimpleNamespace) -> None:
    boxes = created(h, workers, 10, [1, 25, 1])
    run = CmdRun(op="aten.mul.Tensor", devices=[], args=[t(0), {"$s": 0}], kwargs={}, outs=[1], mesh=MESH)
    drop = CmdDelete(tids=[0], devices=[], mesh=MESH)
    for ex, mine in zip(workers, HOSTS):  # each worker's program says its devices; the shared commands are one
        batch(ex, CmdProgram(program=1, version=1, ntids=2, nscalars=1, cmds=[CmdMesh(mesh=MESH, devices=mine),
                                                                              run, drop]), seq=2)
    x = torch.arange(1.0, 25.0).view(SHAPE)
    for n, scale in enumerate([2.0, -0.5]):
        replay = CmdReplay(program=1, version=1, tids=[10 + n * 10, 20 + n * 10], scalars=[scale])
        for ex in workers:
            batch(ex, replay, seq=3 + n)
        assert torch.equal(gathered(h, workers, 20 + n * 10, boxes), x * scale)
        x = x * scale
    assert all((S, 10, d) not in ex.store and (S, 20, d) not in ex.store for ex, mine in zip(workers, HOSTS)
               for d in mine)
    assert all(ex.take_errors() == {} for ex in workers)


def test_a_shared_command_without_its_mesh_in_the_batch_is_refused_in_one_line(workers: list[Executor],
                                                                              h: SimpleNamespace) -> None:
    created(h, workers, 1, [0, 24, 1])
    ex = workers[0]
    batch(ex, CmdMesh(mesh=MESH, devices=HOSTS[0]), seq=2)  # said in an earlier batch: it does not carry over
    batch(ex, CmdRun(op="aten.neg.default", devices=[], args=[t(1)], kwargs={}, outs=[2], src="a.py:3", mesh=MESH),
          CmdMesh(mesh=MESH + 1, devices=HOSTS[0]), CmdDelete(tids=[1], devices=[], mesh=MESH), seq=3)
    run_error, delete_error = ex.take_errors()[S]
    assert (run_error.op, run_error.src, run_error.kind) == ("aten.neg.default", "a.py:3", ErrorKind.OP)
    assert run_error.message == ("a shared run of aten.neg.default names mesh 3, but no CmdMesh before it in this "
                                 "batch said which of its devices are on this worker")
    assert "shared delete names mesh 3" in delete_error.message
    assert all((S, 2, d) not in ex.store and (S, 1, d) in ex.store for d in HOSTS[0])  # nothing ran


def test_a_shared_op_over_the_cap_is_poisoned_on_every_device_of_this_worker(workers: list[Executor],
                                                                           h: SimpleNamespace) -> None:
    created(h, workers, 1, [0, 24, 1])  # 2 rows x 3 floats = 24 bytes per device, 48 per worker
    ex = workers[0]
    grow = CmdRun(op="aten.repeat.default", devices=[], args=[t(1), [4, 1]], kwargs={}, outs=[2], src="b.py:1",
                  mesh=MESH)  # 96 bytes more per device
    batch(ex, CmdMesh(mesh=MESH, devices=HOSTS[0]), grow, seq=2, cap=200)
    assert all(isinstance(ex.store.get((S, 2, d)), Poison) for d in HOSTS[0])
    (report,) = ex.take_errors()[S]
    assert report.kind == ErrorKind.MEMORY_CAP and report.src == "b.py:1" and report.tid == 2
    assert ex.store.session_bytes(S) == 48
