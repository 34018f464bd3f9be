"""Relocation (`_relocate`): the decision table of `relocate` on a fake clock, and `seen` reading Status."""

from __future__ import annotations

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
