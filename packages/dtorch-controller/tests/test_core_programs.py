"""Captured programs (core/programs.py): a definition is kept, a replay runs as its filled-in instructions, from
the program's commands compiled for the session's binding (translated again whenever that binding changed)."""

from __future__ import annotations

import itertools

import pytest

from _core_helpers import Harness, own
from dtorch_controller.core import events as ev
from dtorch_controller.core import lineage, programs
from dtorch_controller.core import translate as tr
from dtorch_protocol import messages as m
from dtorch_protocol import programs as p
from dtorch_protocol import shared
from dtorch_protocol.wire import hello


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


def expand(store, instrs):
    """What the batch stands for once accepted: its replays filled in."""
    out, named, refused = programs.accept(store, instrs)
    return programs.expand(out, named), refused


def test_a_replay_becomes_its_program_with_the_tensor_ids_and_seeds_filled_in():
    store: dict = {}
    out, refused = expand(store, [define(), m.InstrReplay(program=7, tids=[40, 41, 42], seeds=[99])])
    assert refused == [] and set(store) == {7}
    create, call, delete = out
    assert (create.tid, create.seed) == (41, 99)
    assert call.args == [{"$t": 40}, {"$t": 41}] and call.outs[0].tid == 42
    assert call.local == {0: [[{"$t": 41}, {"$t": 40}], {}]} and call.seed is None
    assert delete.tids == [41]
    # the same program again, other ids: nothing of the first replay is left in it
    out, _ = expand(store, [m.InstrReplay(program=7, tids=[50, 51, 52], seeds=[5])])
    assert (out[0].tid, out[0].seed, out[1].outs[0].tid, out[2].tids) == (51, 5, 52, [51])


def test_number_holes_take_the_replays_numbers():
    call = m.InstrCall(op="aten._foreach_add_.ScalarList", mesh=1, args=[[{"$t": 0}], [{"$s": 1}, 2.0]],
                       kwargs={"alpha": {"$s": 0}}, outs=[])
    store: dict = {}
    out, refused = expand(store, [m.InstrDefine(program=1, instrs=[call], ntids=1, nscalars=2),
                                           m.InstrReplay(program=1, tids=[9], scalars=[0.5, -3.0])])
    assert refused == [] and out[0].args == [[{"$t": 9}], [-3.0, 2.0]] and out[0].kwargs == {"alpha": 0.5}
    _, refused = expand(store, [m.InstrDefine(program=2, instrs=[call], ntids=1, nscalars=1)])
    assert "number slot 1 is outside 0..0" in refused[0].message


def test_the_log_keeps_a_replay_as_it_came_and_a_program_defined_again_later_in_the_batch_fills_it_in():
    store: dict = {}
    replay = m.InstrReplay(program=7, tids=[40, 41, 42], seeds=[99])
    out, named, _ = programs.accept(store, [define(), replay])
    assert out == [replay] and named == {7: define()}
    out, named, _ = programs.accept(store, [replay, define(instrs=STEP[:1]), replay])
    assert out == [*p.fill(STEP, [40, 41, 42], [99]), replay] and named == {7: define(instrs=STEP[:1])}


def test_a_batch_of_replays_cannot_expand_without_bound(monkeypatch):
    monkeypatch.setattr(programs, "MAX_EXPANDED", 7)
    out, refused = expand({}, [define(), *[m.InstrReplay(program=7, tids=[1, 2, 3], seeds=[0])] * 3])
    assert len(out) == 6 and len(refused) == 1 and "at most 7 instructions" in refused[0].message


def test_batches_without_programs_pass_through_untouched():
    instrs = [m.InstrDelete(tids=[1])]
    out, named, refused = programs.accept({}, instrs)
    assert out is instrs and named == {} and refused == []


