"""Relocation (`_relocate`): the decision table of `relocate` on a fake clock, `seen` reading Status, and the watch
on a transfer (looks on the process's one watcher thread, cancels once the device moved)."""

from __future__ import annotations

import threading
import time

import pytest

from dtorch import _relocate
from dtorch._relocate import DeviceLost, Seen, relocate, seen
from dtorch.errors import ClusterError
from dtorch_protocol import messages as m


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(_relocate, "time", c)
    return c


def script(*answers: Seen):
    """look(device) answering each Seen in turn (the last one repeats)."""
    left = list(answers)

    def look(device: int) -> Seen:
        return left.pop(0) if len(left) > 1 else left[0]

    return look


MOVING = Seen("migrating", "w1", None, None)


def test_a_device_rebound_elsewhere_gives_the_new_address(clock):
    assert relocate(script(MOVING, MOVING, Seen("running", "w2", "alive", "h2")), 0, "h1", 60.0) == "h2"
    assert clock.now == pytest.approx(2 * _relocate.POLL_S)


def test_a_device_on_a_lost_worker_of_a_session_not_recovering_is_lost_for_good(clock):
    with pytest.raises(DeviceLost) as info:
        relocate(script(Seen("running", "w1", "lost", "h1")), 3, "h1", 60.0)
    assert (info.value.device, info.value.worker) == (3, "w1")
    assert isinstance(info.value, ClusterError)
    assert "logical device 3 was on worker w1, which was lost" in str(info.value)


def test_a_device_still_at_the_stale_address_is_retried_there_after_two_seconds(clock):
    assert relocate(script(Seen("running", "w1", "alive", "h1")), 0, "h1", 60.0) == "h1"
    assert 2.0 < clock.now < 2.2


def test_no_live_worker_by_the_deadline_is_a_one_line_error(clock):
    with pytest.raises(ClusterError, match="logical device 0 has no live worker \\(it was on h1\\)"):
        relocate(script(MOVING), 0, "h1", 5.0)
    assert clock.now == pytest.approx(5.0, abs=_relocate.POLL_S)


def test_seen_reads_the_device_its_worker_and_the_session_state_from_status():
    worker = m.WorkerStatus(worker="w2", address="h2", state="alive", device_type="cpu", memory_bytes=0, labels={},
                            tensors=0, bytes=0)
    session = m.SessionStatus(session="s", name="", priority="normal", state="running", devices={0: "w2"}, tensors=0)
    reply = m.StatusReply(workers=[worker], sessions=[session], events=[])
    assert seen(reply, "s", 0) == Seen("running", "w2", "alive", "h2") and seen(reply, "s", 0).live
    assert seen(reply, "s", 1) == Seen("running", None, None, None)
    assert seen(reply, "other", 0) == Seen(None, None, None, None)


def test_a_watch_cancels_its_call_once_the_device_moved_and_one_thread_looks_for_every_watch():
    moved, cancelled = threading.Event(), threading.Event()
    here, there = Seen("running", "w1", "alive", "a:1"), Seen("running", "w1", "alive", "b:2")
    looks: list[int] = []

    def look(device: int) -> Seen:
        looks.append(device)
        return there if moved.is_set() else here

    with _relocate.Watch(look, 3, "a:1", cancelled.set, every_s=0.01) as watch:
        assert wait_until(lambda: len(looks) >= 2)  # looked, and again: the device is still there
        assert not cancelled.is_set() and not watch.fired
        moved.set()
        assert cancelled.wait(10.0)
    assert watch.fired and set(looks) == {3}
    ended: list[str] = []
    gone = _relocate.Watch(lambda d: ended.append("look") or there, 1, "a:1", lambda: ended.append("cancel"),
                           every_s=0.01)
    with gone:
        pass  # the call ended before its first look was due
    later = threading.Event()
    with _relocate.Watch(lambda d: later.set() or here, 2, "a:1", lambda: None, every_s=0.02):
        assert later.wait(10.0)  # due after `gone`'s look: that one was dropped by then
    assert ended == [] and not gone.fired
    for _ in range(20):
        with _relocate.Watch(look, 3, "b:2", lambda: None):
            pass
    assert [t.name for t in threading.enumerate()].count("dtorch-watch") == 1


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_the_watcher_thread_is_woken_only_by_a_look_due_before_every_other(monkeypatch):
    """A transfer's Watch due after one the thread already waits for does not wake it (on a busy client each wake-up
    of another thread is a GIL handoff per transfer); one due sooner does, and every look still runs."""
    watcher = _relocate._Watcher("dtorch-watch-test")  # not the process's: its thread outlives the test
    wakes: list[int] = []

    class Counting(threading.Condition):
        def notify(self, n: int = 1) -> None:
            wakes.append(n)
            super().notify(n)

    watcher._cond = Counting()
    looked: list[int] = []
    done = threading.Event()

    def watch(device: int) -> _relocate.Watch:
        w = _relocate.Watch(lambda d: looked.append(d) or done.set() if d == 3 else looked.append(d), device,
                            "a:1", lambda: None, every_s=60.0)
        return w

    now = time.monotonic()
    watcher.at(now + 0.5, watch(1))  # the first: wakes the new thread
    watcher.at(now + 1.0, watch(2))  # later than the one waited for: no wake-up
    watcher.at(now + 0.05, watch(3))  # sooner: wakes it
    assert len(wakes) == 2
    assert done.wait(10.0) and looked[0] == 3
    assert wait_until(lambda: sorted(looked[:3]) == [1, 2, 3])


def test_ended_transfers_cost_the_watcher_no_look_of_their_own():
    """Entries of transfers that ended before they were due are dropped together, without a look (or a wake-up)
    each; a live transfer's look still comes when due."""
    watcher = _relocate._Watcher("dtorch-watch-test2")
    here = Seen("running", "w1", "alive", "a:1")
    checked: list[int] = []
    live_looked = threading.Event()

    class Counted(_relocate.Watch):
        def check(self) -> None:
            checked.append(self.device)
            super().check()

    now = time.monotonic()
    ended = [Counted(lambda d: here, d, "a:1", lambda: None, every_s=60.0) for d in (1, 2, 3)]
    for i, w in enumerate(ended):
        w.__exit__(None, None, None)  # the transfer ended before its look was due
        watcher.at(now + 0.05 + 0.01 * i, w)
    live = Counted(lambda d: live_looked.set() or here, 4, "a:1", lambda: None, every_s=60.0)
    watcher.at(now + 0.1, live)
    assert live_looked.wait(10.0)
    assert checked == [4]
