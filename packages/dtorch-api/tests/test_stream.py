"""The instruction stream (`_stream.Stream`) against a recording controller: order, numbering, deletes after
uses, the sender thread, a broken stream, Sync and its errors, keep-alive. No processes."""

from __future__ import annotations

import threading

import pytest

from dtorch import _stream
from dtorch._stream import Stream
from dtorch.errors import ClusterError, RemoteOpError
from dtorch_protocol import messages as m


def create(tid: int) -> m.InstrCreate:
    return m.InstrCreate(tid=tid, spec=m.TensorSpec(shape=[1], dtype="float32", mesh=0, placements=[]), init="zeros")


def sent(controller) -> list:
    """Every instruction sent, in order (in Submits, and batches carried by Syncs), after checking that batches
    are numbered 1, 2, ... in the order the controller got them, and bounded."""
    batches = [(r.seq if name == "Submit" else r.upto, r.instrs) for name, r in controller.calls
               if name == "Submit" or (name == "Sync" and r.instrs)]
    assert [seq for seq, _ in batches] == list(range(1, len(batches) + 1))
    assert all(0 < len(instrs) <= _stream.MAX_BATCH for _, instrs in batches)
    return [i for _, instrs in batches for i in instrs]


@pytest.fixture
def stream(controller):
    s = Stream(controller, "s1", "ctl:1")
    yield s
    s.close()


def test_flush_sends_everything_in_order_in_numbered_bounded_batches(stream, controller):
    instrs = [create(t) for t in range(1, _stream.MAX_BATCH + 10)]
    for i in instrs:
        stream.emit(i)
    stream.flush()
    assert sent(controller) == instrs
    assert stream.seq == len(controller.requests("Submit")) >= 2
    assert all(b.session == "s1" for b in controller.requests("Submit"))


def test_released_tids_are_deleted_after_every_instruction_queued_before(stream, controller):
    stream.emit(create(1))
    stream.emit(create(2))
    stream.release(1)
    stream.release(2)
    stream.flush()
    instrs = sent(controller)
    assert instrs[:2] == [create(1), create(2)]
    deleted = [t for i in instrs if isinstance(i, m.InstrDelete) for t in i.tids]
    assert deleted == [1, 2] and isinstance(instrs[-1], m.InstrDelete)


def test_the_sender_thread_ships_without_a_flush(stream, controller):
    stream.emit(create(7))
    batch = controller.wait_for("Submit")[0]
    assert batch.instrs == [create(7)] and batch.seq == 1


def test_a_failed_submit_breaks_the_stream_for_good(stream, controller):
    controller.fail["Submit"] = ConnectionError("connection reset")
    stream.emit(create(1))
    with pytest.raises(ClusterError, match=r"lost the instruction stream to the controller at ctl:1: connection reset"):
        stream.flush()
    del controller.fail["Submit"]
    stream.emit(create(2))
    with pytest.raises(ClusterError, match="lost the instruction stream"):
        stream.flush()  # the controller's view of the stream is unknown: nothing more is sent
    with pytest.raises(ClusterError, match="lost the instruction stream"):
        list(stream.sync(5.0))
    assert stream.broken and len(controller.requests("Submit")) == 1


def test_sync_flushes_then_waits_until_done_yielding_each_reply(stream, controller):
    controller.sync_replies = [m.SyncReply(done=False, locations={0: "w0"}),
                               m.SyncReply(done=True, locations={1: "w1"})]
    stream.emit(create(1))
    replies = list(stream.sync(30.0))
    assert [r.locations for r in replies] == [{0: "w0"}, {1: "w1"}]
    syncs = controller.requests("Sync")
    assert len(syncs) == 2 and all(s.upto == stream.seq == 1 for s in syncs)
    assert sent(controller) == [create(1)]


def test_a_sync_carries_the_last_batch_in_its_first_call_only(stream, controller):
    controller.sync_replies = [m.SyncReply(done=False), m.SyncReply(done=True)]
    instrs = [create(t) for t in range(1, _stream.MAX_BATCH + 4)]
    with stream._send_lock:  # the sender thread (every POLL_S) would send part of them while they are emitted
        for i in instrs:
            stream.emit(i)
    list(stream.sync(30.0))
    assert [b.seq for b in controller.requests("Submit")] == [1]  # the full batch before; the last one rides along
    first, second = controller.requests("Sync")
    assert (first.upto, first.instrs, second.upto, second.instrs) == (2, instrs[_stream.MAX_BATCH:], 2, [])
    assert sent(controller) == instrs


