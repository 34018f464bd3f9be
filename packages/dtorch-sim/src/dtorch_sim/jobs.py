"""Jobs: where they come from (a synthetic process or a trace CSV) and what one does, as a simpy process.

A job is a client session: it opens a session (with its priority, and a memory cap when it asks for a share of
a device), asks for a mesh of N devices, waits in the scheduler's queue if it must, then runs its work as
*steps*: each step is one batch with one simulated training step (`sim.step`: a declared number of flops per
device, reading the job's state tensor and writing its next version), and every `sync_every` steps a Sync.
A Sync that comes back done is the job's durable point: when a later Sync reports lost data (a worker was
lost and the core could not rebuild the session), the job closes the session and starts again in a new one
from its last durable point, so it loses exactly the steps since then. With the core's recovery on
(`recovery.snapshot_every_batches`), the core itself rebuilds the session from its snapshot and replays the
batches since, and the job only sees a slower Sync. A frozen (preempted) session keeps its state on its
workers and loses nothing; a moved one pays for the copy of its state.

Also here: reading node lists (the openb GPU nodes CSV) into node groups.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from dtorch_controller.core import MAX_LOGICAL_PER_DEVICE  # the core's surface (.importlinter)
from dtorch_controller.core import effects as fx
from dtorch_controller.core import events as ev
from dtorch_protocol import messages as m
from dtorch_sim import __version__
from dtorch_sim.scenario import NodeGroup, Scenario, Workload

HELLO = m.Hello(protocol_version=m.PROTOCOL_VERSION, package_version=__version__, role="client")
SYNC_TIMEOUT_S = 1e12  # jobs wait for their workers; lost workers answer the Sync with errors
STEP_OP = "sim.step"  # the simulated training step; fake workers price it by its `flops` kwarg
STATE_COLS = 1024  # the state tensor is [devices * rows, 1024] float32, sharded by rows
GB = 2**30


class TraceError(ValueError):
    """A trace or node list that cannot be read; the message starts with the scenario field path."""


@dataclass(frozen=True)
class JobSpec:
    id: str
    arrival: float
    devices: int
    duration: float  # seconds of work on a speed-1.0 device, alone on its devices
    share: float = 1.0  # < 1: a fraction of one device (packing policies may share the device)
    priority: str = "normal"
    group: str = ""  # the trace's partition value (workload.trace.partition), if any
    parallel: float = 1.0  # Amdahl parallel fraction (workload.scaling): how its step time follows its devices
    state_gb: float = 2.0  # its live state per device (what moves, snapshots and offloads copy)
    declares: float = 0.0  # > 0: it declares its steps to the controller, times this error factor
    min_devices: int = 0  # > 0: elastic, it accepts this few physical devices (workload.elastic_jobs)


@dataclass
class JobRecord:
    """What happened to one job; the metrics read these."""

    spec: JobSpec
    placed: float | None = None  # first time its mesh was placed
    finished: float | None = None
    failed: float | None = None
    error: str = ""
    restarts: int = 0
    preemptions: int = 0
    recoveries: int = 0  # core rebuilds of its session after a worker loss
    steps_done: int = 0  # steps behind the last durable point (a Sync that came back done)
    work_s: float = 0.0  # device-seconds of step work executed (speed-normalized), redone work included
    frozen_s: float = 0.0  # seconds its sessions spent frozen (preempted), all sessions together
    moved_bytes: int = 0  # bytes of its state moved between workers (relocations, growth, shrink, drains)
    sessions: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- where jobs come from


def generate(sc: Scenario) -> list[JobSpec]:
    wl = sc.workload
    jobs = sorted(_synthetic(sc) if wl.synthetic is not None else _trace(sc), key=lambda j: (j.arrival, j.id))
    if wl.priorities:
        rng = random.Random(f"priorities-{sc.seed}")
        classes, weights = list(wl.priorities), list(wl.priorities.values())
        jobs = [replace(j, priority=rng.choices(classes, weights=weights)[0]) for j in jobs]
    return _costs(sc, jobs)


def _costs(sc: Scenario, jobs: list[JobSpec]) -> list[JobSpec]:
    """Each job's parallel fraction and state size, drawn from their own seeded stream (scenario.Scaling)."""
    wl = sc.workload
    rng = random.Random(f"costs-{sc.seed}")
    low, high = wl.scaling.parallel_fraction[0], wl.scaling.parallel_fraction[-1]
    memory = min(dt.memory_gb for dt in sc.cluster.device_types.values())
    declared = random.Random(f"declared-{sc.seed}")  # their own streams: these shares do not change the others
    elastic = random.Random(f"elastic-{sc.seed}")
    ej = wl.elastic_jobs
    out = []
    for j in jobs:
        parallel = 1.0 if wl.scaling.model == "linear" else (low if low == high else rng.uniform(low, high))
        state = wl.state_gb if isinstance(wl.state_gb, (int, float)) else wl.state_gb.sample(rng)
        draw, noise = declared.random(), declared.lognormvariate(0.0, wl.expected_steps.error)
        floor = math.ceil(j.devices * ej.min_fraction) if elastic.random() < ej.share and j.devices > 1 else 0
        out.append(replace(j, parallel=parallel, state_gb=min(float(state), memory),
                           declares=noise if draw < wl.expected_steps.share else 0.0,
                           min_devices=floor if floor < j.devices else 0))
    return out


