"""Sessions: opening, mesh placement, Submit translation (exact commands), Sync, close, bad input."""

from __future__ import annotations

import pytest

from _core_helpers import add_, create, spec
from dtorch_controller.core import Refusal
from dtorch_controller.core import events as ev
from dtorch_controller.core.timers import Heartbeat, SyncDeadline
from dtorch_protocol import messages as m
from dtorch_protocol.wire import hello


def cluster(h, workers=2, devices=(0, 1, 2, 3), shape=None):
    ids = [h.register(f"10.0.0.{i}:700{i}") for i in range(workers)]
    sid = h.open_session()
    placed = h.open_mesh(sid, 1, list(devices), shape)
    assert placed.placed
    h.take_sent()
    return ids, sid


def by_worker(sent):
    return {s.worker_id: s.execute for s in sent}


# ---------------------------------------------------------------- sessions and meshes


def test_open_session_uses_the_injected_id_generator_and_refuses_other_majors(h):
    reply = h.call(ev.OpenSession, m.OpenSession(hello=hello("client"), name="a"))
    assert reply.session == "sess1" and reply.controller_version
    assert h.open_session() == "sess2"
    old = m.Hello(protocol_version="0.3", package_version="0.0.1", role="client")
    reply = h.call(ev.OpenSession, m.OpenSession(hello=old))
    assert isinstance(reply, Refusal) and reply.kind == "protocol"
    assert "0.3" in reply.message and m.PROTOCOL_VERSION in reply.message


def test_bad_priority_is_refused(h, refused):
    assert refused(h.call(ev.OpenSession, m.OpenSession(hello=hello("client"), priority="urgent")))


def test_mesh_without_workers_is_not_placed(h):
    sid = h.open_session()
    reply = h.open_mesh(sid, 1, [0, 1])
    assert reply == m.MeshPlaced(mesh=1, placed=False, queue_position=1, message="no workers registered")
    assert 1 not in h.core.sessions[sid].meshes


def test_virtual_devices_spread_over_workers_fewest_bound_first(h):
    w0, w1 = h.register("a:1"), h.register("b:1")
    s1 = h.open_session()
    reply = h.open_mesh(s1, 1, [0, 1, 2, 3, 4], [5])
    assert reply.placed and reply.locations == {0: "a:1", 1: "b:1", 2: "a:1", 3: "b:1", 4: "a:1"}
    # devices are exclusive across sessions: a second session waits until the first one closes
    s2 = h.open_session()
    assert not h.open_mesh(s2, 1, [0]).placed
    h.call(ev.CloseSession, m.CloseSession(session=s1))
    assert h.open_mesh(s2, 1, [0]).placed
    assert h.core.sessions[s2].devices == {0: w0}
    assert (h.core.workers[w0].bound, h.core.workers[w1].bound) == (1, 0)


def test_a_placed_mesh_says_the_device_type_of_each_logical_devices_worker(h):
    h.register("a:1", device_type="cuda"), h.register("b:1", device_type="cpu")
    sid = h.open_session()
    reply = h.open_mesh(sid, 1, [0, 1, 2], [3])
    assert reply.placed and reply.locations == {0: "a:1", 1: "b:1", 2: "a:1"}
    assert reply.device_types == {0: "cuda", 1: "cpu", 2: "cuda"}  # the client checks them against its mesh's type


def test_logical_devices_are_shared_across_meshes_of_a_session(h):
    h.register("a:1"), h.register("b:1")
    sid = h.open_session()
    first = h.open_mesh(sid, 1, [0, 1, 2, 3], [2, 2])
    second = h.open_mesh(sid, 2, [3, 2, 5], [3])
    assert second.placed
    assert second.locations[3] == first.locations[3] and second.locations[2] == first.locations[2]
    assert set(h.core.sessions[sid].devices) == {0, 1, 2, 3, 5}
    # reopening the same mesh is idempotent; changing it is refused
    assert h.open_mesh(sid, 1, [0, 1, 2, 3], [2, 2]).locations == first.locations
    assert isinstance(h.open_mesh(sid, 1, [0, 1], [2]), Refusal)


