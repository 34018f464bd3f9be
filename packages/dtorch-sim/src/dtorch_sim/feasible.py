"""Whether the cost model leaves any job a chance to finish before the run ends.

pydantic (scenario.py) already refuses a cost that is not a finite number, or that is negative; but a finite value can
still be absurd: `cost.launch_s: 1e300` validated ok, ran a minute of events and reported 0 jobs finished, with no
word. Each rule below is the least time one cost parameter adds to a job on its own (the job's work, queueing and
the other costs come on top), compared with the run's horizon (`jobs.horizon`: duration_s, else the generous cap the
run stops at):

| field | a job pays it at least | if every job would end past the horizon |
|---|---|---|
| `cost.launch_s` | once per step (its batch runs a `sim.step` command on each of its workers) | refused |
| `cost.rpc_latency_s` | once per Sync (the steps after a Sync reach their workers that late) | refused |
| `cost.host_gbps` | its state per device / bandwidth, when snapshotted, offloaded or restored | a warning |
| `cost.network_gbps` | its state per device / bandwidth, when moved or rebuilt from another worker | a warning |

A refusal names the field and the range that lets at least one job finish; `cost.reference_tflops` adds nothing on its
own (a step's flops are set from it, so its time is the job's duration whatever the reference).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dtorch_sim.jobs import GB, JobSpec, horizon, step_count
from dtorch_sim.scenario import Scenario

# field -> (how many times a job pays it: the job and the scenario -> a count, what one payment is, in words)
PER_JOB: dict[str, tuple[Callable[[JobSpec, Scenario], int], str]] = {
    "launch_s": (lambda j, sc: step_count(j, sc.workload), "per command (at least one a step)"),
    "rpc_latency_s": (lambda j, sc: math.ceil(step_count(j, sc.workload) / (1 if j.share < 1 else
                                                                             sc.workload.sync_every)),
                      "per delivery (at least one a Sync)"),
}
# field -> what copies at that bandwidth (a job pays it only when that happens)
COPIES = {
    "host_gbps": "snapshotted, offloaded or restored",
    "network_gbps": "moved or rebuilt from another worker",
}


def _horizon_words(sc: Scenario) -> str:
    return "duration_s" if sc.duration_s is not None else "the last arrival + 10x the jobs' total work + 1 h"


def problems(sc: Scenario, specs: list[JobSpec], source: str) -> list[str]:
    """One line per cost parameter that leaves no job able to finish by the run's end."""
    end = horizon(sc, specs)
    lines = []
    for name, (count, what) in PER_JOB.items():
        value = getattr(sc.cost, name)
        if not value or not specs:
            continue
        # the most it may be for one job to finish: the job's time left before the end over its count of payments
        # (jobs arriving after the end are duration_s's business, not the cost's)
        best = max(((end - j.arrival) / count(j, sc) for j in specs if j.arrival < end), default=math.inf)
        if value < best:
            continue
        lines.append(f"{source}: cost.{name}: {value:g} s {what} leaves no job able to finish by the run's end "
                     f"(~{end:,.6g} s: {_horizon_words(sc)}): expected 0 <= {name} < {best:.3g} s")
    return lines


def warnings(sc: Scenario, specs: list[JobSpec]) -> list[str]:
    """A bandwidth so low that one copy of the smallest state outlasts the run: a job copied so would never end."""
    if not specs:
        return []
    end = horizon(sc, specs)
    state = min(j.state_gb for j in specs)
    lines = []
    for name, what in COPIES.items():
        seconds = state * GB * 8 / (getattr(sc.cost, name) * 1e9)
        if seconds > end:
            lines.append(f"warning: cost.{name}: copying {state:g} GB (the smallest job state per device) takes "
                         f"{seconds:,.3g} s, longer than the run (~{end:,.6g} s): a job {what} will not finish "
                         f"(expected {name} > {state * GB * 8 / 1e9 / end:.3g} Gb/s)")
    return lines
