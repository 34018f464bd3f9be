"""Simulator speed on a long real-shaped trace: 100,000 jobs on 512 and on 10,000 devices, per policy, one core.

The trace is ITP cluster04 (scenarios/traces/msft-itp-cluster04.csv, 15,802 jobs over 59 days) repeated end to end
until it has `--jobs` jobs, written to a temporary CSV and read through the generic `csv` trace format. Time is
compressed 100x (a 3-hour job runs 108 simulated seconds); arrivals are compressed a further 512/devices so that
the offered load is the same on every cluster size (~1: the average demand of the trace is ~495 GPUs). Jobs run
as steps of ~30 s (at most 20 a job), syncing every 5, heartbeats every 60 s, under the controller's dispatch
window of one batch (the simulator's default, as `dtorch-controller` runs; without it a freeze waits for all the
steps its victim sent: docs/simulation.md, "Full scale, session 19").

Prints, per cluster size and policy: wall and CPU time of the run (this process, one core), simulated time, core
events, events and jobs per CPU second, CPU minutes per 100,000 jobs (the run's own rate; with `--jobs 100000` it is
the run itself), jobs finished, and the peak memory. Nothing is asserted (the target, under 3 minutes of CPU per
policy for 100,000 jobs, is read off the output; see docs/simulation.md). A shorter `--jobs` gives the rate sooner,
but only the whole run is the figure: the trace's busy stretches pile up frozen sessions under the preempting
policies, and a 3,000-job rate once said 4 minutes for a run that took 21 (FIFO's rate is flat in the number of
jobs).

    python benchmarks/bench_sim_trace.py                                   # 100,000 jobs, 512 and 10,000 devices
    python benchmarks/bench_sim_trace.py --jobs 20000 --devices 512 --policies las --profile 25
    python benchmarks/bench_sim_trace.py --jobs 50000 --devices 10000 --policies dtorch --params '{"lend": false}'

Under each row: what the policy did with the jobs (makespan, mean and p99 JCT, busy and allocated shares,
preemptions, relocations), from the simulator's own metrics.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import json
import pstats
import resource
import tempfile
import time
from pathlib import Path

from dtorch_sim import metrics
from dtorch_sim.harness import Simulation
from dtorch_sim.scenario import ScenarioError, parse

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "scenarios" / "traces" / "msft-itp-cluster04.csv"
TIME_SCALE = 0.01
BASE_DEVICES = 512  # the cluster size at which arrivals are only time-scaled


def tiled_trace(path: Path, jobs: int) -> None:
    """ITP cluster04's jobs, repeated end to end (each copy one trace span and an hour later) up to `jobs` rows."""
    with open(SOURCE, newline="") as f:
        rows = list(csv.DictReader(f))
    submits = [float(r["submission_time"]) for r in rows]
    span = max(submits) - min(submits) + 3600.0
    with open(path, "w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["submit", "duration", "gpus"])
        for i in range(jobs):
            r = rows[i % len(rows)]
            out.writerow([float(r["submission_time"]) + (i // len(rows)) * span, r["duration"], r["num_gpu"]])


def scenario(trace: Path, devices: int, policy: str, params: dict | None = None) -> dict:
    return {
        "name": f"itp04-tiled-{devices}",
        "seed": 1,
        "cluster": {"device_types": {"v100": {"speed": 1.0, "memory_gb": 32}},
                    "nodes": [{"count": devices // 8, "devices_per_node": 8, "device_type": "v100"}]},
        "workload": {"trace": {"format": "csv", "path": str(trace), "time_scale": TIME_SCALE,
                               "arrival_scale": TIME_SCALE * BASE_DEVICES / devices,
                               "columns": {"submit": "submit", "duration": "duration", "num_gpu": "gpus"}},
                     "step_s": 30, "max_steps": 20, "sync_every": 5, "retry_s": 1800},
        "policy": {"name": policy, "params_for": {"las": {"thresholds": [36, 360, 3600]}, **({policy: params}
                                                                                           if params else {})}},
        "heartbeat": {"interval_s": 60.0, "timeout_s": 180.0},
    }


def run(data: dict, profile: int) -> dict:
    sc = parse(data)
    sc = sc.with_policy(sc.policy.name)  # its params_for entry
    wall0, cpu0 = time.perf_counter(), time.process_time()
    sim = Simulation(sc)
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    sim.run_all()
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"wall": wall, "cpu": cpu, "events": sim.events, "sim_s": sim.env.now, "jobs": len(sim.jobs),
            "finished": sum(r.finished is not None for r in sim.jobs), "workers": len(sim.all_workers),
            "summary": metrics.summarize(sim)}


def outcome(summary: dict) -> str:
    """What the policy did with the jobs, one line; makespan and JCTs read "none" when no job finished."""
    s, u, jct, makespan = summary["scheduling"], summary["utilization"], summary["jct_s"], summary["makespan_s"]

    def seconds(value: float | None) -> str:
        return "none" if value is None else f"{value:,.0f} s"

    return (f"makespan {'none' if makespan is None else f'{makespan / 3600:.2f} h'}, mean JCT {seconds(jct['mean'])}, "
            f"p99 {seconds(jct['p99'])}, busy {u['busy_mean']:.1%}, allocated {u['allocated_mean']:.1%}, "
            f"preemptions {s['preemptions']:,}, relocations {s['relocations']:,}")


def _jobs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of jobs >= 1, got {text!r}")
    return int(text)


def _devices(text: str) -> list[int]:
    sizes = [d.strip() for d in text.split(",")]
    if not all(d.isdigit() and int(d) >= 8 and int(d) % 8 == 0 for d in sizes):
        raise argparse.ArgumentTypeError(f"expected comma-separated cluster sizes, multiples of 8 (nodes of 8), got "
                                         f"{text!r}")
    return [int(d) for d in sizes]


def _policies(text: str) -> list[str]:
    from dtorch_sim.policies import is_known, known

    names = text.split(",")
    if unknown := [p for p in names if not is_known(p)]:
        raise argparse.ArgumentTypeError(f"unknown policy {unknown[0]!r}: known policies are {known()}")
    return names


def _params(text: str) -> dict:
    try:
        params = json.loads(text)
    except ValueError:
        params = None
    if not isinstance(params, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of policy parameters, got {text!r}")
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=_jobs, default=100_000)
    parser.add_argument("--devices", type=_devices, default="512,10000",
                        help="comma-separated cluster sizes (multiples of 8)")
    parser.add_argument("--policies", type=_policies, default="fifo,las,dtorch")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N most expensive functions")
    parser.add_argument("--params", type=_params, default=None, metavar="JSON",
                        help='policy parameters for every policy run, e.g. \'{"lend": false}\'')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "itp04-tiled.csv"
        tiled_trace(trace, args.jobs)
        print(f"{'devices':>8} {'policy':>8} {'wall s':>8} {'CPU s':>8} {'sim time':>10} {'core events':>12} "
              f"{'events/CPU s':>13} {'jobs/CPU s':>11} {'CPU min/100k jobs':>18} {'finished':>16}", flush=True)
        for devices in args.devices:
            for policy in args.policies:
                try:
                    r = run(scenario(trace, devices, policy, args.params), args.profile)
                except ScenarioError as e:  # --params the policy does not take
                    parser.exit(2, "".join(f"bench_sim_trace.py: {line}\n" for line in e.lines))
                print(f"{devices:>8,} {policy:>8} {r['wall']:>8.1f} {r['cpu']:>8.1f} {r['sim_s'] / 3600:>8.1f} h "
                      f"{r['events']:>12,} {r['events'] / r['cpu']:>13,.0f} {r['jobs'] / r['cpu']:>11,.0f} "
                      f"{r['cpu'] / r['jobs'] * 100_000 / 60:>18.1f} {r['finished']:>7,}/{r['jobs']:<8,}", flush=True)
                print(f"{'':>17} {outcome(r['summary'])}", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak memory {rss:,.0f} MiB")


if __name__ == "__main__":
    main()