@pytest.mark.parametrize("devices,shape", [([0, 1, 2], [2, 2]), ([0, 0], [2]), ([], []), ([0], [0])])
def test_bad_meshes_are_refused(h, refused, devices, shape):
    h.register("a:1")
    sid = h.open_session()
    assert refused(h.call(ev.OpenMesh, m.OpenMesh(session=sid, mesh=1, devices=devices, shape=shape)))


def test_a_session_has_at_most_64_logical_devices_per_device_of_the_cluster(h, refused):
    """A 2,048-device mesh packed onto one worker, then a redistribution of it, held the core for 29 s (its plan is
    O(sources x destinations)): its workers gave the controller up and exited."""
    from dtorch_controller.core.controller import MAX_LOGICAL_PER_DEVICE

    h.register("a:1")
    sid = h.open_session()
    assert h.open_mesh(sid, 1, list(range(MAX_LOGICAL_PER_DEVICE))).placed
    over = h.open_mesh(sid, 2, list(range(MAX_LOGICAL_PER_DEVICE, 2 * MAX_LOGICAL_PER_DEVICE)))
    assert refused(over) and "128 logical devices, over 64 (64 per device of the cluster's 1)" in over.message
    h.register("b:1")
    assert h.open_mesh(sid, 2, list(range(MAX_LOGICAL_PER_DEVICE, 2 * MAX_LOGICAL_PER_DEVICE))).placed


def test_unknown_session_is_refused_everywhere(h, refused):
    h.register("a:1")
    assert refused(h.open_mesh("nope", 1, [0]))
    assert refused(h.submit("nope", 1, []))
    assert refused(h.sync("nope", 0)[1])
    assert h.call(ev.CloseSession, m.CloseSession(session="nope")).ok is False


# ---------------------------------------------------------------- submit translation


def test_create_sends_each_worker_the_boxes_of_the_devices_it_hosts(h):
    (w0, w1), sid = cluster(h)
    reply = h.submit(sid, 1, [m.InstrCreate(tid=5, spec=spec([8, 2]), init="full", value=1.5, seed=3, src="a.py:1")])
    assert reply == m.SubmitReply(accepted=1)
    sent = by_worker(h.take_sent())
    assert sent[w0] == m.Execute(seq=1, session=sid, cmds=[m.CmdCreate(
        tid=5, dtype="float32", shape=[8, 2], init="full", boxes={0: [[0, 2], [0, 2]], 2: [[4, 2], [0, 2]]},
        zero=[], value=1.5, seed=3, src="a.py:1")])
    assert sent[w1].cmds[0].boxes == {1: [[2, 2], [0, 2]], 3: [[6, 2], [0, 2]]}
    assert h.core.sessions[sid].tensors[5] == spec([8, 2])


def test_create_partial_marks_zero_devices_and_uneven_shards_are_empty(h):
    (w0, w1), sid = cluster(h, devices=(0, 1, 2, 3), shape=[2, 2])
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([3], placements=("Psum", "S0")), init="ones")])
    sent = by_worker(h.take_sent())
    # mesh [[0, 1], [2, 3]]: w0 hosts 0 (coord 0,0) and 2 (coord 1,0); w1 hosts 1 (0,1) and 3 (1,1)
    assert sent[w0].cmds[0].boxes == {0: [[0, 2]], 2: [[0, 2]]} and sent[w0].cmds[0].zero == [2]
    assert sent[w1].cmds[0].boxes == {1: [[2, 1]], 3: [[2, 1]]} and sent[w1].cmds[0].zero == [3]
    h.submit(sid, 2, [m.InstrCreate(tid=2, spec=spec([3], mesh=1, placements=("S0", "S0")), init="ones")])
    sent = by_worker(h.take_sent())
    # 3 rows over 2 then 2: [0,2) -> [0,1) [1,2); [2,3) -> [2,3) and an empty box at 3
    assert sent[w0].cmds[0].boxes == {0: [[0, 1]], 2: [[2, 1]]}
    assert sent[w1].cmds[0].boxes == {1: [[1, 1]], 3: [[3, 0]]}


