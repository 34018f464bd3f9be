"""Translation (core/translate.py): deletes as one command per worker and device set, whatever the meshes; an
instruction run alike on every device of a mesh as one command shared by its workers (rules 2-3)."""

from __future__ import annotations

import pytest

from _core_helpers import Harness, cmds_of, create, spec
from dtorch_controller.core import events as ev
from dtorch_protocol import messages as m


def test_a_delete_sends_each_worker_one_command_per_device_set_across_meshes():
    h = Harness()
    h.register("10.0.0.1:7000")
    h.register("10.0.0.2:7000")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed and h.open_mesh(sid, 2, [0]).placed  # mesh 2: device 0 only
    s = h.core.sessions[sid]
    first, second = s.devices[0], s.devices[1]
    assert first != second
    h.submit(sid, 1, [create(1), create(2), create(3, mesh=2), create(4, mesh=2)])
    h.report_all()
    h.take_sent()
    h.submit(sid, 2, [m.InstrDelete(tids=[1, 2])])  # one mesh
    sent = h.take_sent()
    assert cmds_of(sent, first, m.CmdDelete) == [m.CmdDelete(tids=[1, 2], devices=[0])]
    assert cmds_of(sent, second, m.CmdDelete) == [m.CmdDelete(tids=[1, 2], devices=[1])]
    h.report_all()
    h.submit(sid, 3, [create(5), m.InstrDelete(tids=[3, 5, 4, 99])])  # two meshes, device 0 in both; 99 unknown
    sent = h.take_sent()
    (both,) = cmds_of(sent, first, m.CmdDelete)
    assert sorted(both.tids) == [3, 4, 5] and both.devices == [0]
    assert cmds_of(sent, second, m.CmdDelete) == [m.CmdDelete(tids=[5], devices=[1])]
    assert set(s.tensors) == set()


def add(out, a, b, mesh=1, local=None):
    return m.InstrCall(op="aten.add.Tensor", mesh=mesh, args=[m.tensor_slot(a), m.tensor_slot(b)], kwargs={},
                       outs=[m.OutSpec(tid=out, spec=spec([8], mesh))], local=local, src="train.py:5")


@pytest.mark.parametrize("workers", [1, 4, 16])
def test_an_instruction_run_on_every_device_of_a_mesh_is_one_command_whatever_the_workers(workers):
    """Rule 2-3 of translate.py: the per-instruction commands are the same objects for every worker, so building
    them does not grow with the number of workers; each worker still runs them on its own devices only."""
    h = Harness()
    ids = [h.register(f"10.0.0.{i}:7000") for i in range(workers)]
    sid = h.open_session()
    assert h.open_mesh(sid, 1, list(range(2 * workers))).placed  # two logical devices per worker
    assert h.open_mesh(sid, 2, [0]).placed  # one device of the first worker
    s = h.core.sessions[sid]
    h.submit(sid, 1, [create(1), create(2)])
    h.report_all()
    h.take_sent()
    h.submit(sid, 2, [add(3, 1, 2), add(4, 3, 2), add(5, 1, 1, mesh=2), add(6, 4, 3),
                      m.InstrDelete(tids=[3, 4])])
    sent = {e.worker_id: e.execute.cmds for e in h.take_sent()}
    assert set(sent) == set(ids)
    def on_mesh1(cmds):
        return [c for c in cmds if type(c) is not m.CmdMesh and c.mesh == 1]

    mesh1 = on_mesh1(sent[ids[-1]])
    assert [type(c) for c in mesh1] == [m.CmdRun, m.CmdRun, m.CmdRun, m.CmdDelete]
    assert all(c.devices == [] for c in mesh1)
    built = {id(c) for cmds in sent.values() for c in cmds if type(c) is not m.CmdMesh}
    assert len(built) == 5  # one object per instruction, at 1, 4 or 16 workers
    for w, cmds in sent.items():
        assert len(on_mesh1(cmds)) == 4 and all(a is b for a, b in zip(on_mesh1(cmds), mesh1))
        mine = sorted(d for d, owner in s.devices.items() if owner == w)
        meshes = [(c.mesh, c.devices) for c in cmds if type(c) is m.CmdMesh]
        assert meshes == [(1, mine)] + ([(2, [0])] if 0 in mine else [])  # said once per mesh and batch
    # as each worker runs them: its own devices, in instruction order (mesh 2 between the adds on mesh 1)
    first = ids[0]
    h.submit(sid, 3, [add(7, 1, 2), add(8, 1, 1, mesh=2), add(9, 1, 2)])
    sent = h.take_sent()
    mine = sorted(d for d, owner in s.devices.items() if owner == first)
    assert [(c.outs, c.devices) for c in cmds_of(sent, first, m.CmdRun)] == [([7], mine), ([8], [0]), ([9], mine)]
    assert [type(c) for e in sent if e.worker_id == first for c in e.execute.cmds] == [
        m.CmdMesh, m.CmdRun, m.CmdMesh, m.CmdRun, m.CmdRun]
    assert set(s.tensors) == {1, 2, 5, 6, 7, 8, 9}


