"""Jobs: where they come from (a synthetic process or a trace) and what one does, as a simpy process.

A job is a client session: it opens a session, asks for a mesh of N devices, submits its steps (one
matmul on the whole mesh per step), syncs every few steps, and closes. When a Sync reports that a
worker was lost, the job restarts from its last synced step in a new session (or gives up).
"""

from __future__ import annotations

import csv
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from dtorch.protocol import messages as m
from dtorch_controller.core import events as ev
from dtorch_sim import __version__
from dtorch_sim.scenario import Scenario, Workload

HELLO = m.Hello(protocol_version=m.PROTOCOL_VERSION, package_version=__version__, role="client")
SYNC_TIMEOUT_S = 1e12  # jobs wait for their workers; lost workers answer the Sync with errors


@dataclass(frozen=True)
class JobSpec:
    id: str
    arrival: float
    devices: int
    duration: float  # seconds of work on a speed-1.0 device, alone on its devices
    priority: str = "normal"


@dataclass
class JobRecord:
    """What happened to one job; the metrics read these."""

    spec: JobSpec
    placed: float | None = None  # first time its mesh was placed
    finished: float | None = None
    failed: float | None = None
    restarts: int = 0
    steps_done: int = 0
    sessions: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- where jobs come from


def generate(sc: Scenario) -> list[JobSpec]:
    wl = sc.workload
    jobs = sorted(_synthetic(sc) if wl.synthetic is not None else _trace(sc), key=lambda j: (j.arrival, j.id))
    if wl.priorities:
        rng = random.Random(f"priorities-{sc.seed}")
        classes, weights = list(wl.priorities), list(wl.priorities.values())
        jobs = [replace(j, priority=rng.choices(classes, weights=weights)[0]) for j in jobs]
    return jobs


def _synthetic(sc: Scenario) -> Iterator[JobSpec]:
    syn = sc.workload.synthetic
    assert syn is not None
    rng = random.Random(f"workload-{syn.seed if syn.seed is not None else sc.seed}")
    t = 0.0
    for i in range(syn.jobs):
        t += rng.expovariate(syn.arrival.rate_per_s)
        size = rng.choices(syn.size.choices, weights=syn.size.weights)[0]
        yield JobSpec(id=f"job{i}", arrival=t, devices=size, duration=max(syn.duration.sample(rng), 1e-3))


def _trace(sc: Scenario) -> Iterator[JobSpec]:
    tr = sc.workload.trace
    assert tr is not None
    cols = tr.column_map()
    rows = []
    with open(sc.trace_path(), newline="") as f:
        for row in csv.DictReader(f):
            submit = float(row[cols["submit"]])
            if submit < tr.start_s:
                continue
            if "duration" in cols and cols["duration"] in row:
                duration = float(row[cols["duration"]])
            else:
                duration = float(row[cols["end"]]) - submit
            gpus = int(float(row[cols["num_gpu"]] or 0))
            if gpus == 0:
                if tr.zero_gpu == "skip":
                    continue
                gpus = 1
            milli = row.get(cols.get("gpu_milli", ""), "") or "1000"
            if gpus == 1 and float(milli) < 1000 and tr.fractional == "skip":
                continue
            if duration <= 0 or (tr.max_gpus is not None and gpus > tr.max_gpus):
                continue
            rows.append((submit, row[cols["job_id"]], gpus, duration))
    rows.sort()
    if tr.limit is not None:
        rows = rows[:tr.limit]
    t0 = rows[0][0] if rows else 0.0
    for submit, job_id, gpus, duration in rows:
        yield JobSpec(id=job_id, arrival=(submit - t0) * tr.time_scale, devices=gpus, duration=duration * tr.time_scale)


# ---------------------------------------------------------------- what a job does


def job(sim, spec: JobSpec, wl: Workload, rec: JobRecord):
    """One job's life: arrive, get a mesh, run its steps in synced chunks, close; restart after a lost worker."""
    env = sim.env
    yield env.timeout(spec.arrival - env.now)
    work = Steps(spec, wl.steps_per_job, sim.scenario.cost)
    while True:
        opened = yield sim.request(lambda r: ev.OpenSession(r, m.OpenSession(hello=HELLO, name=spec.id,
                                                                             priority=spec.priority)))
        session = opened.session
        rec.sessions.append(session)
        mesh = m.OpenMesh(session=session, mesh=0, devices=list(range(spec.devices)), shape=[spec.devices])
        placed = yield sim.request(lambda r, mesh=mesh: ev.OpenMesh(r, mesh))
        while not placed.placed:  # the core queues nothing yet: ask again later
            yield env.timeout(wl.retry_s)
            placed = yield sim.request(lambda r, mesh=mesh: ev.OpenMesh(r, mesh))
        if rec.placed is None:
            rec.placed = env.now
        ok = yield from run_steps(sim, session, work, wl.sync_every, rec)
        yield sim.request(lambda r, s=session: ev.CloseSession(r, m.CloseSession(session=s)))
        if ok:
            rec.finished = env.now
            return
        if wl.on_failure == "fail":
            rec.failed = env.now
            return
        rec.restarts += 1


def run_steps(sim, session: str, work: Steps, sync_every: int, rec: JobRecord):
    """Submit the remaining steps, syncing every `sync_every`; False when a Sync reports lost work."""
    seq = 0
    setup = work.setup()
    while rec.steps_done < work.steps:
        chunk = min(sync_every, work.steps - rec.steps_done)
        for i in range(chunk):
            seq += 1
            instrs = (setup if seq == 1 else []) + work.step(rec.steps_done + i)
            yield sim.request(lambda r, seq=seq, instrs=instrs: ev.Submit(r, m.Submit(session, seq, instrs)))
        reply = yield sim.request(lambda r, seq=seq: ev.Sync(r, m.Sync(session, seq, SYNC_TIMEOUT_S)))
        if not reply.done or reply.errors:
            return False
        rec.steps_done += chunk
    return True


class Steps:
    """The instructions of a job: A (rows sharded over the mesh) @ B (replicated), once per step.

    Each device multiplies its [rows, k] shard by [k, k]: 2*rows*k*k flops, sized so that a step takes
    duration/steps seconds on a speed-1.0 device under the scenario's cost model.
    """

    A, B = 1, 2

    def __init__(self, spec: JobSpec, steps: int, cost) -> None:
        self.steps = steps
        self.k = cost.matrix_k
        step_s = spec.duration / steps
        rows = max(1, round(step_s * cost.reference_tflops * 1e12 / (2 * self.k * self.k)))
        n = spec.devices
        self.a = m.TensorSpec(shape=[n * rows, self.k], dtype="float32", mesh=0, placements=["S0"])
        self.b = m.TensorSpec(shape=[self.k, self.k], dtype="float32", mesh=0, placements=["R"])

    def setup(self) -> list[m.Instr]:
        return [m.InstrCreate(tid=self.A, spec=self.a, init="randn", seed=1),
                m.InstrCreate(tid=self.B, spec=self.b, init="randn", seed=2)]

    def step(self, i: int) -> list[m.Instr]:
        out = 3 + i
        call = m.InstrCall(op="aten.mm.default", mesh=0, args=[{"$t": self.A}, {"$t": self.B}], kwargs={},
                           outs=[m.OutSpec(tid=out, spec=self.a)], src=f"train.py:{i}")
        return [call] + ([m.InstrDelete(tids=[out - 1])] if i > 0 else [])