def test_call_runs_on_hosted_devices_with_local_args_filtered(h):
    (w0, w1), sid = cluster(h)
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8]), init="rand")])
    h.take_sent()
    call = m.InstrCall(op="aten.view.default", mesh=1, args=[{"$t": 1}, [2]], kwargs={"x": {"$t": 1}},
                       outs=[m.OutSpec(tid=2, spec=spec([8])), None],
                       local={0: [[{"$t": 1}, [2]], {}], 3: [[{"$t": 1}, [1]], {}]}, src="b.py:2", seed=11)
    h.submit(sid, 2, [call])
    sent = by_worker(h.take_sent())
    assert sent[w0] == m.Execute(seq=2, session=sid, cmds=[m.CmdRun(
        op="aten.view.default", devices=[0, 2], args=[{"$t": 1}, [2]], kwargs={"x": {"$t": 1}}, outs=[2, None],
        local={0: [[{"$t": 1}, [2]], {}]}, src="b.py:2", seed=11)])
    assert sent[w1].cmds[0].devices == [1, 3] and sent[w1].cmds[0].local == {3: [[{"$t": 1}, [1]], {}]}
    assert 2 in h.core.sessions[sid].tensors


def test_execute_seqs_are_per_worker_and_contiguous_across_sessions(h):
    w0, w1 = h.register("10.0.0.0:7000"), h.register("10.0.0.1:7001")
    s1, s2 = h.open_session(memory_cap=1 << 20), h.open_session(memory_cap=1 << 20)  # packed: they share devices
    assert h.open_mesh(s1, 1, [0, 1]).placed
    assert h.open_mesh(s2, 1, [0]).locations == {0: "10.0.0.0:7000"}  # lands on w0
    h.submit(s1, 1, [m.InstrCreate(tid=1, spec=spec([2]), init="zeros")])
    h.submit(s2, 1, [m.InstrCreate(tid=1, spec=spec([2], placements=("R",)), init="zeros")])
    h.submit(s1, 2, [m.InstrDelete(tids=[1])])
    seqs = [(s.worker_id, s.execute.session, s.execute.seq) for s in h.take_sent()]
    assert seqs == [(w0, s1, 1), (w1, s1, 1), (w0, s2, 2), (w0, s1, 3), (w1, s1, 2)]


def test_delete_groups_by_worker_and_devices_and_adopt_only_records(make_harness):
    h = make_harness(snapshot_every_batches=0)  # recovery off: adopts are not copied (test_core_recovery.py)
    (w0, w1), sid = cluster(h)
    h.register("c:1")
    h.open_mesh(sid, 2, [0, 1])
    h.submit(sid, 1, [m.InstrAdopt(tid=1, spec=spec([4])), m.InstrAdopt(tid=2, spec=spec([4])),
                      m.InstrAdopt(tid=3, spec=spec([2], mesh=2))])
    assert h.take_sent() == []
    assert set(h.core.sessions[sid].tensors) == {1, 2, 3}
    h.submit(sid, 2, [m.InstrDelete(tids=[1, 2, 3, 99])])
    sent = by_worker(h.take_sent())
    assert sent[w0].cmds == [m.CmdDelete(tids=[1, 2], devices=[0, 2]), m.CmdDelete(tids=[3], devices=[0])]
    assert sent[w1].cmds == [m.CmdDelete(tids=[1, 2], devices=[1, 3]), m.CmdDelete(tids=[3], devices=[1])]
    assert h.core.sessions[sid].tensors == {}


def test_redistribute_sends_plans_to_destination_workers(h):
    (w0, w1), sid = cluster(h, devices=(0, 1))
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([4]), init="rand")])
    h.take_sent()
    h.submit(sid, 2, [m.InstrRedistribute(src=1, dst=2, src_spec=spec([4]), dst_spec=spec([4], placements=("R",)),
                                          src_line="c.py:3")])
    sent = by_worker(h.take_sent())
    expect, cmd = sent[w0].cmds  # w1 pulls device 0's half once: announced to w0 first
    assert expect == m.CmdExpectReads(tid=1, reads={0: 1}, dst=2)
    assert isinstance(cmd, m.CmdRedistribute) and (cmd.src, cmd.dst, cmd.dtype, cmd.src_line) == (1, 2, "float32",
                                                                                                   "c.py:3")
    assert cmd.plans == {0: m.ShardPlan(shape=[4], groups=[[m.Piece("", 0, [0], [0], [2]),
                                                            m.Piece("10.0.0.1:7001", 1, [0], [2], [2])]])}
    assert sent[w1].cmds[0] == m.CmdExpectReads(tid=1, reads={1: 1}, dst=2)
    assert list(sent[w1].cmds[1].plans) == [1]