def test_bad_definitions_and_replays_are_refused_and_run_nothing():
    store: dict = {}
    bad_slot = [m.InstrDelete(tids=[3])]
    bad_seed = [m.InstrCreate(tid=0, spec=spec([8]), init="rand", seed=1)]
    out, refused = expand(store, [
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
    _, refused = expand(store, [define(program=p.MAX_PROGRAMS), define(program=0, ntids=4)])
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
    assert replayed[w0].cmds[1] == m.CmdCreate(tid=11, dtype="float32", shape=[8], init="randn",
                                                boxes={0: [[0, 4]]}, zero=[], seed=3, src="s.py:1")
    assert [type(c) for c in own(replayed[w0])] == [m.CmdProgram, m.CmdCreate, m.CmdRun, m.CmdDelete]
    assert replayed[w0].cmds[0].cmds[0] == m.CmdCreate(tid=1, dtype="float32", shape=[8], init="randn",
                                                        boxes={0: [[0, 4]]}, zero=[], seed=0, src="s.py:1")
    assert [type(c) for c in own(eager[w1])] == [m.CmdDelete, m.CmdCreate, m.CmdRun, m.CmdDelete]
    assert set(h.core.sessions[sid].tensors) == {10, 22}
    # a bad replay is reported at the next sync, with the program it named
    h.submit(sid, 4, [m.InstrReplay(program=8, tids=[])])
    h.report_all()
    _, reply = h.sync(sid, 4)
    assert [(e.op, e.message) for e in reply.errors] == [("program:8", "unknown program 8")]


# ---------------------------------------------------------------- compiled programs: replays against eager twins


def sp(shape, placements=("S0",), mesh=1):
    return m.TensorSpec(shape=list(shape), dtype="float32", mesh=mesh, placements=list(placements))


# Slot 0 comes from outside; 1 = randn (seed slot 0); 2 = 0 + 1 * alpha (a number hole); 3 = 2 gathered on mesh 1
# (a collective when the workers can join one); 4 = 2 moved to mesh 2 (other device order: point-to-point pieces,
# workers pull 2 from each other); then 1 and 2 are deleted (2 while its remote readers may still be pulling).
BIG = [
    m.InstrCreate(tid=1, spec=sp([8, 4]), init="randn", seed=0, src="s.py:1"),
    m.InstrCall(op="aten.add.Tensor", mesh=1, args=[{"$t": 0}, {"$t": 1}], kwargs={"alpha": {"$s": 0}},
                outs=[m.OutSpec(2, sp([8, 4]))], src="s.py:2"),
    m.InstrRedistribute(src=2, dst=3, src_spec=sp([8, 4]), dst_spec=sp([8, 4], ["R"]), src_line="s.py:3"),
    m.InstrRedistribute(src=2, dst=4, src_spec=sp([8, 4]), dst_spec=sp([8, 4], mesh=2), src_line="s.py:4"),
    m.InstrDelete(tids=[1, 2]),
]


class Workers:
    """What workers run of what they are sent: a program's replays filled in from the commands they keep
    (`dtorch_protocol.programs`), commands shared by a mesh's workers as each worker's own (`dtorch_protocol.shared`),
    as the worker's executor does."""

    def __init__(self):
        self.kept = {}

    def run(self, sent):
        out = []
        for e in sent:
            cmds = []
            for c in e.execute.cmds:
                if type(c) is m.CmdProgram:
                    assert p.check_cmds(c) is None
                    self.kept[e.worker_id, c.program] = c
                elif type(c) is m.CmdReplay:
                    kept = self.kept[e.worker_id, c.program]
                    assert kept.version == c.version
                    cmds += p.fill_cmds(kept, c)
                else:
                    cmds.append(c)
            meshes = shared.Meshes()
            mine = [meshes.local(c) for c in cmds]
            out.append((e.worker_id, e.execute.seq, e.execute.memory_cap, [c for c in mine if c is not None]))
        return out


class Twins:
    """Two cores fed the same events, but for the steps: one gets a program's replays, the other the instructions
    they stand for. Everything the core does must be the same."""

    def __init__(self, workers=3, rendezvous=True, **config):
        self.pair = [Harness(**config), Harness(**config)]
        for h in self.pair:
            for i in range(workers):
                h.call(ev.Register, m.RegisterWorker(
                    hello=hello("worker"), address=f"10.0.0.{i}:700{i}", device_type="cpu", memory_bytes=1 << 30,
                    rendezvous=f"10.0.0.{i}:2900{i}" if rendezvous else ""))
            self.sid = h.open_session()
            assert h.open_mesh(self.sid, 1, [0, 1]).placed and h.open_mesh(self.sid, 2, [1, 0]).placed
            h.core.sessions[self.sid].comm.new_key = iter(f"key{n}" for n in itertools.count()).__next__
        self.seq = 0
        self.workers = Workers(), Workers()
        self.both([m.InstrCreate(tid=100, spec=sp([8, 4]), init="ones")])

    def both(self, instrs, eager=None):
        self.seq += 1
        for h, batch in zip(self.pair, (instrs, instrs if eager is None else eager)):
            assert h.submit(self.sid, self.seq, batch).accepted == self.seq

    def step(self, program, instrs, tids, seeds=(), scalars=()):
        r = m.InstrReplay(program=program, tids=list(tids), seeds=list(seeds), scalars=list(scalars))
        self.both([r], eager=p.fill(instrs, list(tids), list(seeds), list(scalars)))

    def each(self, f):
        for h in self.pair:
            f(h)

    def same(self):
        (a, b) = self.pair
        sa, sb = a.take_sent(), b.take_sent()
        assert self.workers[0].run(sa) == self.workers[1].run(sb)
        x, y = a.core.sessions[self.sid], b.core.sessions[self.sid]
        assert (x.tensors, x.readers, x.deferred, x.devices) == (y.tensors, y.readers, y.deferred, y.devices)
        assert [(g.id, g.seq) for g in x.comm.groups.values()] == [(g.id, g.seq) for g in y.comm.groups.values()]
        assert a.core.pipeline.recs[self.sid].origin == b.core.pipeline.recs[self.sid].origin
        return sa


def translated(monkeypatch):
    """Counts the instructions the core translates."""
    count = [0]
    run = tr._Translator.run

    def counting(self, instrs):
        count[0] += len(instrs)
        return run(self, instrs)

    monkeypatch.setattr(tr._Translator, "run", counting)
    return count


@pytest.mark.parametrize("rendezvous", [True, False], ids=["collectives", "pieces"])
def test_replays_send_what_the_instructions_would_and_change_the_session_alike(rendezvous):
    t = Twins(rendezvous=rendezvous)
    t.both([m.InstrDefine(program=1, instrs=BIG, ntids=5, nseeds=1, nscalars=1)], eager=[])
    t.same()
    tid = 200
    kinds = set()
    for n in range(4):
        t.step(1, BIG, [100, tid, tid + 1, tid + 2, tid + 3], seeds=[n], scalars=[0.5 * n])
        sent = t.same()
        kinds |= {type(c) for e in sent for c in e.execute.cmds}
        if n % 2:
            t.each(Harness.report_all)  # readers done: the next step's delete goes out at once
        t.same()
        t.both([m.InstrDelete(tids=[tid + 2, tid + 3])])
        t.same()
        tid += 10
    assert (m.CmdCollective in kinds) == rendezvous and m.CmdRedistribute in kinds and m.CmdExpectReads in kinds


def test_a_replay_is_translated_once_then_only_filled_in(monkeypatch):
    count = translated(monkeypatch)
    t = Twins()
    program = BIG[:3]  # no remote readers: nothing is translated on the spot
    t.both([m.InstrDefine(program=1, instrs=program, ntids=4, nseeds=1, nscalars=1)], eager=[])
    t.same()
    for n in range(3):
        count[0] = 0
        t.pair[0].submit(t.sid, t.seq + 1, [m.InstrReplay(program=1, tids=[100, 10 + n, 20 + n, 30 + n], seeds=[n],
                                                          scalars=[float(n)])])
        t.pair[1].submit(t.sid, t.seq + 1, p.fill(program, [100, 10 + n, 20 + n, 30 + n], [n], [float(n)]))
        t.seq += 1
        assert count[0] == (3 if n == 0 else 0) + 3  # the first replay and the eager twin; then the twin only
        sent = t.same()
        kinds = [type(c) for e in sent for c in e.execute.cmds]
        assert kinds[:2] == [m.CmdProgram, m.CmdCreate] if n == 0 else kinds == [m.CmdReplay, m.CmdReplay], kinds


def test_what_a_replay_reads_with_another_layout_is_translated_again(monkeypatch):
    count = translated(monkeypatch)
    t = Twins()
    t.both([m.InstrDefine(program=1, instrs=BIG[:3], ntids=4, nseeds=1, nscalars=1),
            m.InstrCreate(tid=101, spec=sp([8, 4], ["R"]), init="ones")], eager=[
        m.InstrCreate(tid=101, spec=sp([8, 4], ["R"]), init="ones")])
    t.step(1, BIG[:3], [100, 10, 11, 12], seeds=[1], scalars=[1.0])
    t.same()
    count[0] = 0
    t.step(1, BIG[:3], [101, 20, 21, 22], seeds=[2], scalars=[2.0])  # a replicated input: not what it was compiled for
    assert count[0] == 6
    t.same()


def migrate(h, sid, device, to):
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=device, to_worker=to))
    for _ in range(3):
        h.report_all()
    assert h.replies[rid].ok


