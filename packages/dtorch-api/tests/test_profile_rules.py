"""The profile's suggestion rules on built reports (`dtorch._profile_report`): which figures make a rule fire."""

from __future__ import annotations

from dtorch._profile_report import Report, WorkerTimes, suggestions


def report(*workers: WorkerTimes) -> Report:
    return Report(workers=list(workers), ops=[], moves=[], records={}, repeated=[], missing=[])


def rules(rep: Report) -> set[str]:
    return {s.rule for s in suggestions(rep)}


def test_a_worker_idle_while_another_works_is_an_imbalance():
    rep = report(WorkerTimes("a:1", window_s=1.0, compute_s=0.8), WorkerTimes("b:1", window_s=1.0, compute_s=0.1))
    (tip,) = [s for s in suggestions(rep) if s.rule == "imbalance"]
    assert "worker b:1 idle 90%" in tip.text


def test_two_near_idle_workers_are_no_imbalance_however_their_tiny_busy_times_compare():
    """Both wait for the client (a short step of small ops): 0.5 ms against 0.1 ms of a 50 ms window is 5x, and
    noise, not unbalanced work."""
    rep = report(WorkerTimes("a:1", window_s=0.05, compute_s=0.0005), WorkerTimes("b:1", window_s=0.05,
                                                                                  compute_s=0.0001))
    assert "imbalance" not in rules(rep)
    rep = report(WorkerTimes("a:1", window_s=0.05, compute_s=0.011), WorkerTimes("b:1", window_s=0.05,
                                                                                compute_s=0.002))
    assert "imbalance" in rules(rep)  # 22% busy against 4%: real work on one side