def test_redistribute_announces_remote_reads_to_every_source_worker(h):
    """Counts are per source device and count only pieces pulled across workers; source-only workers get them too."""
    (w0, w1, w2), sid = cluster(h, workers=3, devices=(0, 1, 2, 3))  # 0, 3 -> w0; 1 -> w1; 2 -> w2
    assert h.open_mesh(sid, 2, [2, 3]).placed  # destination mesh: devices on w2 and w0
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8]), init="rand")])
    h.take_sent()
    h.submit(sid, 2, [m.InstrRedistribute(src=1, dst=2, src_spec=spec([8]),
                                          dst_spec=spec([8], mesh=2, placements=("R",)))])
    sent = by_worker(h.take_sent())
    # device 2 (on w2) reads pieces of 0, 1, 3 remotely and its own locally;
    # device 3 (on w0) reads 1 and 2 remotely, 0 and 3 locally (same worker)
    assert sent[w1].cmds == [m.CmdExpectReads(tid=1, reads={1: 2}, dst=2)]  # a source only: nothing else to do
    assert sent[w2].cmds[0] == m.CmdExpectReads(tid=1, reads={2: 1}, dst=2)
    assert sent[w0].cmds[0] == m.CmdExpectReads(tid=1, reads={0: 1, 3: 1}, dst=2)
    assert [type(c) for c in sent[w0].cmds[1:]] == [m.CmdRedistribute] == [type(c) for c in sent[w2].cmds[1:]]
    rid, reply = h.sync(sid, 2)
    assert reply is None  # the source-only worker's batch counts too
    h.report(w0)
    h.report(w2)
    assert rid not in h.replies
    h.report(w1)
    assert h.replies[rid].done


def test_redistribute_without_remote_pieces_announces_nothing(h):
    (w0, w1), sid = cluster(h, devices=(0, 1))
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([4], placements=("R",)), init="rand")])
    h.take_sent()
    h.submit(sid, 2, [m.InstrRedistribute(src=1, dst=2, src_spec=spec([4], placements=("R",)),
                                          dst_spec=spec([4]))])  # every device slices its own replica
    sent = by_worker(h.take_sent())
    assert [type(c) for c in sent[w0].cmds] == [m.CmdRedistribute] == [type(c) for c in sent[w1].cmds]


def test_a_read_marks_the_stream_of_every_worker_of_the_tensors_mesh_and_is_never_an_error(h):
    """InstrRead (translate.py rule 4): a CmdReadable after the commands before it, on each worker of the mesh,
    even one the batch sends nothing else; an unknown tensor sends nothing and reports nothing."""
    (w0, w1, w2), sid = cluster(h, workers=3, devices=(0, 1, 2))
    assert h.open_mesh(sid, 2, [0, 1]).placed  # devices 0 and 1: w0 and w1
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([4], mesh=2), init="rand")])
    h.take_sent()
    h.submit(sid, 2, [m.InstrCall(op="aten.add_.Tensor", mesh=2, args=[{"$t": 1}, 1.0], kwargs={},
                                  outs=[m.OutSpec(tid=1, spec=spec([4], mesh=2))]),
                      m.InstrRead(tid=1, mark=7), m.InstrRead(tid=99, mark=8)])
    sent = by_worker(h.take_sent())
    assert set(sent) == {w0, w1}  # not w2: the tensor is not on it
    for w in (w0, w1):
        assert sent[w].cmds[-1] == m.CmdReadable(mark=7)
        assert any(isinstance(c, m.CmdRun) for c in sent[w].cmds[:-1])
    h.report_all()
    rid, reply = h.sync(sid, 2)
    assert (reply or h.replies[rid]).errors == []