def lose(h, sid, victim):
    h.handle(ev.WorkerUnreachable(victim, "", "killed"))
    for _ in range(4):
        h.report_all()
    assert h.core.sessions[sid].state == "open"


@pytest.mark.parametrize("change", ["migration", "loss"])
def test_a_moved_binding_is_never_replayed_stale(monkeypatch, change):
    count = translated(monkeypatch)
    t = Twins(workers=4, snapshot_every_batches=2)
    t.both([m.InstrDefine(program=1, instrs=BIG, ntids=5, nseeds=1, nscalars=1)], eager=[])
    for n in range(2):
        t.step(1, BIG, [100, 10 + n, 20 + n, 30 + n, 40 + n], seeds=[n], scalars=[1.0])
        t.each(Harness.report_all)
        t.same()
    s = t.pair[0].core.sessions[t.sid]
    before = dict(s.devices)
    if change == "migration":
        to = next(w for w in t.pair[0].core.workers if w not in s.devices.values())
        t.each(lambda h: migrate(h, t.sid, 1, to))
    else:
        victim = s.devices[1]
        t.each(lambda h: lose(h, t.sid, victim))
    assert s.devices != before
    t.same()  # a rebuild translates the logged replays on the new binding, like the instructions they stand for
    count[0] = 0
    t.step(1, BIG, [100, 50, 51, 52, 53], seeds=[7], scalars=[3.0])
    sent = t.same()
    assert count[0] >= 2 * len(BIG)  # translated again, on the new binding
    assert {e.worker_id for e in sent} == set(s.devices.values())


