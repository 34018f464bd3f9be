"""A run always ends: every accepted setting is handled, and a clock that stops advancing is an error, not a hang."""

import gc

import pytest

from dtorch_sim import metrics
from dtorch_sim.harness import GC_THRESHOLD, Simulation, Stalled
from dtorch_sim.scenario import parse


def test_hour_long_heartbeats_with_default_slots_finish(base):
    # interval / 64 slots = 56.25 s: a report due a hair past a slot boundary was re-armed for the same instant
    # forever (the slot rounding allowed 1e-9 slot, the due check 1e-9 s)
    base["heartbeat"] = {"interval_s": 3600, "timeout_s": 7200}
    sim = Simulation(parse(base))
    sim.stall_events = 200_000
    sim.quiet = lambda worker, due: False  # every beat the worker's own: its re-arming is what looped
    w = sim.all_workers[0]
    if w.quiet is not None:
        sim.wake(w)
    w.last_report = 3e-8 - w.interval  # its next heartbeat is due 30 ns after the first slot (t=0)
    w.beat_armed = False
    w._arm(0.0)
    sim.run_all()
    assert metrics.summarize(sim)["jobs"]["finished"] == 12


def test_a_clock_that_stops_advancing_raises_instead_of_hanging(base):
    sim = Simulation(parse(base))
    sim.stall_events = 200_000

    def spin(env):
        yield env.timeout(5)
        while True:
            yield env.timeout(0)

    sim.env.process(spin(sim.env))
    with pytest.raises(Stalled, match=r"stopped making progress at t=5\.000000s: .* without the simulated clock"):
        sim.run_all()


def test_while_a_run_goes_on_the_garbage_collector_runs_rarely_and_skips_the_setup_then_as_before(base):
    # A run's objects live long and make few cycles: the default thresholds spent a third of a 10,000-device run
    # collecting (benchmarks/bench_sim_trace.py). Once the run ends, or is abandoned, the process is as it was.
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    during: list[tuple] = []

    def look(_event) -> None:
        during.append((gc.get_threshold(), gc.get_freeze_count()))

    sim = Simulation(parse(base))
    sim.env.timeout(5).callbacks.append(look)
    sim.run_all()
    (during_threshold, during_frozen), = during
    assert during_threshold == GC_THRESHOLD != threshold and during_frozen > frozen + 1000
    assert (gc.get_threshold(), gc.get_freeze_count()) == (threshold, frozen)
    assert metrics.summarize(sim)["jobs"]["finished"] == 12
    abandoned = Simulation(parse(base)).run()
    next(abandoned)
    assert gc.get_threshold() == GC_THRESHOLD
    del abandoned  # closed: its `finally` runs
    assert (gc.get_threshold(), gc.get_freeze_count()) == (threshold, frozen)