def test_delete_of_a_remotely_read_source_waits_for_the_readers(h):
    (w0, w1), sid = cluster(h, devices=(0, 1))
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([4]), init="rand")])
    h.report_all()
    h.take_sent()
    h.submit(sid, 2, [m.InstrRedistribute(src=1, dst=2, src_spec=spec([4]), dst_spec=spec([4], placements=("R",))),
                      m.InstrDelete(tids=[1])])
    sent = h.take_sent()
    assert all(not isinstance(c, m.CmdDelete) for s in sent for c in s.execute.cmds)
    h.report(w0)  # w0 done, but w1 still reads w0's shard
    assert h.take_sent() == []
    h.report(w1)
    sent = by_worker(h.take_sent())
    assert sent[w0] == m.Execute(seq=3, session=sid, cmds=[m.CmdDelete(tids=[1], devices=[0])])
    assert sent[w1] == m.Execute(seq=3, session=sid, cmds=[m.CmdDelete(tids=[1], devices=[1])])


def test_delete_without_remote_readers_goes_out_at_once(h):
    (w0, w1), sid = cluster(h, devices=(0, 1))
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([4]), init="rand"),
                      m.InstrCall(op="aten.neg.default", mesh=1, args=[{"$t": 1}], kwargs={},
                                  outs=[m.OutSpec(2, spec([4]))]),
                      m.InstrDelete(tids=[1])])
    sent = by_worker(h.take_sent())
    assert isinstance(sent[w0].cmds[-1], m.CmdDelete) and isinstance(sent[w1].cmds[-1], m.CmdDelete)


# ---------------------------------------------------------------- bad input


def test_out_of_order_batches_are_refused(h, refused):
    _, sid = cluster(h)
    assert refused(h.submit(sid, 2, []))
    assert h.submit(sid, 1, []).accepted == 1
    reply = h.submit(sid, 1, [])
    assert refused(reply) and "expects batch 2" in reply.message


def test_bad_instructions_become_errors_at_the_next_sync_and_the_rest_still_runs(h):
    (w0, w1), sid = cluster(h)
    instrs = [
        m.InstrCreate(tid=1, spec=spec([4], mesh=9), init="rand", src="u.py:1"),  # unknown mesh
        m.InstrCall(op="aten.add.Tensor", mesh=1, args=[{"$t": 42}, {"$t": [1]}], kwargs={},
                    outs=[m.OutSpec(3, spec([4]))], src="u.py:2"),  # unknown tensors
        m.InstrCreate(tid=4, spec=spec([4], placements=("S3",)), init="rand"),  # shard dim out of range
        m.InstrCreate(tid=5, spec=spec([4], placements=("Q",)), init="rand"),  # bad placement
        m.InstrCreate(tid=6, spec=spec([4], placements=("S0", "R")), init="rand"),  # too many placements
        m.InstrRedistribute(src=77, dst=8, src_spec=spec([4]), dst_spec=spec([4])),  # unknown source
        m.InstrCall(op="aten.add.Tensor", mesh=3, args=[], kwargs={}, outs=[]),  # unknown mesh
        m.InstrCreate(tid=10, spec=spec([4]), init="zeros"),  # fine
    ]
    assert h.submit(sid, 1, instrs).accepted == 1
    sent = h.take_sent()
    assert [c.tid for s in sent for c in s.execute.cmds] == [10, 10]
    h.report_all()
    rid, reply = h.sync(sid, 1)
    assert reply.done
    messages = [(e.op, e.src, e.tid, e.message) for e in reply.errors]
    assert len(messages) == 7
    assert messages[0][:3] == ("create:rand", "u.py:1", 1) and "unknown mesh 9" in messages[0][3]
    assert messages[1][:3] == ("aten.add.Tensor", "u.py:2", 3) and "42" in messages[1][3]
    assert "out of range" in messages[2][3] and "'Q'" in messages[3][3] and "2 placements" in messages[4][3]
    assert "unknown tensor 77" in messages[5][3] and "unknown mesh 3" in messages[6][3]
    assert set(h.core.sessions[sid].tensors) == {10}
    # errors are cleared once delivered
    assert h.sync(sid, 1)[1].errors == []


def test_sync_beyond_the_last_batch_is_refused(h, refused):
    _, sid = cluster(h)
    assert refused(h.sync(sid, 3)[1])


# ---------------------------------------------------------------- sync