def test_a_program_deleting_an_input_peers_still_read_holds_that_delete_back():
    t = Twins()
    step = [m.InstrCall(op="aten.add.Tensor", mesh=1, args=[{"$t": 0}, {"$t": 0}], kwargs={},
                        outs=[m.OutSpec(1, sp([8, 4]))], src="s.py:1"), m.InstrDelete(tids=[0])]
    ones = [m.InstrCreate(tid=tid, spec=sp([8, 4]), init="ones") for tid in (300, 400)]
    t.both([m.InstrDefine(program=1, instrs=step, ntids=2), *ones], eager=ones)
    t.step(1, step, [300, 301])  # compiled while its input has no readers
    t.same()
    t.both([m.InstrRedistribute(src=400, dst=401, src_spec=sp([8, 4]), dst_spec=sp([8, 4], mesh=2))])
    t.same()
    t.step(1, step, [400, 402])  # 400 is still being pulled by the other worker
    t.same()
    assert [dd.tid for dd in t.pair[0].core.sessions[t.sid].deferred] == [400]
    t.each(Harness.report_all)
    t.same()


# ---------------------------------------------------------------- the rules of compiled programs, one by one


def test_a_batch_may_expand_to_exactly_its_bound(monkeypatch):
    """Rule 3: replays standing for MAX_EXPANDED instructions in all are accepted; one more is refused."""
    monkeypatch.setattr(programs, "MAX_EXPANDED", 6)
    out, refused = expand({}, [define(), *[m.InstrReplay(program=7, tids=[1, 2, 3], seeds=[0])] * 3])
    assert len(out) == 6 and len(refused) == 1 and "at most 6 instructions" in refused[0].message