def test_per_device_arguments_stay_per_worker_and_lost_workers_get_nothing():
    h = Harness(snapshot_every_batches=0)  # recovery off: the lost worker's devices stay lost
    w0, w1, w2 = (h.register(f"10.0.0.{i}:7000") for i in range(3))
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1, 2]).placed
    s = h.core.sessions[sid]
    h.submit(sid, 1, [create(1)])
    h.report_all()
    h.take_sent()
    local = {d: [[m.tensor_slot(1), m.tensor_slot(1)], {"alpha": d}] for d in range(3)}
    h.submit(sid, 2, [add(2, 1, 1, local=local)])
    runs = {e.worker_id: e.execute.cmds for e in h.take_sent()}
    assert {w: [(c.devices, c.local, c.mesh) for c in cmds] for w, cmds in runs.items()} == {
        s.devices[d]: [([d], {d: local[d]}, -1)] for d in range(3)}  # no CmdMesh: nothing shared
    lost = s.devices[2]
    h.handle(ev.WorkerUnreachable(lost, h.core.workers[lost].address, "connection refused"))
    assert h.core.workers[lost].state == "lost"
    h.submit(sid, 3, [add(3, 1, 1), m.InstrDelete(tids=[3])])
    sent = h.take_sent()
    assert lost not in {e.worker_id for e in sent}
    assert {(e.worker_id, tuple(c.devices)) for e in sent for c in cmds_of([e], kind=m.CmdDelete)} == {
        (s.devices[0], (0,)), (s.devices[1], (1,))}


def test_output_layouts_checked_once_per_batch_still_refuse_what_is_wrong():
    """`_out_layout` checks each (mesh, placements, number of dims) once per batch; a later output of the same
    layout but a negative size, a scalar sharded on dim 0, or a tensor id that is not an int is still refused."""
    h = Harness()
    h.register("10.0.0.1:7000")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    h.submit(sid, 1, [create(1)])
    h.report_all()
    bad_size = m.InstrCall(op="aten.add.Tensor", mesh=1, args=[m.tensor_slot(1), m.tensor_slot(1)], kwargs={},
                           outs=[m.OutSpec(tid=4, spec=spec([-8]))], src="u.py:2")
    scalar = m.InstrCall(op="aten.sum.default", mesh=1, args=[m.tensor_slot(1)], kwargs={},
                         outs=[m.OutSpec(tid=5, spec=spec([]))], src="u.py:3")
    a_bool = m.InstrCall(op="aten.add.Tensor", mesh=1, args=[m.tensor_slot(1), {m.TENSOR_SLOT: True}], kwargs={},
                         outs=[m.OutSpec(tid=6, spec=spec([8]))], src="u.py:4")
    in_kwargs = m.InstrCall(op="aten.add.Tensor", mesh=1, args=[m.tensor_slot(1)], kwargs={"other": m.tensor_slot(9)},
                            outs=[m.OutSpec(tid=7, spec=spec([8]))], src="u.py:5")
    h.submit(sid, 2, [add(2, 1, 1), add(3, 2, 1), bad_size, scalar, a_bool, in_kwargs])
    h.report_all()
    errors = {e.src: e.message for e in h.sync(sid, 2)[1].errors}
    assert set(errors) == {"u.py:2", "u.py:3", "u.py:4", "u.py:5"}
    assert "negative size" in errors["u.py:2"] and "out of range" in errors["u.py:3"]
    assert "unknown tensor True" in errors["u.py:4"] and "unknown tensor 9" in errors["u.py:5"]
    assert set(h.core.sessions[sid].tensors) == {1, 2, 3}


def test_an_eager_batch_notes_each_tensors_maker_as_the_notes_do():
    """`note_instrs` (the eager path) against `note_origins(origin_notes(...))` (the rule table programs use)."""
    from dtorch_controller.core.lineage import note_instrs, note_origins, origin_notes

    instrs = [create(1), add(2, 1, 1), m.InstrAdopt(tid=3, spec=spec([8])), add(2, 2, 3),  # in place: kept
              m.InstrCall(op="aten.split", mesh=1, args=[m.tensor_slot(2)], kwargs={},
                          outs=[None, m.OutSpec(tid=4, spec=spec([8]))], src="u.py:7"),
              m.InstrRedistribute(src=4, dst=5, src_spec=spec([8]), dst_spec=spec([8], placements=("R",))),
              m.InstrDelete(tids=[1, 4, 99]), add(1, 5, 5), m.InstrCreate(tid=2, spec=spec([8]), init="zeros")]
    for start in range(len(instrs)):
        fast, table = {7: ("before", "")}, {7: ("before", "")}
        note_instrs(fast, instrs[start:])
        note_origins(table, origin_notes(instrs[start:]))
        assert fast == table and list(fast) == list(table)