def test_sync_waits_for_every_worker_then_answers_with_errors_and_locations(h):
    (w0, w1), sid = cluster(h)
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8]), init="rand")])
    rid, reply = h.sync(sid, 1, timeout_s=5)
    assert reply is None
    failure = m.ErrorReport(op="create:rand", src="x.py:1", message="out of memory", tid=1)
    h.report(w0, errors={sid: [failure]})
    assert rid not in h.replies
    h.report(w1, completed=0)
    assert rid not in h.replies
    h.report(w1)
    reply = h.replies[rid]
    assert reply == m.SyncReply(done=True, errors=[failure],
                                locations={0: "10.0.0.0:7000", 1: "10.0.0.1:7001", 2: "10.0.0.0:7000",
                                           3: "10.0.0.1:7001"})


def test_sync_with_nothing_outstanding_answers_at_once(h):
    _, sid = cluster(h)
    assert h.sync(sid, 0)[1].done


def test_sync_times_out_naming_the_busy_workers(h):
    (w0, w1), sid = cluster(h)
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8]), init="rand")])
    rid, _ = h.sync(sid, 1, timeout_s=0.5)
    for _ in range(3):
        h.advance(0.2)
        h.report(w0)
        h.report(w1, completed=0)
    reply = h.replies[rid]
    assert not reply.done and "w1" in reply.message and "w0" not in reply.message.split("busy:")[1]
    assert "0.5s" in reply.message


def test_close_session_tells_every_holder_and_answers_pending_syncs(h):
    (w0, w1), sid = cluster(h)
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8]), init="rand")])
    rid, _ = h.sync(sid, 1)
    h.take_sent()
    assert h.call(ev.CloseSession, m.CloseSession(session=sid)).ok
    sent = by_worker(h.take_sent())
    assert sent == {w0: m.Execute(seq=2, session=sid, cmds=[m.CmdCloseSession()]),
                    w1: m.Execute(seq=2, session=sid, cmds=[m.CmdCloseSession()])}
    assert h.replies[rid].done is False
    assert sid not in h.core.sessions and h.core.workers[w0].bound == 0
    assert h.status().sessions == []
    h.advance(10)  # the stale sync timer fires harmlessly
    h.report_all()


def test_garbage_timer_keys_and_unknown_workers_are_ignored(h):
    h.handle(ev.TimerFired("nonsense"))  # type: ignore[arg-type]
    h.handle(ev.TimerFired(("sync", "nope", 1)))  # type: ignore[arg-type]
    h.handle(ev.TimerFired(SyncDeadline("nope", 1)))
    h.handle(ev.TimerFired(Heartbeat("w404")))
    h.handle(ev.WorkerUnreachable("w404"))
    with pytest.raises(TypeError):
        h.core.handle(0.0, object())  # an adapter bug, not client input


def test_a_report_cannot_finish_batches_it_never_got(h):
    (w0, w1), sid = cluster(h)
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8]), init="rand")])
    h.report(w0, completed=99)
    assert h.core.workers[w0].completed == 1
    h.submit(sid, 2, [m.InstrCreate(tid=2, spec=spec([8]), init="rand")])
    h.report(w1)
    rid, reply = h.sync(sid, 2)
    assert reply is None  # w0 has not finished batch 2 whatever it claimed before


def test_a_deferred_delete_never_hits_a_reused_tensor_id(h):
    (w0, w1), sid = cluster(h, devices=(0, 1))
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([4]), init="rand")])
    h.report_all()
    h.submit(sid, 2, [m.InstrRedistribute(src=1, dst=2, src_spec=spec([4]), dst_spec=spec([4], placements=("R",))),
                      m.InstrDelete(tids=[1]), m.InstrCreate(tid=1, spec=spec([4]), init="zeros")])
    h.take_sent()
    h.report_all()
    assert h.take_sent() == [] and h.core.sessions[sid].deferred == []


def test_a_sync_that_times_out_names_the_busy_workers_but_no_batch_counts(h):
    """A worker's batch numbers count every session's batches there: another tenant's activity, over time."""
    (w0, w1), sid = cluster(h)
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8]), init="rand")])
    rid, _ = h.sync(sid, 1, timeout_s=0.3)
    h.advance(0.4)
    reply = h.replies[rid]
    assert reply.done is False and "workers still busy" in reply.message and w0 in reply.message
    assert "completed" not in reply.message and " of " not in reply.message


