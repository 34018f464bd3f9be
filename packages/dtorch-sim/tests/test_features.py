"""One small scenario per simulator feature, with the outcome asserted (each runs in well under a second)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dtorch_sim import metrics
from dtorch_sim.harness import Simulation
from dtorch_sim.jobs import generate, node_groups
from dtorch_sim.scenario import parse

TRACES = Path(__file__).resolve().parents[3] / "scenarios" / "traces"


def run(data: dict) -> tuple[Simulation, dict]:
    sim = Simulation(parse(data))
    sim.run_all()
    return sim, metrics.summarize(sim)


def one_job(base: dict, size=1, duration=60.0) -> dict:
    base["workload"]["synthetic"].update(jobs=1, size={"choices": [size]},
                                         duration={"dist": "constant", "value": duration})
    return base


def test_failure_detected_job_restarts_from_its_last_sync_and_lost_work_is_counted(base):
    one_job(base, size=2, duration=60)
    base["workload"].update(steps_per_job=6, sync_every=2)
    base["faults"] = [{"kind": "worker_failure", "at": 25, "worker": "node0/gpu0", "mode": "silent"}]
    sim, s = run(base)
    (f,) = s["failures"]["events"]
    assert f["jobs_hit"] == 1 and 0 < f["detection_s"] <= 4.0 + 1e-9
    assert f["recovery_s"] >= f["detection_s"]  # the job runs again after the core noticed, not before
    assert s["jobs"] == {"submitted": 1, "finished": 1, "failed": 0, "unfinished": 0, "restarts": 1}
    # steps are 10 s on each of 2 devices, synced every 2. At t=25 steps 1-2 were synced and step 3 ran: the dead
    # device's part of it was cut short; the live device ran steps 3 and 4 (already sent) for nothing. The job
    # restarts from its last Sync: steps 3-4 run again, steps 1-2 do not.
    a = sim.jobs[0].spec.arrival
    lost = s["failures"]
    assert lost["redone_device_s"] == pytest.approx(2 * 10.0 + (25 - (a + 20)), abs=1e-6)
    assert lost["stalled_device_s"] > 0 and lost["device_s_lost"] == pytest.approx(
        lost["redone_device_s"] + lost["stalled_device_s"])
    (job,) = sim.jobs
    assert job.finished - job.spec.arrival > 60 + f["detection_s"]


def test_core_recovery_replays_since_the_snapshot_instead_of_restarting(base):
    one_job(base, size=2, duration=60)
    base["workload"].update(steps_per_job=6, sync_every=6)
    base["recovery"] = {"snapshot_every_batches": 2}
    base["faults"] = [{"kind": "worker_failure", "at": 35, "worker": "node0/gpu1", "mode": "crash"}]
    sim, s = run(base)
    assert s["jobs"]["finished"] == 1 and s["jobs"]["restarts"] == 0
    assert s["scheduling"]["recoveries"] == 1 and sim.jobs[0].recoveries == 1
    # all 6 steps (10 s each) were sent at once, with snapshots after batches 2, 4 and 6 in the workers' streams;
    # at t=35 only the one after batch 2 was complete: the core rebuilt the lost device on a free worker and
    # replayed batches 3-6 on both devices
    (f,) = s["failures"]["events"]
    assert f["detection_s"] < f["recovery_s"] < f["detection_s"] + 10 + 4 * 10 + 1
    assert s["failures"]["redone_device_s"] > 10  # the work after the snapshot ran again
    assert any("recovered in" in line for line in sim.core.log.lines())


def test_elastic_node_added_is_used_and_a_drained_node_moves_its_jobs(base):
    base["cluster"]["nodes"][0]["count"] = 1
    base["workload"]["synthetic"].update(jobs=6, arrival={"rate_per_s": 1.0}, size={"choices": [2]},
                                         duration={"dist": "constant", "value": 60})
    base["workload"]["state_gb"] = 4.0
    base["elastic"] = [{"at": 5, "action": "add_nodes",
                        "add": {"count": 1, "devices_per_node": 4, "device_type": "a100", "name": "late"}},
                       {"at": 20, "action": "remove_nodes", "nodes": ["node0"], "mode": "drain"}]
    sim, s = run(base)
    assert s["jobs"]["finished"] == 6 and s["jobs"]["restarts"] == 0 and s["failures"]["injected"] == 0
    assert sum(w.busy_s for w in sim.nodes["late1"]) > 0
    sc = s["scheduling"]
    assert sc["migrations"] >= 1 and sc["migrated_bytes"] >= 4 * 2**30  # a device's state moved whole
    assert all(not w.alive for w in sim.nodes["node0"])


def test_preemption_freezes_low_priority_work_without_losing_it(base):
    base["cluster"]["nodes"][0]["count"] = 1
    base["workload"]["synthetic"].update(jobs=10, arrival={"rate_per_s": 0.5}, size={"choices": [4]},
                                         duration={"dist": "constant", "value": 40})
    base["workload"]["priorities"] = {"high": 1, "low": 1}
    base["policy"] = {"name": "priority"}  # classes only (dtorch also preempts within a class)
    sim, s = run(base)
    assert s["jobs"]["finished"] == 10
    assert s["scheduling"]["preemptions"] >= 1 and s["scheduling"]["resumes"] >= 1
    assert any(r.preemptions for r in sim.jobs if r.spec.priority == "low")
    assert not any(r.preemptions for r in sim.jobs if r.spec.priority == "high")
    assert s["failures"]["redone_device_s"] == 0 and s["jobs"]["restarts"] == 0  # frozen work is kept
    by = s["jct_s_by_priority"]
    assert by["high"]["mean"] < by["low"]["mean"]
    _, fifo = run({**base, "policy": {"name": "fifo"}})
    assert fifo["scheduling"]["preemptions"] == 0


def test_packing_shares_devices_between_fractional_jobs(base):
    base["cluster"]["nodes"][0]["count"] = 1
    base["workload"]["synthetic"].update(jobs=8, arrival={"rate_per_s": 100.0}, size={"choices": [0.5]},
                                         duration={"dist": "constant", "value": 100})
    base["workload"].update(steps_per_job=4)
    base["policy"] = {"name": "dtorch"}
    packed, p = run(base)
    _, fifo = run({**base, "policy": {"name": "fifo"}})
    assert p["jobs"]["finished"] == fifo["jobs"]["finished"] == 8
    # 4 devices: packed, all 8 half-device jobs run at once, two per device; FIFO gives each a whole device
    assert p["queueing_delay_s"]["max"] < 1.0 < fifo["queueing_delay_s"]["max"]
    assert p["makespan_s"] < 0.8 * fifo["makespan_s"]
    assert p["utilization"]["unallocated_share_when_queued"] is None or \
        p["utilization"]["unallocated_share_when_queued"] <= fifo["utilization"]["unallocated_share_when_queued"]
    assert fifo["utilization"]["requested_share_mean"] < fifo["utilization"]["allocated_mean"]  # half of each idle
    assert not list(packed.core.view.leases())  # everything released at the end


def test_partition_is_detected_and_the_fenced_worker_comes_back(base):
    one_job(base, size=1, duration=30)
    base["faults"] = [{"kind": "partition", "at": 5, "worker": "node0/gpu0", "duration_s": 10, "repair_s": 1}]
    sim, s = run(base)
    (f,) = s["failures"]["events"]
    assert f["kind"] == "partition" and f["detection_s"] <= 4.0 + 1e-9
    assert s["failures"]["workers_fenced"] == 1  # its first report after the heal was refused
    back = sim.by_address["node0/gpu0"]
    assert back.alive and back.id is not None and back.id != sim.all_workers[0].id  # registered anew
    assert s["jobs"]["finished"] == 1


def test_short_partition_heals_before_detection(base):
    one_job(base, size=1, duration=30)
    base["faults"] = [{"kind": "partition", "at": 5, "worker": "node1/gpu3", "duration_s": 1.5}]
    sim, s = run(base)
    (f,) = s["failures"]["events"]
    assert f["detected_at"] is None and f["recovery_s"] == pytest.approx(1.5)
    assert s["failures"]["workers_fenced"] == 0 and sim.by_address["node1/gpu3"].alive


def test_autoscaler_adds_nodes_while_jobs_wait_and_drains_them_when_idle(base):
    base["cluster"]["nodes"][0]["count"] = 1
    base["workload"]["synthetic"].update(jobs=8, arrival={"rate_per_s": 2.0}, size={"choices": [4]},
                                         duration={"dist": "constant", "value": 30})
    base["autoscaler"] = {"node": {"count": 1, "devices_per_node": 4, "device_type": "a100", "name": "auto"},
                          "check_interval_s": 5, "provision_s": 10, "max_nodes": 2, "scale_down_idle_s": 20}
    base["duration_s"] = 400
    sim, s = run(base)
    auto = [n for n in sim.nodes if n.startswith("auto")]
    assert len(auto) == 2 and s["jobs"]["finished"] == 8
    assert all(sum(w.busy_s for w in sim.nodes[n]) > 0 for n in auto)
    assert s["makespan_s"] < 8 * 30  # faster than one node alone


def _same_bytes_across_processes(data: dict, tmp_path: Path) -> Path:
    """Run `data` in two processes with different hash seeds (no set or dict order may leak into the results);
    returns the first run's output folder once every output is the same to the byte."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"o{seed}"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-m", "dtorch_sim", "run", str(path), "--out", str(out), "--quiet",
                               "--no-plots"], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        outs.append(out)
    for name in ("metrics.json", "jobs.csv", "utilization.csv", "failures.csv"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    return outs[0]


def test_same_scenario_same_bytes_across_processes(base, tmp_path):
    base["faults"] = [{"kind": "node_failure", "mtbf_s": 40, "repair_s": 5}]
    base["policy"] = {"name": "las", "params": {"thresholds": [30, 120]}}
    out = _same_bytes_across_processes(base, tmp_path)
    assert json.loads((out / "metrics.json").read_text())["failures"]["injected"] > 0


def test_the_dtorch_policy_under_overload_gives_the_same_bytes_across_processes(tmp_path):
    # ITP cluster04's first 2,000 jobs on 128 GPUs, as the speed bench runs them: frozen sessions take back their
    # own devices as they free, across nodes. They took them in the order of a set of worker ids, which follows
    # the string hash: the pool's order, and so later placements, changed from process to process.
    rows = (TRACES / "msft-itp-cluster04.csv").read_text().splitlines()[:2001]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    data = {"seed": 1,
            "cluster": {"device_types": {"v100": {"memory_gb": 32}},
                        "nodes": [{"count": 16, "devices_per_node": 8, "device_type": "v100"}]},
            "workload": {"trace": {"format": "csv", "path": str(tmp_path / "t.csv"), "time_scale": 0.01,
                                   "arrival_scale": 0.04, "columns": {"submit": "submission_time",
                                                                      "duration": "duration", "num_gpu": "num_gpu"}},
                         "step_s": 30, "max_steps": 20, "sync_every": 5},
            "policy": {"name": "dtorch"},
            "heartbeat": {"interval_s": 60.0, "timeout_s": 180.0}}
    out = _same_bytes_across_processes(data, tmp_path)
    assert json.loads((out / "metrics.json").read_text())["scheduling"]["relocations"] > 100


def test_openb_trace_shares_and_node_list(tmp_path):
    pods = tmp_path / "pods.csv"
    pods.write_text("name,num_gpu,gpu_milli,qos,creation_time,scheduled_time,deletion_time\n"
                    "a,1,500,LS,0,10,110\nb,0,0,BE,5,5,50\nc,2,1000,BE,20,,300\nd,1,250,BE,30,30,90\n")
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,gpu,model\nn0,8,V100\nn1,8,V100\nn2,0,CPU\nn3,4,T4\n")
    data = {"cluster": {"device_types": {"V100": {}, "T4": {"speed": 0.5}},
                        "node_list": {"path": str(nodes)}},
            "workload": {"trace": {"format": "openb", "path": str(pods), "fractional": "share"}}}
    sc = parse(data)
    assert [(g.count, g.devices_per_node, g.device_type) for g in node_groups(sc)] == [(2, 8, "V100"), (1, 4, "T4")]
    jobs = generate(sc)  # b: no GPU (skipped); c: never scheduled (skipped)
    assert [(j.id, j.devices, j.share, j.priority, j.duration) for j in jobs] == [
        ("a", 1, 0.5, "high", 100.0), ("d", 1, 0.25, "low", 60.0)]


def jobs_trace(base: dict, tmp_path, rows: str, **trace) -> dict:
    """A hand-written trace: `id,t,n,d,p` rows (submit, devices, duration, priority)."""
    path = tmp_path / "jobs.csv"
    path.write_text("id,t,n,d,p\n" + rows)
    base["workload"] = {"trace": {"format": "csv", "path": str(path), "priority_map": {"high": "high", "low": "low"},
                                  "columns": {"job_id": "id", "submit": "t", "num_gpu": "n", "duration": "d",
                                              "priority": "p"}, **trace},
                        "steps_per_job": 10, "sync_every": 1}
    base["cluster"]["nodes"] = [{"count": 1, "devices_per_node": 4, "device_type": "a100"}]
    return base


def test_time_frozen_is_reported_per_job_and_freezing_costs_an_offload(base, tmp_path):
    # a: 4 devices for 100 s in 10 s steps, frozen at t=15 by b; b's 50 s run after a's step in flight (20-70),
    # but first each device offloads a's 2 GB to host memory, and a loads it back when it resumes
    jobs_trace(base, tmp_path, "a,0,4,100,low\nb,15,4,50,high\n")
    base["policy"] = {"name": "priority"}
    sim, s = run(base)
    swap = 2 * 2**30 * 8 / 200e9  # state_gb at host_gbps
    a = next(r for r in sim.jobs if r.spec.id == "a")
    assert a.preemptions == 1 and a.frozen_s == pytest.approx(55 + swap)
    assert a.finished - a.spec.arrival == pytest.approx(150 + 2 * swap)
    assert s["scheduling"]["offloaded_bytes"] == 2 * 4 * 2 * 2**30  # out and back in, on each of 4 devices
    assert s["queueing_delay_s"]["max"] < 1  # nobody queued: the frozen time is only visible here
    assert s["frozen_s"]["max"] == pytest.approx(55 + swap) and s["frozen_s"]["p50"] == 0
    assert s["frozen_share_of_jct"]["max"] == pytest.approx(55 / 150, rel=1e-2)  # its JCT: 100 s + b's 50 s
    # the floor: their JCTs had neither waited nor stopped, their durations (a mean JCT is never below its mean)
    assert (s["jct_floor_s"]["mean"], s["jct_floor_s"]["max"]) == (75, 100) and s["jct_s"]["mean"] > 75
    metrics.write(sim, tmp_path / "out", plots=False)
    header, *rows = (tmp_path / "out" / "jobs.csv").read_text().splitlines()
    frozen = dict((r.split(",")[0], float(r.split(",")[header.split(",").index("frozen_s")])) for r in rows)
    assert frozen["b"] == 0 and frozen["a"] == pytest.approx(55 + swap)


@pytest.mark.parametrize("ahead, starts", [(0, 50.0), (1, 20.0)])
def test_a_dispatch_window_lets_a_preemptor_start_after_one_step_of_its_victim(base, tmp_path, ahead, starts):
    # a: 10 steps of 10 s on 4 devices, a sync point every 5 steps, so at t=15 it has sent steps 1-5 (0-50 s); b
    # preempts it then. A freeze holds only what was not sent: without a window b waits for all five, with
    # `controller.dispatch_ahead: 1` only for the step running (pipeline rule 7)
    jobs_trace(base, tmp_path, "a,0,4,100,low\nb,15,4,50,high\n")
    base["workload"]["sync_every"] = 5
    base["policy"] = {"name": "priority"}
    base["controller"] = {"dispatch_ahead": ahead}
    sim, s = run(base)
    b = next(r for r in sim.jobs if r.spec.id == "b")
    a = next(r for r in sim.jobs if r.spec.id == "a")
    swap = 2 * 2**30 * 8 / 200e9  # a's state offloaded to host memory first
    assert b.finished == pytest.approx(starts + swap + 50) and a.preemptions == 1
    assert a.finished - a.spec.arrival == pytest.approx(150 + 2 * swap)  # a loses nothing either way


def test_amdahl_scaling_a_job_on_fewer_devices_than_it_asked_for(base, tmp_path):
    # 8 logical devices on the 4 devices of the cluster: with p = 0.9, 100 s on 8 devices is T1 = 100 / (0.1 +
    # 0.9 / 8) on one, and 4 workers take T1 * (0.1 + 0.9 / 4) = 152.9 s (linear scaling would say 200 s)
    jobs_trace(base, tmp_path, "a,0,8,100,low\n")
    base["workload"]["scaling"] = {"model": "amdahl", "parallel_fraction": [0.9]}
    sim, s = run(base)
    assert s["jct_s"]["max"] == pytest.approx(100 / (0.1 + 0.9 / 8) * (0.1 + 0.9 / 4), rel=1e-3)
    base["workload"]["scaling"] = {"model": "linear"}
    sim, s = run(base)
    assert s["jct_s"]["max"] == pytest.approx(200, rel=1e-3)


def test_relocation_moves_are_charged_by_state_size(base, tmp_path):
    # a (low, the most recent) is frozen by b at t=5, then relocates (relocate_after 0) onto the 2 devices c frees
    # at t=30: its state, 8 GB per device, is pulled across at network_gbps
    jobs_trace(base, tmp_path, "c,0,2,30,low\na,1,2,100,low\nb,5,2,200,high\n")
    base["workload"]["state_gb"] = 8.0
    base["policy"] = {"name": "priority", "params": {"relocate_after": 0}}
    sim, s = run(base)
    a = next(r for r in sim.jobs if r.spec.id == "a")
    assert s["scheduling"]["relocations"] == 1 and a.moved_bytes == 2 * 8 * 2**30
    assert s["scheduling"]["move_device_s"] == pytest.approx(2 * 8 * 2**30 * 8 / 100e9)


def test_time_axes_read_in_hours_or_days_when_long():
    assert metrics.time_unit(300) == (1.0, "s")
    assert metrics.time_unit(5000) == (60.0, "minutes")
    assert metrics.time_unit(20 * 3600) == (3600.0, "hours")
    assert metrics.time_unit(8 * 86400) == (86400.0, "days")


def test_an_elastic_job_is_shrunk_rather_than_frozen_and_pays_what_amdahl_says(base, tmp_path):
    # a (low, 4 devices, accepts 2) runs 100 s in 10 s steps; b (high, 1 device) arrives at 20 for 30 s. dtorch
    # shrinks a to 3 devices (a logical device and its 2 GB move over) and a's steps take as long as its worker
    # with two logical devices: (0.05 + 2 * 0.95 / 4) / (0.05 + 0.95 / 4) = 1.83x, until b ends and a grows
    # back; priority (no shrink) freezes a for b's 30 s.
    jobs_trace(base, tmp_path, "a,0,4,100,low\nb,20,1,30,high\n")
    base["workload"].update(elastic_jobs={"share": 1.0, "min_fraction": 0.5},
                            scaling={"parallel_fraction": [0.95]})
    base["policy"] = {"name": "dtorch"}
    sim, s = run(base)
    a = next(r for r in sim.jobs if r.spec.id == "a")
    assert a.preemptions == 0 and a.moved_bytes == 2 * 2 * 2**30  # moved off and back, 2 GB each way
    shrunk_jct = a.finished - a.spec.arrival
    # two steps at 18.26 s while b runs (it grows back at the end of the second): 2 x 8.26 s lost
    assert 100 + 2 * 8.26 < shrunk_jct < 100 + 2 * 8.26 + 5
    base["policy"] = {"name": "priority"}
    sim, s = run(base)
    a = next(r for r in sim.jobs if r.spec.id == "a")
    assert a.preemptions == 1 and a.finished - a.spec.arrival > shrunk_jct + 5  # frozen 30 s


def test_a_repaired_worker_gets_work_in_the_event_that_registers_it(base):
    """Two 1-device jobs fill both nodes; node0 fails and its job waits to be rebuilt (from its snapshot). When the
    node comes back, the core starts the rebuild on the new worker while handling its Register, before the reply
    tells the harness the worker's id. The harness must deliver that work: it once answered "connection refused",
    so the core fenced every repaired worker that a waiting session wanted at once (on ITP cluster02 the cluster
    shrank to a few workers, and LAS's makespan grew 20x)."""
    base["workload"]["synthetic"].update(jobs=2, size={"choices": [1]}, arrival={"rate_per_s": 100},
                                         duration={"dist": "constant", "value": 100})
    base["workload"].update(steps_per_job=10, sync_every=10)
    base["cluster"]["nodes"] = [{"count": 2, "devices_per_node": 1, "device_type": "a100"}]
    base["recovery"] = {"snapshot_every_batches": 2}
    base["faults"] = [{"kind": "node_failure", "at": 25, "node": "node0", "mode": "silent", "repair_s": 10}]
    sim, s = run(base)
    assert s["jobs"]["finished"] == 2 and s["jobs"]["restarts"] == 0
    assert sim.fenced_workers == 0 and sum(w.alive for w in sim.all_workers) == 2  # the repaired worker stays
    hit = next(r for r in sim.jobs if r.recoveries)
    assert hit.finished < 25 + 4 + 10 + 80  # rebuilt on the repaired worker, not after the other job (t=100)