def test_a_sync_that_does_not_carry_submits_everything_first(stream, controller):
    stream.emit(create(1))
    list(stream.sync(30.0, carry=False))
    assert [(name, r.instrs) for name, r in controller.calls] == [("Submit", [create(1)]), ("Sync", [])]


def test_a_failed_carrying_sync_breaks_the_stream_for_good(stream, controller):
    controller.fail["Sync"] = ConnectionError("connection reset")
    stream.emit(create(1))
    with pytest.raises(ClusterError, match=r"lost the instruction stream to the controller at ctl:1: connection reset"):
        list(stream.sync(5.0))
    del controller.fail["Sync"]
    stream.emit(create(2))
    with pytest.raises(ClusterError, match="lost the instruction stream"):
        stream.flush()  # whether the controller accepted the carried batch is unknown: nothing more is sent
    assert stream.broken and controller.requests("Submit") == []


def test_no_later_batch_overtakes_a_carrying_sync(controller):
    """The controller refuses batches out of order: while a Sync carrying batch 1 is in flight, the sender thread
    sends nothing (it does not wait for it either: its keep-alives go on), and batch 2 follows once it returned."""
    in_sync, release = threading.Event(), threading.Event()
    plain = controller.__call__

    def call(method, request, timeout):
        if method == "Sync" and request.instrs:
            in_sync.set()
            assert release.wait(10.0)
        return plain(method, request, timeout)

    s = Stream(call, "s5", "ctl:1", keepalive_s=0.01)
    try:
        s.emit(create(1))
        syncing = threading.Thread(target=lambda: list(s.sync(30.0)))
        syncing.start()
        assert in_sync.wait(10.0)
        s.emit(create(2))  # another thread's instruction (a deletion, say) while the sync waits
        controller.wait_for("KeepAlive", 3)  # the sender thread kept ticking ...
        assert controller.requests("Submit") == []  # ... without sending batch 2 ahead of batch 1
        release.set()
        syncing.join(10.0)
        batch = controller.wait_for("Submit")[0]
        assert (batch.seq, batch.instrs) == (2, [create(2)])
        assert sent(controller) == [create(1), create(2)]
    finally:
        release.set()
        s.close()


def test_sync_raises_the_first_op_error_with_the_others_as_notes(stream, controller):
    errors = [m.ErrorReport(op=f"aten.op{i}", src=f"train.py:{i}", message=f"boom {i}") for i in range(6)]
    controller.sync_replies = [m.SyncReply(done=True, errors=errors, locations={0: "w0"})]
    seen = []
    with pytest.raises(RemoteOpError) as info:
        for reply in stream.sync(30.0):
            seen.append(reply.locations)
    assert seen == [{0: "w0"}]  # the locations still reach the caller
    assert str(info.value).startswith("aten.op0 failed on a worker at train.py:0") and "boom 0" in str(info.value)
    assert info.value.__notes__ == ["also: aten.op1 at train.py:1: boom 1", "also: aten.op2 at train.py:2: boom 2",
                                    "also: aten.op3 at train.py:3: boom 3", "and 2 more errors"]


def test_an_error_without_a_source_line_is_a_cluster_error(stream, controller):
    controller.sync_replies = [m.SyncReply(done=True, errors=[m.ErrorReport(op="", src="", message="worker lost")])]
    with pytest.raises(ClusterError, match="worker lost"):
        list(stream.sync(30.0))


def test_sync_gives_up_after_its_timeout_with_the_controllers_message(stream, controller):
    controller.sync_replies = [m.SyncReply(done=False, message="waiting for w1")]
    with pytest.raises(TimeoutError, match=r"did not finish within 0 s \(DTORCH_TIMEOUT\): waiting for w1"):
        list(stream.sync(0.0))