def test_nan_sync_timeout_answers_at_once(h):
    (w0, w1), sid = cluster(h)
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8]), init="rand")])
    rid, reply = h.sync(sid, 1, timeout_s=float("nan"))
    h.advance(0.0)
    assert h.replies[rid].done is False


# ---------------------------------------------------------------- the dispatch window (pipeline rule 7)


@pytest.mark.parametrize("ahead", [1, 2])
def test_dispatch_ahead_sends_at_most_k_batches_of_a_session_to_a_worker_and_a_sync_waits_for_the_rest(make_harness,
                                                                                                     ahead):
    h = make_harness(dispatch_ahead=ahead, snapshot_every_batches=0)
    w0, w1 = h.register("10.0.0.0:7000"), h.register("10.0.0.1:7001")
    s = h.open_session()
    assert h.open_mesh(s, 1, [0, 1]).placed
    h.submit(s, 1, [create(1)])
    for seq in range(2, 6):
        h.submit(s, seq, [add_(1)])
    sent = h.take_sent()
    assert sorted((x.worker_id, x.execute.seq) for x in sent) == [(w, q) for w in (w0, w1) for q in range(1, ahead + 1)]
    rid, reply = h.sync(s, 5)
    assert reply is None  # batches wait in the log: the Sync waits for them too
    h.report(w0, completed=1)
    assert [(x.worker_id, x.execute.seq) for x in h.take_sent()] == []  # w1 is still full
    h.report(w1, completed=1)
    assert sorted((x.worker_id, x.execute.seq) for x in h.take_sent()) == [(w0, ahead + 1), (w1, ahead + 1)]
    for _ in range(5):
        h.report_all()
    assert h.replies[rid].done and h.core.workers[w0].sent == 5  # every batch went out, in order, then the Sync


def test_without_a_dispatch_window_everything_accepted_goes_out_at_once(h):
    h.register("10.0.0.0:7000")
    s = h.open_session()
    assert h.open_mesh(s, 1, [0]).placed
    h.submit(s, 1, [create(1)])
    h.submit(s, 2, [add_(1)])
    assert [x.execute.seq for x in h.take_sent()] == [1, 2]


def test_a_session_closed_during_a_move_is_forgotten_by_the_moves_target_too(h):
    """The target of a move under way may hold the session's shards already; the close went only to the workers
    its devices were bound to, so the copies stayed on the target until the worker restarted."""
    w0, _w1, w2 = (h.register(f"10.0.0.{i}:7000") for i in range(3))
    sid = h.open_session()
    assert h.open_mesh(sid, 1, [0]).locations == {0: "10.0.0.0:7000"}
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8]), init="rand")])
    h.report_all()
    h.take_sent()
    rid, _ = h.ask(ev.Migrate, m.MigrateRequest(session=sid, device=0, to_worker=w2, timeout_s=30))
    assert [s.worker_id for s in h.take_sent()] == [w0]  # the copy to w2 is under way
    assert h.call(ev.CloseSession, m.CloseSession(session=sid)).ok
    closes = {s.worker_id for s in h.take_sent() if any(type(c) is m.CmdCloseSession for c in s.execute.cmds)}
    assert closes == {w0, w2} and h.replies[rid].ok is False


def test_a_session_keeps_a_bounded_number_of_error_reports_and_its_sync_counts_the_rest(h):
    """A worker's flood of error reports for a session it runs grew the controller's memory without bound (and, on a
    rebuild, took time quadratic in their number)."""
    from dtorch_controller.core.controller import MAX_ERRORS_HELD

    (w0, w1), sid = cluster(h)
    h.submit(sid, 1, [m.InstrCreate(tid=1, spec=spec([8]), init="rand")])
    flood = [m.ErrorReport(op="aten.add", src="train.py:9", message=f"failure {i}")
             for i in range(MAX_ERRORS_HELD + 10)]
    h.report(w0, errors={sid: flood})
    h.report_all()
    _, reply = h.sync(sid, 1)
    assert reply.done and len(reply.errors) == MAX_ERRORS_HELD + 1
    assert reply.errors[0].message == "failure 0" and reply.errors[-1].message.startswith("10 more error reports")