def test_the_accepted_notice_counts_what_a_batch_stands_for(h):
    """Metrics and usage count a batch's instructions with each replay standing for its program's (`size`)."""
    from dtorch_controller.core import effects as fx

    h.register("10.0.0.1:7001")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0]).placed
    h.submit(sid, 1, [m.InstrCreate(tid=10, spec=spec([8]), init="zeros"), define(),
                      m.InstrReplay(program=7, tids=[10, 11, 12], seeds=[3]), m.InstrDelete(tids=[12])])
    assert [n for n in h.notices if isinstance(n, fx.Accepted)] == [fx.Accepted(sid, 1, 1 + len(STEP) + 1)]


# a random tensor (seed slot 0) pulled to mesh 2, then deleted while its pullers may still read it
MOVED = [m.InstrCreate(tid=1, spec=sp([8, 4]), init="randn", seed=0, src="s.py:1"),
         m.InstrRedistribute(src=1, dst=2, src_spec=sp([8, 4]), dst_spec=sp([8, 4], mesh=2), src_line="s.py:2"),
         m.InstrDelete(tids=[1])]


@pytest.mark.parametrize("program, held", [(BIG, 2), (MOVED, 1)], ids=["made-by-a-call", "made-by-a-create"])
def test_a_program_whose_deletes_wait_for_its_own_pulls_is_compiled_once_then_only_filled_in(monkeypatch, program,
                                                                                              held):
    """Rules 4 and 6: deletes held back for the program's own remote readers are part of what is compiled (the
    readers and the held deletes are redone per replay): the second replay on is one CmdReplay per worker."""
    count = translated(monkeypatch)
    t = Twins(rendezvous=False)
    ntids = 1 + max(max(lineage.instr_tids(i)) for i in program)
    scalars = [1.0] if program is BIG else []
    t.both([m.InstrDefine(program=1, instrs=program, ntids=ntids, nseeds=1, nscalars=len(scalars))], eager=[])
    for n in range(3):
        count[0] = 0
        tids = [100, *(10 * k + n for k in range(1, ntids))]
        t.step(1, program, tids, seeds=[n], scalars=scalars)
        assert count[0] == (2 if n == 0 else 1) * len(program)  # the eager twin's, and the first replay's
        sent = t.same()
        assert n == 0 or {type(c) for e in sent for c in e.execute.cmds} == {m.CmdReplay}
        assert [dd.tid for dd in t.pair[0].core.sessions[t.sid].deferred][-1:] == [tids[held]]
        t.each(Harness.report_all)
        t.same()


def test_a_delete_held_back_in_the_middle_of_a_program_is_held_back_once(monkeypatch):
    """Rule 6: a delete held back for the program's pulls, followed by more instructions, is held back on each
    replay (once): it never goes out while the peers still pull."""
    more = [*BIG, m.InstrCreate(tid=5, spec=sp([8, 4]), init="zeros", src="s.py:6")]
    t = Twins(rendezvous=False)
    t.both([m.InstrDefine(program=1, instrs=more, ntids=6, nseeds=1, nscalars=1)], eager=[])
    for n in range(3):
        tids = [100, 10 + n, 20 + n, 30 + n, 40 + n, 50 + n]
        t.step(1, more, tids, seeds=[n], scalars=[1.0])
        sent = t.same()
        assert not [c for e in sent for c in e.execute.cmds if type(c) is m.CmdDelete and 20 + n in c.tids]
        t.each(Harness.report_all)
        t.same()


def test_origins_of_a_compiled_replay_keep_the_first_maker_of_a_tensor_written_in_place():
    """Rule 6 (`_net`): a tensor made by one op and written in place by another keeps its maker as its origin (the
    op a loss message names), on every replay, as the instructions would."""
    step = [m.InstrCreate(tid=1, spec=sp([8, 4]), init="randn", seed=0, src="s.py:1"),
            m.InstrCall(op="aten.add_.Tensor", mesh=1, args=[{"$t": 1}, {"$t": 0}], kwargs={},
                        outs=[m.OutSpec(1, sp([8, 4]))], src="s.py:2")]
    t = Twins()
    t.both([m.InstrDefine(program=1, instrs=step, ntids=2, nseeds=1)], eager=[])
    for n in range(3):
        t.step(1, step, [100, 10 + n], seeds=[n])
        t.same()
        assert t.pair[0].core.pipeline.recs[t.sid].origin[10 + n] == ("create:randn", "s.py:1")


