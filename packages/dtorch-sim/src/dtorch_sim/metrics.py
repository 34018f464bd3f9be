"""What a run measured: metrics.json, jobs.csv, utilization.csv, failures.csv and (with matplotlib) plots.

Everything here is a function of the simulated run only, so the same scenario and seed give the same
bytes. Wall-clock numbers (events per second) belong to the CLI's printed summary, never to these files.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from dtorch_sim.harness import Simulation


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _stats(values: list[float]) -> dict[str, float | None]:
    return {"mean": _r(sum(values) / len(values)) if values else None, "p50": _r(percentile(values, 50)),
            "p99": _r(percentile(values, 99)), "max": _r(max(values)) if values else None}


def summarize(sim: Simulation) -> dict:
    sc = sim.scenario
    done = [r for r in sim.jobs if r.finished is not None]
    jct = [r.finished - r.spec.arrival for r in done]  # type: ignore[operator]
    queued = [r.placed - r.spec.arrival for r in sim.jobs if r.placed is not None]
    alive_time = sum(s.alive for s in sim.samples)
    detections = [f.detected - f.at for f in sim.failures if f.detected is not None]
    injected = [f for f in sim.failures if f.kind != "remove_nodes"]
    return {
        "scenario": sc.name,
        "policy": sc.policy.name,
        "seed": sc.seed,
        "sim_end_s": _r(sim.env.now),
        "events_handled": sim.events,
        "jobs": {
            "submitted": len(sim.jobs),
            "finished": len(done),
            "failed": sum(r.failed is not None for r in sim.jobs),
            "unfinished": sum(r.finished is None and r.failed is None for r in sim.jobs),
            "restarts": sum(r.restarts for r in sim.jobs),
        },
        "jct_s": _stats(jct),
        "jct_s_by_priority": {p: _stats([r.finished - r.spec.arrival for r in done if r.spec.priority == p])
                              for p in ("high", "normal", "low") if any(r.spec.priority == p for r in sim.jobs)},
        "queueing_delay_s": _stats(queued),
        "makespan_s": _r(max((r.finished for r in done), default=0.0) - (sim.jobs[0].spec.arrival if sim.jobs else 0)),
        "utilization": {
            "busy_mean": _r(sum(s.busy * s.alive for s in sim.samples) / alive_time) if alive_time else 0.0,
            "allocated_mean": _r(sum(s.allocated for s in sim.samples) / alive_time) if alive_time else 0.0,
            "bound_per_alive_device_mean": _r(sum(s.bound for s in sim.samples) / alive_time) if alive_time else 0.0,
            "sample_interval_s": _r(sim.sample_interval),
        },
        "failures": {
            "injected": len(injected),
            "nodes_removed_workers": len(sim.failures) - len(injected),
            "detected": len(detections),
            "heartbeat_timeout_s": sc.heartbeat.timeout_s,
            "detection_s": _stats(detections),
            "events": [{"kind": f.kind, "worker": f.worker, "at": _r(f.at), "detected_at": _r(f.detected),
                        "detection_s": _r(f.detected - f.at) if f.detected is not None else None}
                       for f in sim.failures],
        },
        "workers_fenced": sim.fenced_workers,
    }


def write(sim: Simulation, out: str | Path, plots: bool = True) -> dict:
    """Write every output into `out`; returns the summary (the metrics.json content)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(sim)
    (out / "metrics.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    with open(out / "jobs.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["job_id", "arrival_s", "devices", "duration_s", "placed_s", "finished_s", "failed_s", "jct_s",
                    "queueing_delay_s", "restarts", "steps_done", "priority"])
        for r in sim.jobs:
            s = r.spec
            w.writerow([s.id, _r(s.arrival), s.devices, _r(s.duration), _r(r.placed), _r(r.finished), _r(r.failed),
                        _r(r.finished - s.arrival) if r.finished is not None else None,
                        _r(r.placed - s.arrival) if r.placed is not None else None, r.restarts, r.steps_done,
                        s.priority])
    with open(out / "utilization.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["t_s", "alive", "allocated", "bound", "allocated_frac", "busy_frac"])
        for s in sim.samples:
            w.writerow([_r(s.t), s.alive, s.allocated, s.bound, _r(s.allocated / s.alive if s.alive else 0.0),
                        _r(s.busy)])
    with open(out / "failures.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["kind", "worker", "at_s", "detected_at_s", "detection_s"])
        for e in summary["failures"]["events"]:
            w.writerow([e["kind"], e["worker"], e["at"], e["detected_at"], e["detection_s"]])
    if plots:
        plot(sim, out)
    return summary


def plot(sim: Simulation, out: Path) -> list[Path]:
    """utilization.png and jct_cdf.png; nothing (and no error) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(8, 3.5))
    t = [s.t for s in sim.samples]
    ax.plot(t, [s.allocated / s.alive if s.alive else 0 for s in sim.samples], label="allocated")
    ax.plot(t, [s.busy for s in sim.samples], label="busy")
    ax.set(xlabel="simulated time (s)", ylabel="fraction of alive devices", ylim=(0, 1.05),
           title=f"{sim.scenario.name}: device utilization ({sim.scenario.policy.name})")
    for f in sim.failures:
        ax.axvline(f.at, color="red", alpha=0.3, lw=0.8)
    ax.legend(loc="lower right")
    fig.tight_layout()
    paths.append(out / "utilization.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    jct = sorted(r.finished - r.spec.arrival for r in sim.jobs if r.finished is not None)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    if jct:
        ax.step(jct, [(i + 1) / len(jct) for i in range(len(jct))], where="post")
        ax.set_xscale("log")
    ax.set(xlabel="job completion time (s)", ylabel="fraction of finished jobs",
           title=f"JCT CDF ({sim.scenario.policy.name})")
    fig.tight_layout()
    paths.append(out / "jct_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
