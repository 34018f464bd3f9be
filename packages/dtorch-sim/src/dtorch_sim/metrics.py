"""What a run measured: metrics.json, jobs.csv, utilization.csv, failures.csv and (with matplotlib) plots.

Everything here is a function of the simulated run only, so the same scenario and seed give the same
bytes. Wall-clock numbers (events per second) belong to the CLI's printed summary, never to these files.

Definitions (metrics.json):

* `jct_s`: finish - arrival of finished jobs; `queueing_delay_s`: first placement - arrival (mean, p50, p90, p99,
  max); `frozen_s`: seconds a finished job spent frozen (preempted), in all, and `frozen_share_of_jct` that time
  as a fraction of its JCT (a queueing delay of 0 under preemption hides frozen time: these show it);
  `jct_s_by_priority`, `jct_s_by_group` (the trace's partition values).
* `jct_floor_s`: the finished jobs' own durations (the work of the trace, on speed-1.0 devices, on the devices
  each asked for): a job's JCT had it started on arrival and never stopped. No policy brings a job below its
  duration on such devices (a job on fewer devices runs slower, never faster), so no mean JCT is below this mean:
  a goal stated as a ratio to another policy's mean (e.g. 1/1.3 of LAS's) is out of reach where it is lower.
* `makespan_s`: last finish - first arrival (null when no job finished).
* jobs.csv, one row per job: its spec, what happened to it, and `error`: why a failed job failed (the controller's
  refusal, or the error its Sync reported), empty otherwise.
* `utilization`: time averages over the samples, weighted by alive devices: `busy` (executing), `allocated`
  (leased to a session), `unallocated_share` (capacity no session leases: a whole device, or the room left by
  packed leases), also while sessions wait (`unallocated_share_when_queued`: capacity stranded although
  there is demand, the fragmentation figure of packing studies), and `requested_share` (capacity the running
  jobs asked for: a fractional job counts its fraction even when it got a whole device), also while sessions
  wait (1 - `requested_share_when_queued` is the capacity not granted to any request although there is
  demand: unallocated, or stranded by giving a fractional job a whole device).
* `failures`: injected, detected, `detection_s` (failure -> the core marks the worker lost), `recovery_s`
  (failure -> every job with devices on it runs again: rebuilt by the core, or restarted and placed),
  `device_s_lost` = `redone_device_s` (step work done again after a restart or replay, or cut short by the
  failure) + `stalled_device_s` (devices of the jobs it hit x time from the failure until each job ran again,
  or let its devices go to restart; a restarted job's wait in the queue is not counted: others use them).
* `queue_length` (sessions waiting to be placed), `frozen` (sessions preempted, waiting to resume: on their own
  devices, or on free ones their state is moved to), per sample.
* `preemptions` (sessions frozen), `resumes`, `relocations` (resumes on free devices the session's state was
  moved to, rather than on its own), `recoveries` (sessions rebuilt by the core), `migrations` (logical-device
  moves by drains: count, bytes, downtime); `moved_bytes` / `move_device_s` (every copy of a moving logical
  device: relocations, growth, shrinks, drains) and `offloaded_bytes` / `offload_device_s` (frozen state
  offloaded to host memory and loaded back: the freeze and resume cost), all charged on the simulated clock.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from dtorch_sim.harness import Simulation

PRIORITIES = ("high", "normal", "low")


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
            "p90": _r(percentile(values, 90)), "p99": _r(percentile(values, 99)),
            "max": _r(max(values)) if values else None}


def _weighted(samples, value) -> float:
    alive = sum(s.alive for s in samples)
    return _r(sum(value(s) * s.alive for s in samples) / alive) if alive else 0.0  # type: ignore[return-value]


def summarize(sim: Simulation) -> dict:
    sc = sim.scenario
    done = [r for r in sim.jobs if r.finished is not None]
    jct = [r.finished - r.spec.arrival for r in done]  # type: ignore[operator]
    queued = [r.placed - r.spec.arrival for r in sim.jobs if r.placed is not None]
    samples = sim.samples
    waiting = [s for s in samples if s.queued]
    detections = [f.detected - f.at for f in sim.failures if f.detected is not None]
    recoveries = [f.recovered - f.at for f in sim.failures if f.recovered is not None and f.kind != "remove_nodes"]
    injected = [f for f in sim.failures if f.kind != "remove_nodes"]
    stalled = sum(f.stalled_device_s for f in sim.failures)
    return {
        "scenario": sc.name,
        "policy": sc.policy.name,
        "seed": sc.seed,
        "sim_end_s": _r(sim.env.now),
        "events_handled": sim.events,
        "devices": {"initial": sim.initial_devices,
                    "alive_at_end": sum(w.alive for ws in sim.nodes.values() for w in ws)},
        "jobs": {
            "submitted": len(sim.jobs),
            "finished": len(done),
            "failed": sum(r.failed is not None for r in sim.jobs),
            "unfinished": sum(r.finished is None and r.failed is None for r in sim.jobs),
            "restarts": sum(r.restarts for r in sim.jobs),
        },
        "jct_s": _stats(jct),
        "jct_floor_s": _stats([r.spec.duration for r in done]),
        "jct_s_by_priority": {p: _stats([r.finished - r.spec.arrival for r in done if r.spec.priority == p])
                              for p in PRIORITIES if any(r.spec.priority == p for r in sim.jobs)},
        "queueing_delay_s": _stats(queued),
        "frozen_s": _stats([r.frozen_s for r in done]),
        "frozen_share_of_jct": _stats([r.frozen_s / jct_s if jct_s > 0 else 0.0 for r, jct_s in zip(done, jct)]),
        "jct_s_by_group": {g: _stats([r.finished - r.spec.arrival for r in done if r.spec.group == g])
                           for g in sorted({r.spec.group for r in sim.jobs} - {""})},
        # none (null) when no job finished: it was 0 - the first arrival, a negative makespan
        "makespan_s": _r(max(r.finished for r in done) - sim.jobs[0].spec.arrival) if done else None,
        "utilization": {
            "busy_mean": _weighted(samples, lambda s: s.busy),
            "allocated_mean": _weighted(samples, lambda s: s.allocated / s.alive if s.alive else 0.0),
            "bound_per_alive_device_mean": _weighted(samples, lambda s: s.bound / s.alive if s.alive else 0.0),
            "unallocated_share_mean": _weighted(samples, lambda s: s.unallocated),
            "unallocated_share_when_queued": _weighted(waiting, lambda s: s.unallocated) if waiting else None,
            "requested_share_mean": _weighted(samples, lambda s: s.requested),
            "requested_share_when_queued": _weighted(waiting, lambda s: s.requested) if waiting else None,
            "queue_length_mean": _r(sum(s.queued for s in samples) / len(samples)) if samples else 0.0,
            "queue_length_max": max((s.queued for s in samples), default=0),
            "frozen_mean": _r(sum(s.frozen for s in samples) / len(samples)) if samples else 0.0,
            "frozen_max": max((s.frozen for s in samples), default=0),
            "sample_interval_s": _r(sim.sample_interval),
        },
        "scheduling": {"preemptions": sim.preemptions, "resumes": sim.resumes,
                       "relocations": sim.relocations, "recoveries": sim.recoveries,
                       "moved_bytes": sim.moved_bytes, "move_device_s": _r(sim.move_s),
                       "offloaded_bytes": sim.swapped_bytes, "offload_device_s": _r(sim.swap_s),
                       "migrations": len(sim.moves), "migrated_bytes": sum(mv.bytes for mv in sim.moves),
                       "drains_refused": sim.drains_refused,
                       "migration_downtime_s": _stats([mv.downtime_s for mv in sim.moves])},
        "failures": {
            "injected": len(injected),
            "nodes_removed_workers": len(sim.failures) - len(injected),
            "detected": len(detections),
            "heartbeat_timeout_s": sc.heartbeat.timeout_s,
            "detection_s": _stats(detections),
            "recovery_s": _stats(recoveries),
            "device_s_lost": _r(sim.redone_device_s + stalled),
            "redone_device_s": _r(sim.redone_device_s),
            "stalled_device_s": _r(stalled),
            "workers_fenced": sim.fenced_workers,
            "events": [{"kind": f.kind, "worker": f.worker, "at": _r(f.at), "detected_at": _r(f.detected),
                        "detection_s": _r(f.detected - f.at) if f.detected is not None else None,
                        "recovered_at": _r(f.recovered),
                        "recovery_s": _r(f.recovered - f.at) if f.recovered is not None else None,
                        "jobs_hit": len(f.jobs), "stalled_device_s": _r(f.stalled_device_s)}
                       for f in sim.failures],
        },
        "notes": list(sim.notes),
    }


def write(sim: Simulation, out: str | Path, plots: bool = True) -> dict:
    """Write every output into `out`; returns the summary (the metrics.json content)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(sim)
    (out / "metrics.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    with open(out / "jobs.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["job_id", "arrival_s", "devices", "share", "priority", "duration_s", "placed_s", "finished_s",
                    "failed_s", "jct_s", "queueing_delay_s", "frozen_s", "restarts", "preemptions", "recoveries",
                    "steps_done", "work_device_s", "group", "error"])
        for r in sim.jobs:
            s = r.spec
            w.writerow([s.id, _r(s.arrival), s.devices, _r(s.share), s.priority, _r(s.duration), _r(r.placed),
                        _r(r.finished), _r(r.failed), _r(r.finished - s.arrival) if r.finished is not None else None,
                        _r(r.placed - s.arrival) if r.placed is not None else None, _r(r.frozen_s), r.restarts,
                        r.preemptions, r.recoveries, r.steps_done, _r(r.work_s), s.group, r.error])
    with open(out / "utilization.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["t_s", "alive", "allocated", "bound", "allocated_frac", "busy_frac", "queued", "frozen",
                    "unallocated_share", "requested_share"])
        for s in sim.samples:
            w.writerow([_r(s.t), s.alive, s.allocated, s.bound, _r(s.allocated / s.alive if s.alive else 0.0),
                        _r(s.busy), s.queued, s.frozen, _r(s.unallocated), _r(s.requested)])
    with open(out / "failures.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["kind", "worker", "at_s", "detected_at_s", "detection_s", "recovered_at_s", "recovery_s",
                    "jobs_hit", "stalled_device_s"])
        for e in summary["failures"]["events"]:
            w.writerow([e["kind"], e["worker"], e["at"], e["detected_at"], e["detection_s"], e["recovered_at"],
                        e["recovery_s"], e["jobs_hit"], e["stalled_device_s"]])
    if plots:
        plot(sim, out)
    return summary