def test_a_frozen_sessions_wait_is_bounded_by_the_queue_timeout_not_dtorch_timeout(stream, controller):
    """A preempted session waits for devices, not for workers: its sync raised after DTORCH_TIMEOUT (300 s) whatever
    the scheduler was doing. The frozen time counts against DTORCH_QUEUE_TIMEOUT instead."""
    frozen = m.SyncReply(done=False, frozen=True, queue_position=1, message="the session is frozen (preempted)")
    controller.sync_replies = [frozen, frozen, frozen, m.SyncReply(done=True)]
    replies = list(stream.sync(0.0, queue_timeout=60.0))  # no time at all for workers: none was spent on them
    assert [r.frozen for r in replies] == [True, True, True, False]
    controller.sync_replies = [frozen]
    with pytest.raises(TimeoutError, match=r"stayed frozen \(preempted\) for 0 s \(DTORCH_QUEUE_TIMEOUT\): the"):
        list(stream.sync(60.0, queue_timeout=0.0))
    controller.sync_replies = [m.SyncReply(done=False, message="workers still busy")]
    with pytest.raises(TimeoutError, match=r"within 0 s \(DTORCH_TIMEOUT\): workers still busy"):
        list(stream.sync(0.0, queue_timeout=60.0))  # busy workers: DTORCH_TIMEOUT as before
    assert all(0 < s.timeout_s <= _stream.SYNC_POLL_S for s in controller.requests("Sync"))  # it hears how it stands


def test_keepalive_when_the_controller_asks(controller):
    alive = Stream(controller, "s2", "ctl:1", keepalive_s=0.01)
    try:
        assert controller.wait_for("KeepAlive", 2)[0] == m.KeepAlive(session="s2")
    finally:
        alive.close()


def test_no_keepalive_when_the_controller_does_not_ask(stream, controller):
    stream.emit(create(1))
    controller.wait_for("Submit")
    stream.emit(create(2))
    stream.flush()
    assert controller.requests("KeepAlive") == []


def test_close_stops_the_sender_thread(controller):
    s = Stream(controller, "s4", "ctl:1")
    s.close()
    s._sender.join(5.0)
    assert not s._sender.is_alive()


def test_a_closed_stream_says_so_at_the_next_sync_instead_of_a_transport_error(controller):
    s = Stream(controller, "s6", "ctl:1")
    s.close()
    s.emit(create(1))  # an op on a tensor of the closed session
    with pytest.raises(ClusterError, match=r"session s6 was closed \(dtorch.shutdown\(\), or the end of its `with "
                                           r"dtorch.connect\(\)` block\)"):
        list(s.sync(1.0))
    assert not [name for name, _ in controller.calls if name in ("Submit", "Sync")]


def test_records_are_encoded_by_the_flushing_thread_in_queue_order(stream, controller):
    stream.emit(create(1))
    stream.emit((lambda r: create(r[1] * 10), 2))
    stream.emit(create(3))
    stream.flush()
    assert sent(controller) == [create(1), create(20), create(3)]


def test_a_record_that_cannot_be_encoded_breaks_the_stream(stream, controller):
    def broken(record):
        raise ValueError("no")

    stream.emit((broken,))
    with pytest.raises(ClusterError, match="could not encode an instruction for the controller: ValueError"):
        stream.flush()
    assert stream.broken


def test_a_submits_answer_naming_uploads_goes_to_on_uploads_at_once(controller):
    """Rule 8: a rebuild's request for uploads, and the uploads that are safe, in a Submit's answer reach the session
    before any sync point."""
    plain, heard = controller.__call__, []

    def call(method, request, timeout):
        reply = plain(method, request, timeout)
        if method == "Submit" and request.seq == 1:
            return m.SubmitReply(accepted=request.seq, reput={7: [1]}, safe=[3])
        return m.SubmitReply(accepted=request.seq, safe=[4]) if method == "Submit" and request.seq == 2 else reply

    s = Stream(call, "s9", "ctl:1", on_uploads=lambda *told: heard.append(told))
    try:
        for tid in (1, 2, 3):
            s.emit(create(tid))
            s.flush()
        assert heard == [({7: [1]}, [3]), ({}, [4])]  # the third answer told nothing
    finally:
        s.close()


def test_a_keepalives_answer_naming_uploads_goes_to_on_uploads(controller):
    """Rule 8: a client that sends nothing between sync points hears a rebuild's request, and the uploads that are
    safe, in a keep-alive's answer."""
    plain, heard = controller.__call__, []

    def call(method, request, timeout):
        reply = plain(method, request, timeout)
        return m.KeepAliveReply(reput={7: [1]}, safe=[3]) if method == "KeepAlive" and not heard else reply

    s = Stream(call, "s10", "ctl:1", keepalive_s=0.01, on_uploads=lambda *told: heard.append(told))
    try:
        controller.wait_for("KeepAlive", 3)
        assert heard == [({7: [1]}, [3])]  # once: the later keep-alives' answers told nothing
        assert controller.requests("Submit") == []
    finally:
        s.close()