def test_a_program_reading_a_tensor_peers_still_pull_deletes_it_at_its_place_on_later_replays():
    """Rules 5 and 6: a program that deletes an input peers are still pulling is not kept (its delete waits, out
    of its place); a later replay of it is translated again, so a delete followed by a new tensor under the same
    id goes out in that order (the new tensor is not deleted)."""
    t = Twins()
    step = [m.InstrCall(op="aten.add.Tensor", mesh=1, args=[{"$t": 0}, {"$t": 0}], kwargs={},
                        outs=[m.OutSpec(1, sp([8, 4]))], src="s.py:1"),
            m.InstrDelete(tids=[0]),
            m.InstrCreate(tid=0, spec=sp([8, 4]), init="zeros", src="s.py:3")]
    ones = [m.InstrCreate(tid=tid, spec=sp([8, 4]), init="ones") for tid in (300, 400, 500)]
    t.both([m.InstrDefine(program=1, instrs=step, ntids=2), *ones], eager=ones)
    t.step(1, step, [300, 301])
    t.same()
    t.both([m.InstrRedistribute(src=400, dst=401, src_spec=sp([8, 4]), dst_spec=sp([8, 4], mesh=2))])
    t.same()
    t.step(1, step, [400, 402])  # 400 is still being pulled: its delete waits
    t.same()
    t.step(1, step, [500, 502])
    sent = t.same()
    for _worker, _seq, _cap, cmds in t.workers[0].run(sent):  # what each worker runs, replays filled in
        kinds = [(type(c), getattr(c, "tid", None) or getattr(c, "tids", None)) for c in cmds]
        assert kinds.index((m.CmdDelete, [500])) < kinds.index((m.CmdCreate, 500))
    assert 500 in t.pair[0].core.sessions[t.sid].tensors


def test_a_program_writing_a_live_tensor_whose_old_readers_are_done_deletes_it_at_once():
    """Rule 6: the deletes a compiled program holds back wait for the readers pending at each replay, not for the
    readers a tensor under the same id had before (an out= op writes a live tensor: its earlier pulls are done),
    and a replay whose tensor has no readers at all deletes it at once."""
    t = Twins()  # collectives: the gather below records no remote reader
    step = [m.InstrCall(op="aten.add.Tensor", mesh=1, args=[{"$t": 0}, {"$t": 0}], kwargs={},
                        outs=[m.OutSpec(1, sp([8, 4]))], src="s.py:1"),
            m.InstrRedistribute(src=1, dst=2, src_spec=sp([8, 4]), dst_spec=sp([8, 4], ["R"]), src_line="s.py:2"),
            m.InstrDelete(tids=[1])]
    ones = [m.InstrCreate(tid=tid, spec=sp([8, 4]), init="ones") for tid in (400, 600)]
    pull = [m.InstrRedistribute(src=tid, dst=tid + 1, src_spec=sp([8, 4]), dst_spec=sp([8, 4], mesh=2))
            for tid in (400, 600)]
    t.both([m.InstrDefine(program=1, instrs=step, ntids=3), *ones, pull[0]], eager=[*ones, pull[0]])
    t.same()
    t.step(1, step, [100, 400, 402])  # 400 written while its pull is pending: its delete waits for that pull
    t.same()
    assert [dd.tid for dd in t.pair[0].core.sessions[t.sid].deferred] == [400]
    t.each(Harness.report_all)
    t.same()
    t.both([pull[1]])
    t.each(Harness.report_all)  # the pullers completed exactly the Execute that pulled 600, nothing after it
    t.same()
    for tid in (600, 700):  # 600: its pull is done; 700: never read
        t.step(1, step, [100, tid, tid + 2])
        sent = t.same()
        assert not t.pair[0].core.sessions[t.sid].deferred
        assert any(type(c) is m.CmdReplay for e in sent for c in e.execute.cmds)


