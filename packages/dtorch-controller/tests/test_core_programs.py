"""Captured programs (core/programs.py): a definition is kept, a replay runs as its filled-in instructions."""

from __future__ import annotations

from dtorch_controller.core import programs
from dtorch_protocol import messages as m
from dtorch_protocol import programs as p


def spec(shape):
    return m.TensorSpec(shape=list(shape), dtype="float32", mesh=1, placements=["S0"])


# A step in slot form: slot 0 an outside tensor, slot 1 a random factory, slot 2 their sum (seed slot 0),
# slot 1 deleted by the user's code.
STEP = [
    m.InstrCreate(tid=1, spec=spec([8]), init="randn", seed=0, src="s.py:1"),
    m.InstrCall(op="aten.add.Tensor", mesh=1, args=[{"$t": 0}, {"$t": 1}], kwargs={},
                outs=[m.OutSpec(2, spec([8]))], local={0: [[{"$t": 1}, {"$t": 0}], {}]}, src="s.py:2"),
    m.InstrDelete(tids=[1]),
]


def define(program=7, instrs=STEP, ntids=3, nseeds=1):
    return m.InstrDefine(program=program, instrs=instrs, ntids=ntids, nseeds=nseeds)


def test_a_replay_becomes_its_program_with_the_tensor_ids_and_seeds_filled_in():
    store: dict = {}
    out, refused = programs.expand(store, [define(), m.InstrReplay(program=7, tids=[40, 41, 42], seeds=[99])])
    assert refused == [] and set(store) == {7}
    create, call, delete = out
    assert (create.tid, create.seed) == (41, 99)
    assert call.args == [{"$t": 40}, {"$t": 41}] and call.outs[0].tid == 42
    assert call.local == {0: [[{"$t": 41}, {"$t": 40}], {}]} and call.seed is None
    assert delete.tids == [41]
    # the same program again, other ids: nothing of the first replay is left in it
    out, _ = programs.expand(store, [m.InstrReplay(program=7, tids=[50, 51, 52], seeds=[5])])
    assert (out[0].tid, out[0].seed, out[1].outs[0].tid, out[2].tids) == (51, 5, 52, [51])


def test_number_holes_take_the_replays_numbers():
    call = m.InstrCall(op="aten._foreach_add_.ScalarList", mesh=1, args=[[{"$t": 0}], [{"$s": 1}, 2.0]],
                       kwargs={"alpha": {"$s": 0}}, outs=[])
    store: dict = {}
    out, refused = programs.expand(store, [m.InstrDefine(program=1, instrs=[call], ntids=1, nscalars=2),
                                           m.InstrReplay(program=1, tids=[9], scalars=[0.5, -3.0])])
    assert refused == [] and out[0].args == [[{"$t": 9}], [-3.0, 2.0]] and out[0].kwargs == {"alpha": 0.5}
    _, refused = programs.expand(store, [m.InstrDefine(program=2, instrs=[call], ntids=1, nscalars=1)])
    assert "number slot 1 is outside 0..0" in refused[0].message


def test_a_batch_of_replays_cannot_expand_without_bound(monkeypatch):
    monkeypatch.setattr(programs, "MAX_EXPANDED", 7)
    out, refused = programs.expand({}, [define(), *[m.InstrReplay(program=7, tids=[1, 2, 3], seeds=[0])] * 3])
    assert len(out) == 6 and len(refused) == 1 and "at most 7 instructions" in refused[0].message


def test_batches_without_programs_pass_through_untouched():
    instrs = [m.InstrDelete(tids=[1])]
    assert programs.expand({}, instrs) == (instrs, [])


def test_bad_definitions_and_replays_are_refused_and_run_nothing():
    store: dict = {}
    bad_slot = [m.InstrDelete(tids=[3])]
    bad_seed = [m.InstrCreate(tid=0, spec=spec([8]), init="rand", seed=1)]
    out, refused = programs.expand(store, [
        define(program=1, instrs=bad_slot), define(program=2, instrs=bad_seed), define(program=3, ntids=-1),
        m.InstrReplay(program=9, tids=[]), define(program=4),
        m.InstrReplay(program=4, tids=[1, 2], seeds=[0]), m.InstrReplay(program=4, tids=[1, 2, 3], seeds=[]),
        m.InstrDelete(tids=[5])])
    assert out == [m.InstrDelete(tids=[5])] and set(store) == {4}
    text = [r.message for r in refused]
    assert "tensor slot 3 is outside 0..2" in text[0] and "seed slot 1 is outside 0..0" in text[1]
    assert "must be >= 0" in text[2] and text[3] == "unknown program 9"
    assert "names 2 tensors, 1 seeds and 0 numbers; it was defined with 3, 1 and 0" in text[4]
    assert "0 seeds" in text[5]
    assert all(r.kind == m.ErrorKind.REFUSED for r in refused)


def test_a_session_holds_a_bounded_number_of_programs():
    store = {n: define(program=n) for n in range(p.MAX_PROGRAMS)}
    _, refused = programs.expand(store, [define(program=p.MAX_PROGRAMS), define(program=0, ntids=4)])
    assert len(refused) == 1 and "at most" in refused[0].message and store[0].ntids == 4  # a redefinition is fine


def test_through_the_core_a_replay_is_translated_like_the_instructions_it_stands_for(h):
    w0, w1 = h.register("10.0.0.1:7001"), h.register("10.0.0.2:7002")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0, 1]).placed
    h.submit(sid, 1, [m.InstrCreate(tid=10, spec=spec([8]), init="zeros")])
    h.take_sent()
    h.submit(sid, 2, [define(), m.InstrReplay(program=7, tids=[10, 11, 12], seeds=[3])])
    replayed = {s.worker_id: s.execute for s in h.take_sent()}
    h.submit(sid, 3, [m.InstrDelete(tids=[12]), *p.fill(STEP, [10, 21, 22], [4])])
    eager = {s.worker_id: s.execute for s in h.take_sent()}
    assert replayed[w0].cmds[0] == m.CmdCreate(tid=11, dtype="float32", shape=[8], init="randn",
                                                boxes={0: [[0, 4]]}, zero=[], seed=3, src="s.py:1")
    assert [type(c) for c in replayed[w0].cmds] == [m.CmdCreate, m.CmdRun, m.CmdDelete]
    assert [type(c) for c in eager[w1].cmds] == [m.CmdDelete, m.CmdCreate, m.CmdRun, m.CmdDelete]
    assert set(h.core.sessions[sid].tensors) == {10, 22}
    # a bad replay is reported at the next sync, with the program it named
    h.submit(sid, 4, [m.InstrReplay(program=8, tids=[])])
    h.report_all()
    _, reply = h.sync(sid, 4)
    assert [(e.op, e.message) for e in reply.errors] == [("program:8", "unknown program 8")]
