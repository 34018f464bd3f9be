"""pool.py on its own: the counts behind fragmentation-aware packing (rule 7), exactly. (Named test_core_*: the
mutation session runs the controller's test_core_*.py files, and the one named for the module first.)"""

from __future__ import annotations

from dtorch_controller.core.pool import Pool


def _three_devices() -> Pool:
    p = Pool()
    for i in range(3):
        p.add(f"w{i}", f"n{i}", 1000, i)
    p.lease("w0", "a", 100)  # 900 left
    p.lease("w1", "b", 100)  # 900 left; w2 is free
    return p


def test_each_request_seen_counts_once_against_the_whole_device_prior():
    """Rule 7: demand is the count of requested devices per share, next to a prior of one whole-device request.
    A 300-byte lease on w0 leaves 600 (a 700-byte request no longer fits), on the free w2 it leaves 700 (one
    does; but w2 is no longer whole). Fragmentation = free bytes x (prior + requests too big) / (prior + all):
    with one 700-byte request seen, w0 strands 600*2/2 - 900*1/2 = 150 and w2 700*1/2 - 0 = 350: w0. With two
    seen, w0 strands 600*3/3 - 900*1/3 = 300 and w2 700*1/3 = 233: w2."""
    p = _three_devices()
    p.saw(700)
    assert p.pick_packed(1, 300) == ["w0"]
    p.saw(700)
    assert p.pick_packed(1, 300) == ["w2"]
    q = _three_devices()
    q.saw(700, devices=2)  # one request of two devices counts as two
    assert q.pick_packed(1, 300) == ["w2"]


def test_packed_leases_go_to_the_earlier_registered_of_equal_candidates():
    """Rule 7's last tie-break: equal stranding and equal room, registration order."""
    p = Pool()
    for i in range(3):
        p.add(f"w{i}", f"n{i}", 1000, i)
    p.lease("w2", "a", 500)
    p.lease("w1", "b", 500)
    p.lease("w0", "c", 500)
    assert p.pick_packed(1, 200) == ["w0"] and p.pick_packed(3, 200) == ["w0", "w1", "w2"]