@pytest.mark.parametrize("make", [
    [m.InstrCreate(tid=1, spec=m.TensorSpec(shape=[8], dtype="float32", mesh=2, placements=["S0"]),
                   init="randn", seed=0, src="s.py:1")],
    [m.InstrRedistribute(src=0, dst=1, src_spec=m.TensorSpec(shape=[8], dtype="float32", mesh=1, placements=["R"]),
                         dst_spec=m.TensorSpec(shape=[8], dtype="float32", mesh=2, placements=["R"]))],
], ids=["create", "redistribute"])
def test_a_compiled_program_is_not_replayed_onto_a_lost_worker(make_harness, make):
    """Rule 5: a compiled program holds while none of the workers of the meshes it uses is lost, also a mesh it
    only creates or moves tensors to. After a loss that could not be rebuilt, a replay is translated again and,
    like the instructions it stands for, reports that the lost devices' part was skipped."""
    h = make_harness(snapshot_every_batches=0)  # no copies: the loss is reported, the devices stay bound
    w0, w1 = h.register("10.0.0.1:7001"), h.register("10.0.0.2:7002")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0]).placed and h.open_mesh(sid, 2, [1]).placed
    assert h.core.sessions[sid].devices == {0: w0, 1: w1}
    inputs = [m.InstrCreate(tid=tid, spec=m.TensorSpec(shape=[8], dtype="float32", mesh=1, placements=["R"]),
                            init="ones") for tid in (10, 20, 30)]
    h.submit(sid, 1, [m.InstrDefine(program=1, instrs=make, ntids=2, nseeds=1), *inputs])
    for seq, tid in ((2, 10), (3, 20)):
        h.take_sent()
        h.submit(sid, seq, [m.InstrReplay(program=1, tids=[tid, tid + 1], seeds=[seq])])
    assert {type(c) for e in h.take_sent() for c in e.execute.cmds} == {m.CmdReplay}  # compiled
    h.report_all()
    h.handle(ev.WorkerUnreachable(w1, "", "killed"))
    h.sync(sid, 3)
    h.submit(sid, 4, [m.InstrReplay(program=1, tids=[30, 31], seeds=[4])])
    sent = h.take_sent()
    assert w1 not in [e.worker_id for e in sent] and m.CmdReplay not in [type(c) for e in sent for c in e.execute.cmds]
    h.report_all()
    _, reply = h.sync(sid, 4)
    assert [e.message for e in reply.errors] == [
        f"logical devices [1] were on worker {w1}, which was lost; their part of this batch was skipped"]


def gather(src, dst, mesh=1):
    return m.InstrRedistribute(src=src, dst=dst, src_spec=sp([8, 4], mesh=mesh), dst_spec=sp([8, 4], ["R"], mesh=mesh))


def test_a_programs_collectives_number_on_from_groups_used_before_and_a_replay_names_only_its_groups():
    """Rule 6: a compiled program keeps its group op numbers relative to the group's counter when it was compiled
    (here the group had ops before), and each replay sends the counters of the groups it uses, no others."""
    t = Twins()
    t.both([m.InstrDefine(program=1, instrs=BIG[:3], ntids=4, nseeds=1, nscalars=1), gather(100, 101),
            m.InstrCreate(tid=200, spec=sp([8, 4], mesh=2), init="ones"), gather(200, 201, mesh=2)],
           eager=[gather(100, 101), m.InstrCreate(tid=200, spec=sp([8, 4], mesh=2), init="ones"),
                  gather(200, 201, mesh=2)])
    t.same()
    groups = t.pair[0].core.sessions[t.sid].comm.groups
    assert len(groups) == 2 and all(g.seq for g in groups.values())  # both groups have ops already
    for n in range(3):
        t.step(1, BIG[:3], [100, 10 + n, 20 + n, 30 + n], seeds=[n], scalars=[1.0])
        sent = t.same()
        ops = [o for _w, _q, _cap, cmds in t.workers[0].run(sent) for c in cmds if type(c) is m.CmdCollective
               for step in c.steps for o in step.ops]
        assert len({o.group for o in ops}) == 1 and len(groups) == 2
        if n:
            assert [set(c.groups) for e in sent for c in e.execute.cmds] == [{ops[0].group}] * len(sent)