@dataclass(frozen=True)
class Series:
    """What the plots of one run need (kept by `compare` for the overlays, without the whole simulation)."""

    policy: str
    scenario: str
    jct: list[float]  # finished jobs' JCTs, ascending
    t: list[float]
    allocated: list[float]
    busy: list[float]
    requested: list[float]
    queued: list[int]
    frozen: list[int]
    failures: list[float]


def series(sim: Simulation) -> Series:
    samples = sim.samples
    return Series(sim.scenario.policy.name, sim.scenario.name,
                  sorted(r.finished - r.spec.arrival for r in sim.jobs if r.finished is not None),
                  [x.t for x in samples], [x.allocated / x.alive if x.alive else 0.0 for x in samples],
                  [x.busy for x in samples], [x.requested for x in samples], [x.queued for x in samples],
                  [x.frozen for x in samples], [f.at for f in sim.failures])


TIME_UNITS = ((3 * 86400, 86400.0, "days"), (3 * 3600, 3600.0, "hours"), (600, 60.0, "minutes"),
              (-math.inf, 1.0, "s"))


def time_unit(span_s: float) -> tuple[float, str]:
    """The unit a time axis reads best in: days beyond 3 days, hours beyond 3 hours, minutes beyond 10 minutes."""
    return next((size, name) for above, size, name in TIME_UNITS if span_s > above)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(sim: Simulation, out: Path) -> list[Path]:
    """utilization.png, jct_cdf.png and queue.png of one run; nothing (and no error) without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return []
    run = series(sim)
    name, policy = run.scenario, run.policy
    size, unit = time_unit(run.t[-1] if run.t else 0.0)
    t = [x / size for x in run.t]
    paths = []
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(t, run.allocated, label="allocated")
    ax.plot(t, run.busy, label="busy")
    if any(r < a - 1e-9 for r, a in zip(run.requested, run.allocated)):
        ax.plot(t, run.requested, label="requested", lw=0.8)
    ax.set(xlabel=f"simulated time ({unit})", ylabel="fraction of alive devices", ylim=(0, 1.05),
           title=f"{name}: device utilization ({policy})")
    for at in run.failures:
        ax.axvline(at / size, color="red", alpha=0.3, lw=0.8)
    ax.legend(loc="lower right")
    paths.append(_save(plt, fig, out / "utilization.png"))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    _cdf(ax, [run])
    ax.set_title(f"JCT CDF ({policy})")
    paths.append(_save(plt, fig, out / "jct_cdf.png"))
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.step(t, run.queued, where="post", label="waiting to be placed")
    if any(run.frozen):
        ax.step(t, run.frozen, where="post", label="frozen (preempted)")
    ax.legend(loc="upper right")
    ax.set(xlabel=f"simulated time ({unit})", ylabel="sessions", title=f"{name}: queue length ({policy})")
    paths.append(_save(plt, fig, out / "queue.png"))
    return paths


def plot_compare(runs: list[Series], out: Path) -> list[Path]:
    """The policies of a `compare` overlaid: jct_cdf.png (one CDF each) and utilization.png (busy, solid, and
    allocated, dotted, one color per policy), in `out`."""
    plt = _pyplot()
    if plt is None or not runs:
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    _cdf(ax, runs)
    ax.set_title(f"{runs[0].scenario}: JCT CDF")
    ax.legend(loc="lower right")
    paths.append(_save(plt, fig, out / "jct_cdf.png"))
    size, unit = time_unit(max((r.t[-1] for r in runs if r.t), default=0.0))
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, run in enumerate(runs):
        t = [x / size for x in run.t]
        color = f"C{i}"
        ax.plot(t, run.busy, color=color, label=f"{run.policy} busy")
        ax.plot(t, run.allocated, color=color, ls=":", lw=1, label=f"{run.policy} allocated")
    ax.set(xlabel=f"simulated time ({unit})", ylabel="fraction of alive devices", ylim=(0, 1.05),
           title=f"{runs[0].scenario}: device utilization")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    paths.append(_save(plt, fig, out / "utilization.png"))
    return paths


def _cdf(ax, runs: list[Series]) -> None:
    size, unit = time_unit(max((r.jct[-1] for r in runs if r.jct), default=0.0))
    for run in runs:
        if run.jct:
            n = len(run.jct)
            ax.step([x / size for x in run.jct], [(i + 1) / n for i in range(n)], where="post", label=run.policy)
    if any(r.jct for r in runs):
        ax.set_xscale("log")
    ax.set(xlabel=f"job completion time ({unit})", ylabel="fraction of finished jobs", ylim=(0, 1.02))


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
