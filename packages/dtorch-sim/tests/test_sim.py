import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtorch_controller.core import events as ev
from dtorch_controller.core import state as st
from dtorch_controller.core.timers import Heartbeat
from dtorch_sim import metrics
from dtorch_sim.harness import Simulation
from dtorch_sim.jobs import generate
from dtorch_sim.scenario import load, parse

REPO = Path(__file__).resolve().parents[3]


def run(data: dict) -> Simulation:
    sim = Simulation(parse(data))
    sim.run_all()
    return sim


def _spy(sim: Simulation, record) -> None:
    """Every event the core handles also goes to `record(now, event, effects)`."""
    handle = sim.core.handle

    def spy(now, event):
        effects = handle(now, event)
        record(now, event, effects)
        return effects

    sim.core.handle = spy


def _run_fed(sim: Simulation, out: Path, effects: bool = False) -> list[str]:
    """Run `sim` to the end and write its outputs into `out`; every event the core handled, with its time (and the
    effects it made, with `effects`), as text."""
    fed: list[str] = []
    _spy(sim, lambda now, event, made: fed.append(f"{now!r} {event!r}" + (f" {made!r}" if effects else "")))
    sim.run_all()
    metrics.write(sim, out, plots=False)
    return fed


def _assert_same_outputs(a: Path, b: Path) -> None:
    for name in ("metrics.json", "jobs.csv", "utilization.csv", "failures.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_jobs_finish_and_utilization_is_plausible(base):
    sim = run(base)
    s = metrics.summarize(sim)
    assert s["jobs"] == {"submitted": 12, "finished": 12, "failed": 0, "unfinished": 0, "restarts": 0}
    total_work = sum(j.duration * j.devices for j in sim.specs)
    assert 0.9 * total_work <= sum(w.busy_s for w in sim.all_workers) <= 1.1 * total_work
    for r in sim.jobs:
        assert r.finished - r.spec.arrival >= 0.99 * r.spec.duration  # no job beats its own work
    u = s["utilization"]
    assert 0 < u["busy_mean"] <= u["allocated_mean"] <= 1
    assert s["makespan_s"] > 0 and s["jct_s"]["p50"] <= s["jct_s"]["p99"]
    assert not sim.core.sessions  # every session closed


def test_a_run_where_no_job_finished_has_no_makespan(base):
    """It was 0 - the first arrival: a negative makespan in metrics.json and the summary."""
    base["duration_s"] = 10.0  # the first jobs arrive, none of 30 s or so ends
    s = metrics.summarize(run(base))
    assert s["jobs"]["finished"] == 0 and s["jobs"]["submitted"] == 12
    assert s["makespan_s"] is None


def test_a_fake_worker_keeps_nothing_of_what_was_deleted_or_closed(base):
    # Namespaces of copies come and go all the time: a key whose shards are gone is forgotten, or every report and
    # swap walks it again (a 100,000-job run slowed down as workers gathered hundreds of empty keys).
    base["workload"]["synthetic"]["jobs"] = 40
    base["policy"] = {"name": "dtorch"}  # preemption: frozen sessions' state and copies move about
    sim = run(base)
    assert sim.jobs_done == 40 and not sim.core.sessions
    assert [(w.id, w.store, w.totals) for w in sim.all_workers if w.store or w.totals] == []
    assert all(w._shards() == {} for w in sim.all_workers)


def test_same_seed_same_bytes(base, tmp_path):
    base["faults"] = [{"kind": "worker_failure", "mtbf_s": 60}]
    a = metrics.write(run(base), tmp_path / "a", plots=False)
    b = metrics.write(run(base), tmp_path / "b", plots=False)
    assert a == b
    for name in ("metrics.json", "jobs.csv", "utilization.csv", "failures.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    base["seed"] = 6
    assert metrics.write(run(base), tmp_path / "c", plots=False) != a


def test_failures_are_detected_within_the_heartbeat_timeout(base):
    base["faults"] = [{"kind": "worker_failure", "at": 10, "worker": "node0/gpu1"},
                      {"kind": "node_failure", "at": 20, "node": "node1", "mode": "crash"}]
    sim = run(base)
    assert [f.worker for f in sim.failures] == ["node0/gpu1"] + [f"node1/gpu{d}" for d in range(4)]
    for f in sim.failures:
        assert f.detected is not None and 0 < f.detected - f.at <= 4.0 + 1e-9
    lost = [w for w in sim.core.workers.values() if w.state == st.LOST]
    assert len(lost) == 5
    s = metrics.summarize(sim)
    assert s["failures"]["injected"] == s["failures"]["detected"] == 5
    assert s["jobs"]["finished"] == 12 and s["jobs"]["restarts"] >= 1  # restarted on the survivors


def test_only_a_stopped_workers_heartbeat_deadlines_reach_the_core_and_it_is_detected_on_the_slot_grid(base):
    # A running worker's heartbeat deadline can only re-arm: the harness holds it back (no core event) until the
    # worker stops or is cut off. The silent failure is still detected at its last report + the timeout, on the
    # heartbeat slot grid, as when every deadline fired.
    base["faults"] = [{"kind": "worker_failure", "at": 10, "worker": "node0/gpu1"}]
    sim = Simulation(parse(base))
    fired: list[tuple[float, Heartbeat]] = []
    _spy(sim, lambda now, event, _effects: fired.append((now, event.key))
         if isinstance(event, ev.TimerFired) and type(event.key) is Heartbeat else None)
    sim.run_all()
    failed = sim.by_address["node0/gpu1"]
    assert fired and {key.worker for _now, key in fired} == {failed.id}
    assert min(now for now, _key in fired) >= 10.0  # nothing before it stopped
    (f,) = sim.failures
    assert f.detected == pytest.approx(sim.slot_after(failed.last_report + 4.0), abs=1e-9)
    assert sim.jobs_done == 12


def test_idle_workers_beat_through_their_slot_roster_with_no_call_each_and_the_core_hears_the_same(base):
    # An idle worker with nothing new joins the roster of its slot phase, which adds its entry to each interval's
    # WorkersAlive: the core gets the same (time, worker, utilization) entries as from a call per worker and beat.
    base["cluster"]["nodes"][0]["count"] = 8  # 32 devices for 12 jobs of 1-4: most idle most of the time

    def run(roster: bool) -> tuple[list, int, float]:
        sim = Simulation(parse(base))
        if not roster:
            sim.quiet = lambda worker, due: False  # every beat a call of the worker's own
        heard: list[tuple[float, str, float]] = []
        later, calls = sim.later, [0]
        _spy(sim, lambda now, event, _effects: heard.extend((round(now, 9), w, u) for w, u in event.workers.items())
             if isinstance(event, ev.WorkersAlive) else None)

        def count(at, fn, arg):
            calls[0] += fn.__name__ == "_beat"  # a worker's own beat
            later(at, fn, arg)

        sim.later = count
        sim.run_all()
        return sorted(heard), calls[0], metrics.summarize(sim)["jct_s"]["mean"]

    heard, calls, jct = run(roster=True)
    heard_each, calls_each, jct_each = run(roster=False)
    assert len(heard) > 1000 and heard == heard_each and jct == jct_each
    assert calls < calls_each / 2, (calls, calls_each)  # the rest: beats in steps longer than the interval


def test_the_workers_of_a_step_end_in_one_simpy_event_and_the_core_sees_what_it_saw_with_one_each(base, tmp_path):
    # The batch ends of a step's workers, due at one instant and timed one right after the other, share one simpy
    # event (Simulation.at_end): the core gets the same events in the same order, and every output is the same, as
    # with a timeout of their own each (preemption, a failure and its detection included).
    base["workload"]["synthetic"]["jobs"] = 30
    base["policy"] = {"name": "dtorch"}
    base["faults"] = [{"kind": "worker_failure", "mtbf_s": 40}]

    def run(merged: bool, out: Path) -> tuple[list[str], int]:
        sim = Simulation(parse(base))
        if not merged:  # a simpy timeout of its own for each, made where the merged call is
            sim.at_end = lambda delay, fn, arg: sim.env.timeout(delay).callbacks.append(lambda _e: fn(arg))
        return _run_fed(sim, out), sim.merged

    fed, merged = run(True, tmp_path / "merged")
    fed_each, merged_each = run(False, tmp_path / "each")
    assert merged > 100 and merged_each == 0
    assert len(fed) > 1000 and fed == fed_each
    _assert_same_outputs(tmp_path / "merged", tmp_path / "each")
    summary = json.loads((tmp_path / "merged" / "metrics.json").read_text())
    assert summary["scheduling"]["preemptions"] > 0  # and failures (a header and more lines):
    assert len((tmp_path / "merged" / "failures.csv").read_text().splitlines()) > 1


def test_a_jobs_answers_at_once_resume_it_with_no_simpy_event_only_where_nothing_else_runs_first(base, tmp_path):
    # A request the core answers at once resumes its job at once (Simulation.ask) only where the event that would
    # have resumed it would have run next: jobs in lockstep (pairs with the same arrival, duration and size, as in a
    # sweep) and a closing session's batches, due at once, keep their order. The core gets the same events in the
    # same order, and every output is the same, as with an event each (a failure and its detection included).
    jobs = [(t * 7.0, 20.0 + t, size) for t in range(8) for size in (1, 2, 2)]
    (tmp_path / "trace.csv").write_text("submit,duration,gpus\n" + "".join(f"{a},{d},{g}\n" for a, d, g in jobs))
    base["workload"] = {"trace": {"format": "csv", "path": str(tmp_path / "trace.csv"),
                                  "columns": {"submit": "submit", "duration": "duration", "num_gpu": "gpus"}},
                        "steps_per_job": 6, "sync_every": 2}
    base["policy"] = {"name": "dtorch"}
    base["faults"] = [{"kind": "worker_failure", "at": 30}]

    def run(at_once: bool, out: Path) -> tuple[list[str], int]:
        sim = Simulation(parse(base))
        if not at_once:  # the event of its own that `request` gives, for every request

            def ask(make):
                return (yield sim.request(make))

            sim.ask = ask
        return _run_fed(sim, out), sim.answered

    fed, answered = run(True, tmp_path / "at-once")
    fed_each, answered_each = run(False, tmp_path / "each")
    assert answered > 50 and answered_each == 0
    assert len(fed) > 500 and fed == fed_each
    _assert_same_outputs(tmp_path / "at-once", tmp_path / "each")
    assert json.loads((tmp_path / "at-once" / "metrics.json").read_text())["jobs"]["finished"] == len(jobs)


@pytest.mark.parametrize("recovery", [False, True])
def test_the_core_skips_its_look_at_a_session_whose_window_is_still_full_and_decides_the_same(base, tmp_path,
                                                                                           recovery):
    # A wide session's completions but the last of a step pump it and find the window full on another worker: the
    # settle pass looks at it only where a look could change something (ControllerCore._inert). The core makes the
    # same effects from the same events, and every output is the same, as with a look each time: through
    # preemption, relocation, failures and (with recovery) snapshots due by time and rebuilds.
    base["workload"]["synthetic"]["jobs"] = 30
    base["workload"]["synthetic"]["size"] = {"choices": [2, 4, 8]}
    base["policy"] = {"name": "dtorch"}
    base["faults"] = [{"kind": "worker_failure", "mtbf_s": 40}]
    if recovery:
        base["recovery"] = {"snapshot_every_batches": 3, "snapshot_every_s": 5.0}

    def run(skip: bool, out: Path) -> tuple[list[str], int]:
        sim = Simulation(parse(base))
        core = sim.core
        inert, skipped = core._inert, [0]

        def counted(sid: str) -> bool:
            found = skip and inert(sid)
            skipped[0] += found
            return found

        core._inert = counted
        return _run_fed(sim, out, effects=True), skipped[0]

    fed, skipped = run(True, tmp_path / "skip")
    fed_each, skipped_each = run(False, tmp_path / "each")
    assert skipped_each == 0 and (skipped == 0 if recovery else skipped > 100)
    assert len(fed) > 1000 and fed == fed_each
    _assert_same_outputs(tmp_path / "skip", tmp_path / "each")
    summary = json.loads((tmp_path / "skip" / "metrics.json").read_text())
    assert summary["scheduling"]["preemptions"] > 0 and summary["scheduling"]["relocations"] > 0
    assert len((tmp_path / "skip" / "failures.csv").read_text().splitlines()) > 1


def test_heartbeats_with_nothing_new_reach_the_core_as_one_event_per_slot_and_a_fenced_worker_stops(base):
    # A heartbeat with nothing new is no Report of its own: the slot's beats go as one WorkersAlive, fed before any
    # other event. A worker the core declared lost while it runs learns it from that event's answer and stops, as
    # from the "fenced" answer to its report.
    sim = Simulation(parse(base))
    fed: list[tuple[float, object]] = []
    _spy(sim, lambda now, event, _effects: fed.append((now, event)))
    cut: list = []

    def cut_off(_event) -> None:  # the core loses an idle worker that still runs (as if a send to it had failed)
        w = next(w for w in sim.all_workers if w.alive and w.current is None and not w.pending and not w.errors
                 and w.completed == w._told[0])
        cut.append((w, sim.env.now))
        sim.handle(ev.WorkerUnreachable(w.id, w.address, "test"))

    sim.env.timeout(20.5).callbacks.append(cut_off)
    sim.run_all()
    alive = [e for _now, e in fed if isinstance(e, ev.WorkersAlive)]
    assert alive and sum(len(e.workers) for e in alive) > 1.5 * len(alive)  # 8 workers, 64 slots an interval
    assert not any(isinstance(a, ev.WorkersAlive) and isinstance(b, ev.WorkersAlive) and t == u
                   for (t, a), (u, b) in zip(fed, fed[1:]))  # two at one time have another event between them
    (w, at), = cut
    assert not w.alive and sim.fenced_workers == 1 and at < w.last_report <= at + 1.0 + sim.slot_after(0.01)
    assert any(isinstance(e, ev.WorkersAlive) and w.id in e.workers for now, e in fed if now > at)
    assert sim.jobs_done == 12


def test_jobs_can_give_up_on_failure(base):
    base["faults"] = [{"kind": "node_failure", "at": 5, "node": "node0"}]
    base["workload"]["on_failure"] = "fail"
    s = metrics.summarize(run(base))
    assert s["jobs"]["failed"] >= 1 and s["jobs"]["finished"] + s["jobs"]["failed"] == 12


def test_a_node_added_later_gets_used(base):
    base["cluster"]["nodes"][0]["count"] = 1
    base["elastic"] = [{"at": 15, "action": "add_nodes",
                        "add": {"count": 1, "devices_per_node": 4, "device_type": "slow", "name": "late"}},
                       {"at": 40, "action": "remove_nodes", "nodes": ["node0"]}]
    sim = run(base)
    late = sim.nodes["late1"]
    assert all(w.id is not None for w in late)
    assert sum(w.busy_s for w in late) > 0
    assert min(s.t for s in sim.samples if s.alive == 8) >= 15
    assert all(f.kind == "remove_nodes" and f.detected is not None for f in sim.failures)
    assert metrics.summarize(sim)["jobs"]["finished"] == 12


def test_slow_worker_takes_longer(base):
    base["workload"]["synthetic"]["jobs"] = 1
    base["workload"]["synthetic"]["size"] = {"choices": [1]}
    fast = run(base)
    base["faults"] = [{"kind": "slow_worker", "at": 0, "worker": "node0/gpu0", "factor": 0.5}]
    slow = run(base)
    jct = [r.finished - r.spec.arrival for sim in (fast, slow) for r in sim.jobs]
    assert 1.9 * jct[0] < jct[1] < 2.1 * jct[0]


def test_traces_load():
    itp = load(REPO / "scenarios" / "itp-cluster04.yaml")
    jobs = generate(itp)
    assert len(jobs) == 2000 and jobs[0].arrival == 0 and all(j.devices >= 1 for j in jobs)
    assert {j.devices for j in jobs} == {1, 4, 8, 16, 32}
    openb = generate(load(REPO / "scenarios" / "openb.yaml"))
    assert len(openb) > 6000 and all(1 <= j.devices <= 8 for j in openb)
    assert any(j.share < 1 for j in openb) and {j.priority for j in openb} == {"high", "normal", "low"}


def test_cli_run_and_compare(base, tmp_path):
    import yaml

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(base))
    out = subprocess.run([sys.executable, "-m", "dtorch_sim", "run", str(path), "--out", str(tmp_path / "o"),
                          "--quiet"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "jobs finished" in out.stdout and "12/12" in out.stdout
    assert json.loads((tmp_path / "o" / "metrics.json").read_text())["jobs"]["finished"] == 12
    bad = subprocess.run([sys.executable, "-m", "dtorch_sim", "compare", str(path), "--policies", "fifo,srtf",
                          "--out", str(tmp_path / "cmp")], capture_output=True, text=True)
    *warned, refusal = bad.stderr.strip().splitlines()  # (the base declares a type no node has: a warning)
    assert bad.returncode == 1 and all(w.startswith("warning: ") for w in warned)
    assert refusal == "--policies: unknown policy 'srtf': known policies are dtorch, fifo, las, priority"
    both = subprocess.run([sys.executable, "-m", "dtorch_sim", "compare", str(path), "--policies", "fifo,priority,las",
                           "--out", str(tmp_path / "cmp")], capture_output=True, text=True)
    assert both.returncode == 0, both.stderr
    for name in ("fifo", "priority", "las"):
        assert json.loads((tmp_path / "cmp" / name / "metrics.json").read_text())["jobs"]["finished"] == 12
    row = next(ln for ln in both.stdout.splitlines() if "JCT mean / p50 / p99 (s)" in ln)
    assert row.count(" / ") == 2 * 3 + 2  # piped: one line with the metric and the three policies' cells
    for name in ("jct_cdf.png", "utilization.png"):  # the policies overlaid
        assert (tmp_path / "cmp" / name).stat().st_size > 10_000


def test_priority_classes_are_drawn_per_job_and_high_ones_wait_less_under_preemption(base):
    base["workload"]["synthetic"]["jobs"] = 30
    base["workload"]["synthetic"]["arrival"]["rate_per_s"] = 1.0
    base["workload"]["priorities"] = {"high": 1, "low": 3}
    base["workload"]["retry_s"] = 1.0
    base["policy"] = {"name": "priority"}
    sim = run(base)
    s = metrics.summarize(sim)
    assert s["jobs"]["finished"] == 30
    by = s["jct_s_by_priority"]
    assert set(by) == {"high", "low"} and by["high"]["mean"] < by["low"]["mean"]
    assert any("frozen on" in line for line in sim.core.log.lines())


def test_a_fake_worker_finds_an_ops_first_input_as_the_protocol_lists_tensor_slots():
    """The fake worker prices an op by its first input without listing every tensor slot of its arguments: the id
    it finds is `tensor_refs(args)[0]` (None when there is none) for any nesting of dicts, lists and tuples,
    slots holding None included."""
    import random

    from dtorch_protocol import messages as m
    from dtorch_sim.workers import _first_ref

    rng = random.Random(1)

    def args(depth=0):
        x = rng.random()
        if depth > 3 or x < 0.3:
            return rng.choice([1, "a", None, m.tensor_slot(rng.choice([3, 7])), {m.TENSOR_SLOT: None}])
        if x < 0.6:
            return [args(depth + 1) for _ in range(rng.randrange(4))]
        if x < 0.8:
            return tuple(args(depth + 1) for _ in range(rng.randrange(3)))
        return {str(i): args(depth + 1) for i in range(rng.randrange(3))}

    for _ in range(5000):
        value = args()
        refs = m.tensor_refs(value)
        assert _first_ref(value) == (refs[0] if refs else None), value