def test_a_replay_that_names_a_tensor_twice_is_not_kept_and_runs_as_its_instructions(monkeypatch):
    """Rule 4: a replay whose tensor ids repeat is translated but not kept (slots could not stand for its ids), so
    every such replay is translated again, like the instructions it stands for."""
    count = translated(monkeypatch)
    step = [m.InstrCall(op="aten.add.Tensor", mesh=1, args=[{"$t": 0}, {"$t": 1}], kwargs={},
                        outs=[m.OutSpec(2, sp([8, 4]))], src="s.py:1")]
    t = Twins()
    t.both([m.InstrDefine(program=1, instrs=step, ntids=3)], eager=[])
    for n in range(2):
        count[0] = 0
        t.step(1, step, [100, 100, 200 + n])
        assert count[0] == 2
        sent = t.same()
        assert m.CmdProgram not in {type(c) for e in sent for c in e.execute.cmds}


def test_a_binding_moved_away_and_back_is_translated_again_for_its_new_process_groups(monkeypatch):
    """Rule 5: a compiled program holds for one generation of the session's process groups: devices that moved
    away and back are where they were, but the groups are new, so the next replay is translated again."""
    count = translated(monkeypatch)
    t = Twins(workers=3)
    t.both([m.InstrDefine(program=1, instrs=BIG[:3], ntids=4, nseeds=1, nscalars=1)], eager=[])
    t.step(1, BIG[:3], [100, 10, 20, 30], seeds=[1], scalars=[1.0])
    t.each(Harness.report_all)
    t.same()
    s = t.pair[0].core.sessions[t.sid]
    home, before = s.devices[1], dict(s.devices)
    away = next(w for w in t.pair[0].core.workers if w not in s.devices.values())
    for to in (away, home):
        t.each(lambda h, to=to: migrate(h, t.sid, 1, to))
    assert s.devices == before and s.comm.generation > 1
    t.same()
    count[0] = 0
    t.step(1, BIG[:3], [100, 11, 21, 31], seeds=[2], scalars=[2.0])
    assert count[0] == 2 * 3
    t.same()


def test_a_replay_reading_another_tensor_of_the_same_layout_is_only_filled_in(monkeypatch):
    """Rule 5: what a compiled program reads must have the specs it had, not be the same tensor."""
    count = translated(monkeypatch)
    t = Twins()
    again = [m.InstrCreate(tid=101, spec=sp([8, 4]), init="ones")]
    t.both([m.InstrDefine(program=1, instrs=BIG[:3], ntids=4, nseeds=1, nscalars=1), *again], eager=again)
    t.step(1, BIG[:3], [100, 10, 20, 30], seeds=[1], scalars=[1.0])
    t.same()
    count[0] = 0
    t.step(1, BIG[:3], [101, 11, 21, 31], seeds=[2], scalars=[2.0])
    assert count[0] == 3  # the eager twin only
    sent = t.same()
    assert {type(c) for e in sent for c in e.execute.cmds} == {m.CmdReplay}


def test_after_a_mesh_is_opened_again_a_replay_is_translated_again(monkeypatch):
    """Rule 5: a compiled program holds for the mesh objects it used; a mesh opened again is a new one, so the
    next replay is translated again (here it also reads an input of another layout)."""
    count = translated(monkeypatch)
    t = Twins()
    other = [m.InstrCreate(tid=101, spec=sp([8, 4], ["R"]), init="ones")]
    t.both([m.InstrDefine(program=1, instrs=BIG[:3], ntids=4, nseeds=1, nscalars=1), *other], eager=other)
    t.step(1, BIG[:3], [100, 10, 20, 30], seeds=[1], scalars=[1.0])
    t.same()
    t.each(lambda h: h.open_mesh(t.sid, 1, [0, 1]))
    count[0] = 0
    t.step(1, BIG[:3], [101, 11, 21, 31], seeds=[2], scalars=[2.0])
    assert count[0] == 2 * 3  # the eager twin's and the replay's
    t.same()