def _synthetic(sc: Scenario) -> Iterator[JobSpec]:
    syn = sc.workload.synthetic
    assert syn is not None
    rng = random.Random(f"workload-{syn.seed if syn.seed is not None else sc.seed}")
    t = 0.0
    for i in range(syn.jobs):
        t += rng.expovariate(syn.arrival.rate_per_s)
        size = rng.choices(syn.size.choices, weights=syn.size.weights)[0]
        duration = max(syn.duration.sample(rng), 1e-3)
        devices, share = (1, size) if size < 1 else (int(size), 1.0)
        yield JobSpec(id=f"job{i}", arrival=t, devices=devices, duration=duration, share=share)


def _csv_rows(path: Path, field: str) -> csv.DictReader:
    """A CSV file's rows by its header: UTF-8 text, a leading byte-order mark ignored (spreadsheets write one). A
    file that cannot be read (a folder, no permission, another encoding) is a TraceError naming `field`."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceError(f"{field}: {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): "
                         "save it as UTF-8") from None
    except OSError as e:
        raise TraceError(f"{field}: cannot read {path}: {e.strerror or e}") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    if not reader.fieldnames:
        raise TraceError(f"{field}: {path} is empty: expected a CSV with a header line")
    return reader


def _columns(reader: csv.DictReader, cols: dict[str, str], needed: list[str], where: str) -> None:
    header = reader.fieldnames or []
    for role in needed:
        if cols.get(role) not in header:
            raise TraceError(f"{where}: column {cols.get(role)!r} (for {role}) is not in the CSV header {header}")


def _finite(value: str) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(value)
    return number


def _amount(value: str) -> float:
    number = _finite(value)
    if number < 0:
        raise ValueError(value)
    return number


def _count(value: str) -> int:
    number = _amount(value)
    if not number.is_integer():
        raise ValueError(value)
    return int(number)


# What a trace cell must hold, by the reader of its role (a cell that does not is an error naming its line): nan, inf
# and negative device counts made jobs of nan seconds, arrivals at nan and meshes of -2 devices.
CELL_READERS: dict[Callable[[str], float], str] = {
    _finite: "a finite number",  # submit, start and end in seconds, duration
    _amount: "a finite number >= 0",  # gpu_milli
    _count: "a whole number >= 0",  # num_gpu, a node list's devices
}


def _time_reader(fmt: str) -> Callable[[str], float]:
    """`time_format` -> a function from a cell to seconds: numbers, ISO 8601, or a strptime pattern (POSIX seconds,
    UTC unless the value carries its zone)."""
    if fmt == "seconds":
        return _finite
    parse = datetime.fromisoformat if fmt == "iso" else (lambda v: datetime.strptime(v, fmt))

    def read(value: str) -> float:
        when = parse(value.strip())
        return (when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)).timestamp()

    return read


@dataclass
class _Row:
    submit: float
    id: str
    gpus: int
    duration: float
    share: float
    priority: str
    group: str


def _trace(sc: Scenario) -> Iterator[JobSpec]:
    tr = sc.workload.trace
    assert tr is not None
    rows = sorted(_rows(sc), key=lambda r: (r.submit, r.id))
    if tr.partition is not None:
        quota, kept, taken = tr.partition.quotas, [], {}
        for r in rows:
            n = taken.get(r.group, 0)
            if n < quota.get(r.group, tr.partition.others):
                taken[r.group] = n + 1
                kept.append(r)
        rows = kept
    rows = rows[::tr.every]
    if tr.limit is not None:
        rows = rows[:tr.limit]
    t0 = rows[0].submit if rows else 0.0
    arrival_scale = tr.arrival_scale if tr.arrival_scale is not None else tr.time_scale
    for r in rows:
        yield JobSpec(id=r.id, arrival=(r.submit - t0) * arrival_scale, devices=r.gpus,
                      duration=r.duration * tr.time_scale, share=r.share, priority=r.priority, group=r.group)


def _rows(sc: Scenario, skipped: Counter | None = None) -> Iterator[_Row]:
    """The trace's rows that make jobs, in file order (rules in `scenario.Trace`); `skipped` counts the others by
    reason (`SKIPPED`)."""
    skipped = Counter() if skipped is None else skipped
    tr = sc.workload.trace
    assert tr is not None
    cols = tr.column_map()
    prios = tr.priorities()
    path = sc.trace_path()
    read_time = _time_reader(tr.time_format)
    reader = _csv_rows(path, "workload.trace.path")
    header = reader.fieldnames or []
    timing = "duration" if "duration" in cols else "end"
    named = tr.format != "csv" or "job_id" in cols
    _columns(reader, cols, [*(["job_id"] if named else []), "submit", "num_gpu", timing],
             "workload.trace.columns")
    for field_name, rule in (("filter", tr.filter), ("partition", tr.partition)):
        if rule is not None and rule.column not in header:
            raise TraceError(f"workload.trace.{field_name}.column: column {rule.column!r} is not in the CSV "
                             f"header {header}")
    keep = set(tr.filter.values) if tr.filter is not None else None
    has = {role for role, col in cols.items() if col in header}
    lines: dict[str, int] = {}  # job id -> the line that named it
    for n, row in enumerate(reader, start=2):
        if None in row.values():
            raise TraceError(f"workload.trace.path: line {n} of {path}: {sum(v is not None for v in row.values())} "
                             f"fields, the header has {len(header)}")
        if keep is not None and row[tr.filter.column] not in keep:  # type: ignore[union-attr]
            skipped["filter"] += 1
            continue

        def cell(role: str, read: Callable[[str], float], row=row, n=n) -> float:
            value = row[cols[role]]
            try:
                return read(value)
            except (TypeError, ValueError):
                how = CELL_READERS.get(read) or f"in time_format {tr.time_format!r}"
                raise TraceError(f"workload.trace.path: line {n} of {path}: {role} value {value!r} (column "
                                 f"{cols[role]!r}) is not {how}") from None

        submit = cell("submit", read_time)
        if submit < 0:  # was skipped in silence (before start_s, which is >= 0)
            raise TraceError(f"workload.trace.path: line {n} of {path}: submit value {row[cols['submit']]!r} (column "
                             f"{cols['submit']!r}) is before time 0: submit times are seconds >= 0 (dates: 1970 on)")
        if submit < tr.start_s:
            skipped["start_s"] += 1
            continue
        if timing == "duration":
            if not row[cols["duration"]]:
                skipped["running"] += 1  # still running when the trace ended: no duration
                continue
            duration = cell("duration", _finite)
        else:
            start = row[cols["start"]] if "start" in has else None
            if start == "":
                if tr.unscheduled == "skip":
                    skipped["unscheduled"] += 1
                    continue
                start = None
            if not row[cols["end"]]:
                skipped["running"] += 1
                continue
            begin = cell("start", read_time) if start is not None and tr.duration_from == "start" else submit
            duration = cell("end", read_time) - begin
        gpus = cell("num_gpu", _count) if row[cols["num_gpu"]] else 0
        share = 1.0
        if gpus == 0:
            if tr.zero_gpu == "skip":
                skipped["zero_gpu"] += 1
                continue
            gpus = 1
        milli = cell("gpu_milli", _amount) if "gpu_milli" in has and row[cols["gpu_milli"]] else 1000.0
        if gpus == 1 and milli < 1000:
            if tr.fractional == "skip":
                skipped["fractional"] += 1
                continue
            if tr.fractional == "share" and milli > 0:
                share = milli / 1000
        if duration <= 0 or (tr.max_gpus is not None and gpus > tr.max_gpus):
            skipped["no_time" if duration <= 0 else "max_gpus"] += 1
            continue
        if tr.max_duration_s is not None:
            duration = min(duration, tr.max_duration_s)
        prio = prios.get(row[cols["priority"]], "normal") if "priority" in has else "normal"
        job_id = row[cols["job_id"]] if named else f"row{n}"
        first = lines.setdefault(job_id, n)
        if first != n:  # the run keys its jobs by id: two of one id shared their failure and recovery records
            raise TraceError(f"workload.trace.path: line {n} of {path}: job_id {job_id!r} (column {cols['job_id']!r}) "
                             f"is also on line {first}: job ids must be unique (map job_id to a unique column, or "
                             "leave it out of a csv trace's columns: jobs are then named by their row)")
        group = row[tr.partition.column] if tr.partition is not None else ""
        yield _Row(submit, job_id, gpus, duration, share, prio, group)


# why `_rows` left a row out (validate, run and compare count them: `skipped_rows`)
SKIPPED = {
    "running": "with no duration or end (still running when the trace ended)",
    "unscheduled": "with an empty start (never scheduled; unscheduled: keep takes them)",
    "zero_gpu": "asking for 0 devices (zero_gpu: one runs them on one)",
    "fractional": "asking for part of a device (fractional: whole or share takes them)",
    "no_time": "with a duration of 0 or less",
    "max_gpus": "over max_gpus",
    "start_s": "submitted before start_s",
    "filter": "left out by the filter",
}


def skipped_rows(sc: Scenario, specs: list[JobSpec]) -> list[str]:
    """One note saying how many of the trace's rows make jobs and why the others do not (none without a trace,
    or where every row makes a job): a trace's rows left out in silence made a run look like the trace's."""
    tr = sc.workload.trace
    if tr is None:
        return []
    skipped: Counter = Counter()
    kept = sum(1 for _ in _rows(sc, skipped))
    if not skipped:
        return []
    why = ", ".join(f"{n:,} {SKIPPED[k]}" for k, n in skipped.most_common())
    after = f"; {len(specs):,} job{'s' if len(specs) != 1 else ''} after partition, every and limit" \
        if len(specs) != kept else ""
    return [f"note: workload.trace: {kept:,} of {kept + sum(skipped.values()):,} rows of {sc.trace_path().name} make "
            f"jobs; skipped: {why}{after}"]


def check_trace(sc: Scenario) -> None:
    """Raise TraceError when the trace CSV lacks a mapped column, has a bad value, or leaves no job."""
    if sc.workload.trace is not None and next(_trace(sc), None) is None:
        tr = sc.workload.trace
        rules = [f"{name} on column {rule.column!r}" for name, rule in (("filter", tr.filter),
                                                                         ("partition", tr.partition)) if rule]
        rules.append("start_s, zero_gpu, unscheduled, max_gpus, durations <= 0")
        raise TraceError(f"workload.trace: no job left to simulate from {sc.trace_path()} (every row was skipped: "
                         f"{', '.join(rules)}; check them)")


def end_guess(sc: Scenario, specs: list[JobSpec]) -> float:
    """Roughly when the run ends (duration_s, else the last arrival plus the longest job), to size the sampling
    interval and the progress steps."""
    if sc.duration_s is not None:
        return sc.duration_s
    last = specs[-1].arrival if specs else 0.0
    return max(last + max((s.duration for s in specs), default=1.0), 1.0)


def horizon(sc: Scenario, specs: list[JobSpec]) -> float:
    """When the run stops whatever happens: duration_s, else a generous cap (the last arrival plus ten times the
    jobs' total work plus an hour), so a workload that cannot finish still ends."""
    if sc.duration_s is not None:
        return sc.duration_s
    last = specs[-1].arrival if specs else 0.0
    return last + 10 * sum(s.duration for s in specs) + 3600.0


def step_count(spec: JobSpec, wl: Workload) -> int:
    """How many steps a job runs: `steps_per_job`, or steps of about `step_s` (at most `max_steps`)."""
    if wl.step_s is not None:
        return max(1, min(wl.max_steps, math.ceil(spec.duration / wl.step_s)))
    return wl.steps_per_job


def warnings(sc: Scenario, specs: list[JobSpec]) -> list[str]:
    """What may surprise in a scenario that is valid: one line each (printed by validate, run and compare)."""
    lines = skipped_rows(sc, specs)
    groups = node_groups(sc)
    lines += _unused_types(sc, groups)
    devices = sum(g.count * g.devices_per_node for g in groups)
    most = MAX_LOGICAL_PER_DEVICE * max(1, devices)  # the core refuses a larger mesh (controller.py rule 11)
    big = [j.devices for j in specs if devices < j.devices <= most]
    if big:
        lines.append(f"warning: workload: {len(big):,} of {len(specs):,} jobs ask for more devices than the cluster's "
                     f"{devices:,} at the start (up to {max(big):,}): they run with several logical devices per "
                     "device (virtual devices), slower (drop them with workload.trace.max_gpus, or add nodes)")
    refused = [j.devices for j in specs if j.devices > most]
    if refused:
        lines.append(f"warning: workload: {len(refused):,} of {len(specs):,} jobs ask for more than the controller "
                     f"accepts ({MAX_LOGICAL_PER_DEVICE} logical devices per device: {most:,} on the cluster at the "
                     f"start; up to {max(refused):,}): it refuses their meshes and they fail at once (drop them with "
                     "workload.trace.max_gpus, or add nodes)")
    end = end_guess(sc, specs)
    late = [f"faults.{i}" for i, f in enumerate(sc.faults) if f.at is not None and f.at >= end] + \
        [f"elastic.{i}" for i, e in enumerate(sc.elastic) if e.at >= end]
    if late:
        lines.append(f"warning: {', '.join(late)}: at or after the run's "
                     f"{'duration_s' if sc.duration_s is not None else 'expected end'} ({end:,.0f} s): "
                     "it may never happen")
    tr = sc.workload.trace
    if tr is not None and (tr.time_scale != 1 or tr.arrival_scale is not None):
        lines.append(f"note: policy times (LAS thresholds, relocate_after, ...) are simulated seconds: they do not "
                     f"follow workload.trace.time_scale ({tr.time_scale:g}); scale them yourself (policy.params)")
    return lines


def _unused_types(sc: Scenario, groups: list[NodeGroup]) -> list[str]:
    """Device types no node of the run has (the cluster's, elastic adds, the autoscaler's): no job runs on them (a
    typo in a node group's device_type, or a type left over), and the smallest memory_gb still caps every job's
    state."""
    later = [e.add for e in sc.elastic if e.add is not None] + ([sc.autoscaler.node] if sc.autoscaler else [])
    used = {g.device_type for g in groups + later}
    unused = [name for name in sc.cluster.device_types if name not in used]
    if not unused:
        return []
    types = sc.cluster.device_types
    cap = min(types[name].memory_gb for name in used) if used else math.inf
    capping = sorted((types[name].memory_gb, name) for name in unused if types[name].memory_gb < cap)
    return [f"warning: cluster.device_types: {', '.join(map(repr, unused))} {'is' if len(unused) == 1 else 'are'} "
            f"declared but no node has {'it' if len(unused) == 1 else 'them'} (cluster.nodes, node_list, elastic adds, "
            f"autoscaler): no job can run there (nodes have {', '.join(map(repr, sorted(used)))})"
            + (f"; the memory_gb of {capping[0][1]!r} ({capping[0][0]:g}) still caps every job's state_gb" if capping
               else "")]


def node_groups(sc: Scenario) -> list[NodeGroup]:
    """The cluster's node groups: `cluster.nodes`, then the nodes of `cluster.node_list` (consecutive rows with
    the same model and device count form one group)."""
    groups = list(sc.cluster.nodes)
    nl = sc.cluster.node_list
    if nl is None:
        return groups
    cols = nl.column_map()
    path = sc.resolve(nl.path)
    rows: list[tuple[str, int]] = []
    reader = _csv_rows(path, "cluster.node_list.path")
    _columns(reader, cols, ["devices", "model"], "cluster.node_list.columns")
    for n, row in enumerate(reader, start=2):
        value = row[cols["devices"]]
        try:
            devices = _count(value or "0")
        except (TypeError, ValueError):
            raise TraceError(f"cluster.node_list.path: line {n} of {path}: devices value {value!r} (column "
                             f"{cols['devices']!r}) is not {CELL_READERS[_count]}") from None
        if devices > 0:
            rows.append((row[cols["model"]], devices))
    rows = rows[::nl.every]
    if nl.limit is not None:
        rows = rows[:nl.limit]
    if not rows:
        raise TraceError(f"cluster.node_list: no node with devices in {path} (rows with 0 devices are skipped, then "
                         "every and limit apply)")
    unknown = sorted({model for model, _ in rows if model not in sc.cluster.device_types})
    if unknown and nl.default_device_type is None:
        raise TraceError(f"cluster.node_list: models {unknown} are not in cluster.device_types "
                         f"{sorted(sc.cluster.device_types)} (add them, or set default_device_type)")
    for model, devices in rows:
        dtype = model if model in sc.cluster.device_types else nl.default_device_type
        last = groups[-1] if groups and len(groups) > len(sc.cluster.nodes) else None
        if last is not None and last.device_type == dtype and last.devices_per_node == devices \
                and last.labels.get("model") == model:
            groups[-1] = last.model_copy(update={"count": last.count + 1})
        else:
            groups.append(NodeGroup(count=1, devices_per_node=devices, device_type=dtype, labels={"model": model}))
    return groups


# ---------------------------------------------------------------- what a job does


class Steps:
    """A job's instructions: its state tensor (`state_gb` per device, rows sharded over the mesh), and one
    `sim.step` per step that reads the current state and writes the next one (then the old one is deleted).
    A step declares `flops` per device: duration/steps seconds on a speed-1.0 device under the cost model."""

    def __init__(self, spec: JobSpec, wl: Workload, reference_tflops: float, state_bytes: int) -> None:
        self.steps = step_count(spec, wl)
        self.step_s = spec.duration / self.steps
        # Amdahl (scenario.Scaling): on its n devices a step takes step_s = T1 * ((1 - p) + p / n). Each worker pays
        # the serial part T1 * (1 - p) once per step and the parallel part T1 * p / n per logical device it hosts,
        # so a job on fewer workers than logical devices (shrunk, or doubled up) runs T1 * ((1 - p) + p / k).
        # A job asking for a share f < 1 of a device keeps it busy f of the time: each step is f * step_s of
        # device work, then (1 - f) * step_s of the job's own time (waiting for input, serving requests). Alone on
        # a device it runs as fast as on a whole one; sharing a device with others, the busy parts interleave.
        p, n = spec.parallel, spec.devices
        one_device = self.step_s / ((1 - p) + p / n)
        rate = spec.share * reference_tflops * 1e12
        self.flops = one_device * p / n * rate  # per logical device
        self.serial_flops = one_device * (1 - p) * rate  # per worker
        self.think_s = self.step_s * (1 - spec.share)
        rows = max(1, state_bytes // (4 * STATE_COLS))
        n = spec.devices
        self.spec = m.TensorSpec(shape=[n * rows, STATE_COLS], dtype="float32", mesh=0, placements=["S0"])
        self.tid = 1  # the live state tensor of the current session

    def syncs_left(self, done: int, sync_every: int, factor: float) -> int:
        """What the job declares as its expected steps (sync points) from step `done` on; 0 when it does not."""
        if not factor:
            return 0
        every = 1 if self.think_s else sync_every  # a fractional job syncs every step (run_steps)
        return max(1, round(math.ceil((self.steps - done) / every) * factor))

    def setup(self) -> list[m.Instr]:
        self.tid = 1
        return [m.InstrCreate(tid=1, spec=self.spec, init="zeros")]

    def step(self, i: int) -> list[m.Instr]:
        prev, self.tid = self.tid, self.tid + 1
        call = m.InstrCall(op=STEP_OP, mesh=0, args=[m.tensor_slot(prev)],
                           kwargs={"flops": self.flops, "serial_flops": self.serial_flops, "step": i},
                           outs=[m.OutSpec(tid=self.tid, spec=self.spec)], src=f"train.py:{i}")
        return [call, m.InstrDelete(tids=[prev])]


def job(sim, rec: JobRecord):
    """One job's life: arrive, get a mesh, run its steps in synced chunks, close; restart after lost data."""
    env = sim.env
    spec = rec.spec
    wl = sim.scenario.workload
    yield env.timeout(spec.arrival - env.now)
    cap = sim.memory_cap(spec)
    work = Steps(spec, wl, sim.scenario.cost.reference_tflops, sim.state_bytes(spec, cap))
    while True:
        expected = work.syncs_left(rec.steps_done, wl.sync_every, spec.declares)
        opened = yield from sim.ask(lambda r, expected=expected: ev.OpenSession(r, m.OpenSession(
            hello=HELLO, name=spec.id, priority=spec.priority, memory_cap=cap, expected_steps=expected)))
        if isinstance(opened, fx.Refusal):
            rec.failed, rec.error = env.now, f"OpenSession refused: {opened.message}"
            sim.job_ended(rec)
            return
        session = opened.session
        sim.session_opened(session, rec)
        mesh = m.OpenMesh(session=session, mesh=0, devices=list(range(spec.devices)), shape=[spec.devices],
                          min_devices=spec.min_devices)
        placed = yield from sim.ask(lambda r, mesh=mesh: ev.OpenMesh(r, mesh))
        while not isinstance(placed, fx.Refusal) and not placed.placed:
            yield sim.placed_or_timeout(session, wl.retry_s)
            placed = yield from sim.ask(lambda r, mesh=mesh: ev.OpenMesh(r, mesh))
        if isinstance(placed, fx.Refusal):
            rec.failed, rec.error = env.now, f"OpenMesh refused: {placed.message}"
            yield from sim.ask(lambda r, s=session: ev.CloseSession(r, m.CloseSession(session=s)))
            sim.session_closed(session)
            sim.job_ended(rec)  # failed: the run ends when every job finished or failed
            return
        if rec.placed is None:
            rec.placed = env.now
        sim.job_running(rec)
        ok = yield from run_steps(sim, session, work, wl.sync_every, rec)
        yield from sim.ask(lambda r, s=session: ev.CloseSession(r, m.CloseSession(session=s)))
        sim.session_closed(session)
        if ok:
            rec.finished = env.now
            sim.job_ended(rec)
            return
        if wl.on_failure == "fail":
            rec.failed = env.now
            sim.job_ended(rec)
            return
        rec.restarts += 1


def run_steps(sim, session: str, work: Steps, sync_every: int, rec: JobRecord):
    """Submit the remaining steps, syncing every `sync_every`; False when a Sync reports lost work."""
    seq = 0
    first = True
    if work.think_s:
        sync_every = 1  # a fractional job paces itself step by step
    while rec.steps_done < work.steps:
        chunk = min(sync_every, work.steps - rec.steps_done)
        for i in range(chunk):
            seq += 1
            instrs = (work.setup() if first else []) + work.step(rec.steps_done + i)
            first = False
            yield from sim.ask(lambda r, seq=seq, instrs=instrs: ev.Submit(r, m.Submit(session, seq, instrs)))
        reply = yield from sim.ask(lambda r, seq=seq: ev.Sync(r, m.Sync(session, seq, SYNC_TIMEOUT_S)))
        if isinstance(reply, fx.Refusal) or not reply.done or reply.errors:
            if not isinstance(reply, fx.Refusal) and reply.errors:
                rec.error = reply.errors[0].message
            return False
        rec.steps_done += chunk
        if work.think_s:
            yield sim.env.timeout(work.think_s)
    return True
