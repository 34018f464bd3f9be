"""What a simulation runs: the scenario YAML, as pydantic models.

A scenario names a cluster (node groups of devices of a few types, or a node-list CSV), a workload
(synthetic or a real trace), the scheduling policy, faults, elastic events and an autoscaler, heartbeat
and recovery settings, the cost model, a seed and a time limit. `load(path)` returns a `Scenario` or
raises `ScenarioError` whose lines each name one field path and what was expected there.

Relative CSV paths (traces, node lists) are resolved against the folder of the scenario file first,
then against the current directory; the first that exists wins (`Scenario.resolve()`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from dtorch_controller.core.policies import DEFAULT_POLICY

# What one simulator process is built for; a scenario over these is a mistake (a count with three zeros too many),
# refused in one line: past them it ran out of memory or spent minutes building workers before printing anything.
LIMITS = {
    "devices": 100_000,  # at most, at any time: the cluster, elastic adds, the autoscaler's max_nodes (16 s, 0.5 GB)
    "synthetic_jobs": 1_000_000,  # at most, workload.synthetic.jobs (validate generates them: 18 s, 0.6 GB)
    "samples": 1_000_000,  # at most, the run's length / metrics.sample_interval_s (each a pass over the pool)
    "heartbeat_events": 100_000_000,  # at most, the run's length x min(devices, batch_slots) / heartbeat.interval_s
    "heartbeat_interval_s": 0.01,  # at least (the controller's default is 0.2 s)
    "retry_s": 1.0,  # at least: a queued job is woken when placed, retries are a safety net (one event each)
    "steps": 100_000,  # at most, a job's steps_per_job or max_steps (a step is a batch on each of its workers)
    "mtbf_s": 1.0,  # at least, a recurring fault's mean time between failures (a microsecond ran forever)
    "check_interval_s": 1.0,  # at least, the autoscaler's (a microsecond ran forever)
}


class ScenarioError(Exception):
    """A scenario that cannot be run; `lines` holds one message per mistake."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # a number is finite (inf: nonsense)


# ---------------------------------------------------------------- cluster


class DeviceType(_Model):
    speed: float = Field(1.0, gt=0, description="relative to the cost model's reference device")
    memory_gb: float = Field(80.0, gt=0)


class NodeGroup(_Model):
    count: int = Field(ge=1)
    devices_per_node: int = Field(8, ge=1)
    device_type: str
    labels: dict[str, str] = {}
    name: str = "node"  # nodes are named "{name}{index}", the index counting over the whole cluster


class NodeList(_Model):
    """Nodes from a CSV, one row per node: the openb node list (`sn, gpu, model`) or any CSV with a device
    count and a model column. Rows with 0 devices are skipped; `every` keeps every k-th node (a smaller
    cluster with the same mix), `limit` the first n of those."""

    path: str
    columns: dict[Literal["name", "devices", "model"], str] = {}
    every: int = Field(1, ge=1)
    limit: int | None = Field(None, ge=1)
    default_device_type: str | None = None  # for models missing from cluster.device_types (else an error)

    def column_map(self) -> dict[str, str]:
        return {"name": "sn", "devices": "gpu", "model": "model", **self.columns}


class Cluster(_Model):
    device_types: dict[str, DeviceType] = Field(min_length=1)
    nodes: list[NodeGroup] = []
    node_list: NodeList | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_device_type(cls, data: Any) -> Any:
        """A cluster of one device type need not name it: `device_types` defaults to one, `gpu` (speed 1, 80 GB),
        and a node group without a `device_type` takes the only one there is."""
        if not isinstance(data, dict):
            return data
        types = data.get("device_types") or {"gpu": {}}
        data = {**data, "device_types": types}
        if isinstance(types, dict) and len(types) == 1 and isinstance(data.get("nodes"), list):
            only = next(iter(types))
            data["nodes"] = [{"device_type": only, **g} if isinstance(g, dict) else g for g in data["nodes"]]
        return data

    @model_validator(mode="after")
    def _types_known(self) -> Cluster:
        if not self.nodes and self.node_list is None:
            raise ValueError("give nodes (a list of node groups) or node_list (a CSV of nodes)")
        for group in self.nodes:
            if group.device_type not in self.device_types:
                raise ValueError(f"node group device_type {group.device_type!r} is not one of device_types "
                                 f"{sorted(self.device_types)}")
        nl = self.node_list
        if nl is not None and nl.default_device_type is not None and nl.default_device_type not in self.device_types:
            raise ValueError(f"node_list.default_device_type {nl.default_device_type!r} is not one of device_types "
                             f"{sorted(self.device_types)}")
        return self


# ---------------------------------------------------------------- workload


class Distribution(_Model):
    """A positive random quantity: constant, exponential, uniform or lognormal."""

    dist: Literal["constant", "exponential", "uniform", "lognormal"]
    value: float | None = Field(None, gt=0)  # constant
    mean: float | None = Field(None, gt=0)  # exponential, lognormal (mean of the distribution itself)
    sigma: float = Field(1.0, gt=0)  # lognormal: sigma of the underlying normal
    low: float | None = Field(None, gt=0)  # uniform
    high: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _params(self) -> Distribution:
        need = {"constant": ("value",), "exponential": ("mean",), "lognormal": ("mean",), "uniform": ("low", "high")}
        missing = [f for f in need[self.dist] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.dist} distribution needs {', '.join(missing)}")
        if self.dist == "uniform" and self.low > self.high:  # type: ignore[operator]
            raise ValueError(f"uniform needs low <= high, got low={self.low} high={self.high}")
        return self

    def sample(self, rng) -> float:
        if self.dist == "constant":
            return self.value  # type: ignore[return-value]
        if self.dist == "exponential":
            return rng.expovariate(1.0 / self.mean)  # type: ignore[operator]
        if self.dist == "uniform":
            return rng.uniform(self.low, self.high)
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # type: ignore[arg-type]
        return rng.lognormvariate(mu, self.sigma)


def _number_or_distribution(value: Any) -> str:
    return "(distribution)" if isinstance(value, (dict, Distribution)) else "(number)"


# A number, or a distribution to draw it from: a mapping is read as a distribution, anything else as a number, so a
# mistake gets one line about the branch it meant (the tags, in parentheses, are left out of the path: format_errors).
NumberOrDistribution = Annotated[Annotated[float, Tag("(number)")] | Annotated[Distribution, Tag("(distribution)")],
                                 Discriminator(_number_or_distribution)]


class Arrival(_Model):
    process: Literal["poisson"] = "poisson"
    rate_per_s: float = Field(gt=0)


class Sizes(_Model):
    """Devices per job, drawn from `choices` with `weights` (equal when omitted). A choice below 1 is a
    fraction of one device (0.5: half a GPU), which packing policies may share."""

    choices: list[float] = Field(min_length=1)
    weights: list[float] | None = None

    @field_validator("choices")
    @classmethod
    def _positive(cls, v: list[float]) -> list[float]:
        if any(not (0 < c < 1 or (c >= 1 and float(c).is_integer())) for c in v):
            raise ValueError("every job size must be a whole number of devices >= 1, or a fraction in (0, 1)")
        return v

    @model_validator(mode="after")
    def _weights(self) -> Sizes:
        if self.weights is not None and (len(self.weights) != len(self.choices) or any(w < 0 for w in self.weights)
                                         or not sum(self.weights) > 0):
            raise ValueError(f"weights must be {len(self.choices)} non-negative numbers, not all zero")
        return self


Priority = Literal["high", "normal", "low"]


class Synthetic(_Model):
    jobs: int = Field(ge=1, le=LIMITS["synthetic_jobs"])
    arrival: Arrival
    size: Sizes
    duration: Distribution  # seconds of work on a speed-1.0 device, without contention
    seed: int | None = None  # defaults to the scenario seed


ITP_COLUMNS = {"job_id": "job_id", "submit": "submission_time", "duration": "duration", "num_gpu": "num_gpu"}
OPENB_COLUMNS = {"job_id": "name", "submit": "creation_time", "end": "deletion_time", "start": "scheduled_time",
                 "num_gpu": "num_gpu", "gpu_milli": "gpu_milli", "priority": "qos"}
OPENB_PRIORITIES = {"LS": "high", "Guaranteed": "high", "Burstable": "normal", "BE": "low"}
Column = Literal["job_id", "submit", "duration", "start", "end", "num_gpu", "gpu_milli", "priority"]
TIMED = ("submit", "start", "end")  # the roles `time_format` applies to (a duration is always seconds)


class _CellValues(_Model):
    """Values compared with a CSV's cells, which are text: `values: [1, 2]` in YAML means the cells "1" and "2" (numbers
    were refused: 'Input should be a valid string')."""

    model_config = ConfigDict(_Model.model_config, coerce_numbers_to_str=True)


class RowFilter(_CellValues):
    """Keep only the rows whose `column` holds one of `values` (e.g. one virtual cluster of a multi-cluster trace)."""

    column: str
    values: list[str] = Field(min_length=1)


class Partition(_CellValues):
    """Split the jobs by the value of `column` (e.g. the virtual cluster): each job is tagged with its value (its
    *group*: a column of jobs.csv, JCT per group in metrics.json), and at most `quotas[value]` jobs of each value
    are kept, the earliest submitted first. Values without a quota are dropped (`others: N` keeps N of each)."""

    column: str
    quotas: dict[str, int] = Field(min_length=1)
    others: int = Field(0, ge=0)

    @field_validator("quotas")
    @classmethod
    def _counts(cls, v: dict[str, int]) -> dict[str, int]:
        bad = sorted(k for k, n in v.items() if n < 1)
        if bad:
            raise ValueError(f"a quota is a number of jobs >= 1, got {', '.join(f'{k}: {v[k]}' for k in bad)}")
        return v


class Trace(_Model):
    """Jobs from a CSV: ITP (`job_id, submission_time, duration, num_gpu`), openb pods (`name, creation_time,
    scheduled_time, deletion_time, num_gpu, gpu_milli, qos`), or any CSV (`csv`: `columns` names the column of
    each role; at least submit, num_gpu, and duration or end; without a job_id column jobs are named by their
    row). Rows may come in any order (jobs are sorted by submit time)."""

    format: Literal["itp", "openb", "csv"]
    path: str
    columns: dict[Column, str] = {}
    # how submit, start and end values read: "seconds" (numbers), "iso" (ISO 8601 dates and times) or a strptime
    # pattern such as "%Y-%m-%d %H:%M:%S"; dates become POSIX seconds (UTC unless the value names its zone)
    time_format: str = "seconds"
    filter: RowFilter | None = None
    partition: Partition | None = None
    start_s: float = Field(0.0, ge=0)  # skip jobs submitted before this trace time
    every: int = Field(1, ge=1)  # keep every k-th job (a lighter load over the same time span)
    limit: int | None = Field(None, ge=1)  # at most this many jobs (after start_s and filtering)
    time_scale: float = Field(1.0, gt=0)  # multiply submit times and durations (0.01: 100x faster)
    arrival_scale: float | None = Field(None, gt=0)  # multiply submit times by this instead (more load: "inflation")
    max_gpus: int | None = Field(None, ge=1)  # drop jobs asking for more devices
    max_duration_s: float | None = Field(None, gt=0)  # cap durations (trace seconds, before time_scale)
    zero_gpu: Literal["skip", "one"] = "skip"  # jobs with num_gpu 0
    # openb pods with gpu_milli < 1000: a whole device, skipped, or that share of a device (packing policies
    # then put several on one device, others still give each a whole device)
    fractional: Literal["whole", "skip", "share"] = "whole"
    duration_from: Literal["start", "submit"] = "start"  # with start and end: duration = end - start (or - submit)
    unscheduled: Literal["skip", "keep"] = "skip"  # rows with an empty start (never scheduled in production)
    priority_map: dict[str, Priority] | None = None  # column value -> priority (openb default: LS high, BE low)

    @model_validator(mode="after")
    def _roles(self) -> Trace:
        if self.format == "csv":
            cols = self.columns
            missing = [r for r in ("submit", "num_gpu") if r not in cols]
            if "duration" not in cols and "end" not in cols:
                missing.append("duration or end")
            if missing:
                raise ValueError(f"format csv needs columns for submit, num_gpu, and duration or end: add "
                                 f"{', '.join(missing)} to workload.trace.columns (role: CSV column name)")
        if self.time_format not in ("seconds", "iso") and "%" not in self.time_format:
            raise ValueError(f"time_format must be 'seconds', 'iso' or a strptime pattern such as "
                             f"'%Y-%m-%d %H:%M:%S', got {self.time_format!r}")
        return self

    def column_map(self) -> dict[str, str]:
        base = {"itp": ITP_COLUMNS, "openb": OPENB_COLUMNS, "csv": {}}[self.format]
        return {**base, **self.columns}

    def priorities(self) -> dict[str, str]:
        if self.priority_map is not None:
            return dict(self.priority_map)
        return dict(OPENB_PRIORITIES) if self.format == "openb" else {}


class Scaling(_Model):
    """How a job's step time depends on the devices it runs on (Amdahl's law with a per-job parallel fraction p).

    A job's trace duration is its time on the devices it asked for (n). On k workers (k < n after a shrink, or
    with several logical devices per worker) a step takes `T1 * ((1 - p) + p / k)`, `T1` being its one-device step
    time, so it runs `((1 - p) + p / k) / ((1 - p) + p / n)` times slower than on n. `linear` is p = 1 (half the
    devices, twice the time). p is drawn per job, uniformly in `parallel_fraction` ([low, high]; one value: fixed)."""

    model: Literal["amdahl", "linear"] = "amdahl"
    parallel_fraction: list[float] = Field([0.95, 1.0], min_length=1, max_length=2)

    @field_validator("parallel_fraction")
    @classmethod
    def _fraction(cls, v: list[float]) -> list[float]:
        if any(not 0 < p <= 1 for p in v) or v != sorted(v):
            raise ValueError(f"a parallel fraction is in (0, 1]: give [low, high] or one value, got {v}")
        return v


class Declared(_Model):
    """Jobs that tell the controller how many steps they will run (`dtorch.connect(expected_steps=...)`): a share
    of the jobs, each declaring its true count of sync points times a lognormal error (median 1, sigma `error`)."""

    share: float = Field(0.0, ge=0, le=1)
    error: float = Field(0.0, ge=0)


class ElasticJobs(_Model):
    """Jobs that accept fewer devices than they ask for (`dtorch.connect(min_devices=k)`): a share of the
    multi-device jobs, each accepting `ceil(devices * min_fraction)`. A policy that shrinks may take the rest
    instead of freezing them; every policy may start them on that few when devices are short."""

    share: float = Field(0.0, ge=0, le=1)
    min_fraction: float = Field(0.5, gt=0, le=1)


class Workload(_Model):
    synthetic: Synthetic | None = None
    trace: Trace | None = None
    # A job is a session that runs its work as steps (one simulated training step per batch on its whole mesh):
    # `steps_per_job` steps each, or steps of about `step_s` seconds of work (at most `max_steps`).
    steps_per_job: int = Field(10, ge=1, le=LIMITS["steps"])
    step_s: float | None = Field(None, gt=0)
    max_steps: int = Field(100, ge=1, le=LIMITS["steps"])
    sync_every: int = Field(5, ge=1)  # steps between Syncs; a Sync is the job's durable point for restarts
    # live state (weights, optimizer) per device, what moves, snapshots and offloads copy: a number, or a
    # distribution drawn per job (capped at the smallest device memory)
    state_gb: NumberOrDistribution = Field(2.0)
    scaling: Scaling = Scaling()
    expected_steps: Declared = Declared()
    elastic_jobs: ElasticJobs = ElasticJobs()
    on_failure: Literal["restart", "fail"] = "restart"  # a job whose data was lost: resume elsewhere, or give up
    # a queued job asks again at least this often (it is also woken when placed)
    retry_s: float = Field(60.0, ge=LIMITS["retry_s"])
    # weights of each job's priority class, drawn per job (empty: "normal", or the trace's own classes)
    priorities: dict[Priority, float] = {}

    @field_validator("state_gb")
    @classmethod
    def _state(cls, v: float | Distribution) -> float | Distribution:
        if not isinstance(v, Distribution) and not v > 0:
            raise ValueError(f"state_gb is gigabytes > 0 per device, or a distribution, got {v}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> Workload:
        if (self.synthetic is None) == (self.trace is None):
            raise ValueError("give exactly one of workload.synthetic or workload.trace")
        if self.priorities and (any(w < 0 for w in self.priorities.values()) or not sum(self.priorities.values())):
            raise ValueError("priorities are weights: >= 0, not all 0")
        return self


# ---------------------------------------------------------------- faults and elasticity


class Fault(_Model):
    """A worker or node failure (`at` a time, or recurring with mean time between failures `mtbf_s` over the
    whole cluster), a slow worker, or a network partition between workers and the controller. Without a
    target, a random alive worker/node is hit. `repair_s`: the failed workers (or, for a partition, workers
    the controller fenced) start again after this long and register anew."""

    kind: Literal["worker_failure", "node_failure", "slow_worker", "partition"]
    at: float | None = Field(None, ge=0)
    mtbf_s: float | None = Field(None, ge=LIMITS["mtbf_s"])
    worker: str | None = None  # "node3/gpu1"
    node: str | None = None  # "node3"
    mode: Literal["silent", "crash"] = "silent"  # silent: only heartbeats notice; crash: sends fail at once
    factor: float = Field(0.5, gt=0)  # slow_worker: speed multiplier
    until: float | None = Field(None, gt=0)  # slow_worker / partition: back to normal at this time
    duration_s: float | None = Field(None, gt=0)  # slow_worker / partition: back to normal after this long
    repair_s: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _when(self) -> Fault:
        if (self.at is None) == (self.mtbf_s is None):
            raise ValueError("give exactly one of at or mtbf_s")
        if self.kind == "node_failure" and self.worker is not None:
            raise ValueError("a node_failure names a node, not a worker")
        if self.kind != "node_failure" and self.node is not None and self.worker is not None:
            raise ValueError("name a worker or a node, not both")
        timed = self.kind in ("slow_worker", "partition")
        if (self.until is not None or self.duration_s is not None) and not timed:
            raise ValueError("until and duration_s are for slow_worker and partition faults")
        if self.until is not None and self.duration_s is not None:
            raise ValueError("give until or duration_s, not both")
        if self.until is not None and (self.at is None or self.until <= self.at):
            raise ValueError("until needs at, and must be later than at (use duration_s with mtbf_s)")
        if self.kind == "partition" and self.until is None and self.duration_s is None:
            raise ValueError("a partition needs until or duration_s (when it heals)")
        if self.repair_s is not None and self.kind == "slow_worker":
            raise ValueError("repair_s is for failures and partitions")
        return self


class Elastic(_Model):
    """Nodes joining (`add_nodes`, a group like the cluster's) or leaving (`remove_nodes`, by name or count).
    Leaving nodes are drained (their devices' shards move to other workers first; a drain the core refuses for
    lack of room is asked again every 30 s) or killed (like a failure)."""

    at: float = Field(ge=0)
    action: Literal["add_nodes", "remove_nodes"]
    add: NodeGroup | None = None
    nodes: list[str] = []
    count: int | None = Field(None, ge=1)
    mode: Literal["drain", "kill"] = "drain"
    drain_timeout_s: float = Field(3600.0, gt=0)  # a worker not drained by then (nowhere to move to) is stopped

    @model_validator(mode="after")
    def _what(self) -> Elastic:
        if self.action == "add_nodes" and self.add is None:
            raise ValueError("add_nodes needs `add` (a node group: count, devices_per_node, device_type)")
        if self.action == "remove_nodes" and not self.nodes and self.count is None:
            raise ValueError("remove_nodes needs `nodes` (names) or `count` (the newest nodes leave)")
        return self


class Autoscaler(_Model):
    """Every `check_interval_s`: when at least `scale_up_queued` sessions wait, ask for `step` more nodes of
    `node` (they join after `provision_s`), up to `max_nodes` added; when nothing waits, drain one added node
    whose devices were all unleased for `scale_down_idle_s`, down to `min_nodes` added."""

    node: NodeGroup  # count is ignored: one node per step
    check_interval_s: float = Field(60.0, ge=LIMITS["check_interval_s"])
    scale_up_queued: int = Field(1, ge=1)
    step: int = Field(1, ge=1)
    provision_s: float = Field(0.0, ge=0)
    max_nodes: int = Field(ge=0)
    min_nodes: int = Field(0, ge=0)
    scale_down_idle_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaler:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) must not exceed max_nodes ({self.max_nodes})")
        return self


# ---------------------------------------------------------------- the rest


class Heartbeat(_Model):
    """How often workers report when they have nothing else to say (a report after a batch counts too), and
    when the controller declares a silent one lost. Large clusters in long runs can use long intervals."""

    interval_s: float = Field(1.0, ge=LIMITS["heartbeat_interval_s"])
    timeout_s: float = Field(5.0, gt=0)
    # Heartbeats (and the core's heartbeat deadlines) are due on a grid of interval_s / batch_slots and share one
    # simulator event per grid point: a report is at most that much later than exact timing. 0: exact timing.
    batch_slots: int = Field(64, ge=0)

    @model_validator(mode="after")
    def _order(self) -> Heartbeat:
        if self.timeout_s <= self.interval_s:
            raise ValueError(f"timeout_s ({self.timeout_s}) must exceed interval_s ({self.interval_s})")
        return self


class Recovery(_Model):
    """The core's own fault tolerance: snapshot every live shard after this many batches (or once this old)
    and replay the log after a loss. 0 batches: off, a job whose worker is lost restarts from its last Sync."""

    snapshot_every_batches: int = Field(0, ge=0)
    snapshot_every_s: float = Field(1e12, gt=0)


class Controller(_Model):
    """Settings of the core that are not the policy's (`dtorch_controller.core.Config`)."""

    # at most this many batches of a session sent and not completed on a worker (pipeline rule 7): a freeze
    # takes effect within that many steps, not after everything sent since the job's last sync point; 0: no bound.
    # 1 by default, as `dtorch-controller` runs (its --dispatch-ahead): the simulator models the deployed controller
    dispatch_ahead: int = Field(1, ge=0)


class Policy(_Model):
    name: str = DEFAULT_POLICY  # the controller's default, which a scenario with no policy shows
    params: dict[str, object] = {}
    params_for: dict[str, dict[str, object]] = {}  # per-policy parameters (name -> params), for `run` and `compare`

    def for_name(self, name: str) -> dict[str, object]:
        if name in self.params_for:
            return dict(self.params_for[name])
        return dict(self.params) if name == self.name else {}


class CostModel(_Model):
    """Seconds for a command: flops / (reference_tflops * 1e12 * device speed) + launch_s; a copy of shards
    takes bytes / bandwidth: `network_gbps` between workers, `host_gbps` to or from this worker's host memory."""

    reference_tflops: float = Field(100.0, gt=0)
    launch_s: float = Field(0.0, ge=0)
    rpc_latency_s: float = Field(0.0, ge=0)  # controller -> worker delivery delay
    network_gbps: float = Field(100.0, gt=0)  # gigabits per second, worker to worker
    host_gbps: float = Field(200.0, gt=0)  # gigabits per second, device <-> host memory


class Metrics(_Model):
    sample_interval_s: float | None = Field(None, gt=0)  # timeline step (default: 1/200 of the run)


class Scenario(_Model):
    name: str = "scenario"
    seed: int = 0
    duration_s: float | None = Field(None, gt=0)  # stop here even if jobs are still running
    cluster: Cluster
    workload: Workload
    policy: Policy = Policy()
    heartbeat: Heartbeat = Heartbeat()
    recovery: Recovery = Recovery()
    controller: Controller = Controller()
    faults: list[Fault] = []
    elastic: list[Elastic] = []
    autoscaler: Autoscaler | None = None
    cost: CostModel = CostModel()
    metrics: Metrics = Metrics()
    base_dir: str = Field(".", exclude=True)  # folder of the scenario file, for relative paths

    def resolve(self, path: str) -> Path:
        """A CSV path: relative to the scenario file's folder, else to the current directory."""
        p = Path(path).expanduser()
        if p.is_absolute():
            return p
        here = Path(self.base_dir) / p
        return here if here.exists() or not p.exists() else p

    def trace_path(self) -> Path:
        assert self.workload.trace is not None
        return self.resolve(self.workload.trace.path)

    def with_policy(self, name: str) -> Scenario:
        """The same scenario under another policy (its parameters from `policy.params_for`)."""
        return self.model_copy(update={"policy": self.policy.model_copy(update={"name": name,
                                                                                "params": self.policy.for_name(name)})})


def format_errors(err: ValidationError, prefix: str = "") -> list[str]:
    """One line per pydantic error: `field.path: what was expected (got ...)`."""
    lines = []
    for e in err.errors():
        loc = [str(x) for x in e["loc"] if not str(x).startswith("(")]
        msg = e["msg"].removeprefix("Value error, ")
        if len(loc) > 1 and loc[-1] == "[key]":  # a mapping's key, not a field: "workload.priorities: key 'urgent'"
            *loc, key = loc[:-1]
            lines.append(f"{prefix}{'.'.join(loc) or '(top level)'}: key {key!r}: {msg}")
            continue
        path = ".".join(loc) or "(top level)"
        if e["type"] in ("missing",):
            msg = "required field is missing"
        elif e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        elif "input" in e and not isinstance(e["input"], (dict, list)) and e["type"] not in ("value_error",):
            msg += f" (got {e['input']!r})"
        lines.append(f"{prefix}{path}: {msg}")
    return lines


def parse(data: object, base_dir: str = ".", source: str = "") -> Scenario:
    prefix = f"{source}: " if source else ""
    if not isinstance(data, dict):
        raise ScenarioError([f"{prefix}(top level): expected a mapping of scenario fields, got {type(data).__name__}"])
    try:
        sc = Scenario.model_validate({**data, "base_dir": base_dir})
    except ValidationError as e:
        raise ScenarioError(format_errors(e, prefix)) from None
    from dtorch_sim.policies import UnknownPolicy, is_known, known, make_policy

    lines = []
    if not is_known(sc.policy.name):
        lines.append(f"{prefix}policy.name: unknown policy {sc.policy.name!r}: known policies are {known()}")
    else:
        try:
            make_policy(sc.policy.name, sc.policy.params)
        except UnknownPolicy as e:
            lines.append(f"{prefix}policy.params: {e}")
    for name, params in sc.policy.params_for.items():
        if not is_known(name):
            lines.append(f"{prefix}policy.params_for.{name}: unknown policy {name!r}: known policies are {known()}")
            continue
        try:
            make_policy(name, params)
        except UnknownPolicy as e:
            lines.append(f"{prefix}policy.params_for.{name}: {e}")
    if sc.workload.trace is not None and not sc.trace_path().exists():
        lines.append(f"{prefix}workload.trace.path: file {sc.workload.trace.path!r} not found (looked in "
                     f"{base_dir} and in the current directory)")
    if sc.cluster.node_list is not None and not sc.resolve(sc.cluster.node_list.path).exists():
        lines.append(f"{prefix}cluster.node_list.path: file {sc.cluster.node_list.path!r} not found (looked in "
                     f"{base_dir} and in the current directory)")
    if lines:
        raise ScenarioError(lines)
    from dtorch_sim.jobs import TraceError, check_trace, node_groups

    try:
        groups = node_groups(sc)
        check_trace(sc)
    except TraceError as e:
        raise ScenarioError([f"{prefix}{e}"]) from None
    devices = _devices_at_most(sc, groups)
    if devices > LIMITS["devices"]:
        raise ScenarioError([f"{prefix}cluster: {devices:,} devices at most (the cluster, elastic adds and the "
                             f"autoscaler's max_nodes) is over the {LIMITS['devices']:,} a simulation runs"])
    lines = [f"{prefix}{line}" for line in _unknown_targets(sc, groups)]
    if lines:
        raise ScenarioError(lines)
    return sc


def _unknown_targets(sc: Scenario, groups: list[NodeGroup]) -> list[str]:
    """Faults and removals that name a node or worker no run can have (a typo was a fault that never happened, with
    no word). Nodes are `{group name}{index}`, the index counting over the whole cluster, and workers `NODE/gpuN`;
    the nodes that may join later (elastic adds, the autoscaler) take the indexes after the cluster's."""
    devices: dict[str, int] = {}  # node -> its devices
    for group in groups:
        for _ in range(group.count):
            devices[f"{group.name}{len(devices)}"] = group.devices_per_node
    later = [e.add for e in sc.elastic if e.add is not None] + ([sc.autoscaler.node] if sc.autoscaler else [])
    first = len(devices)
    joining = sum(g.count for g in later[:len(later) - bool(sc.autoscaler)]) + \
        (sc.autoscaler.max_nodes if sc.autoscaler else 0)
    for group in later:
        for index in range(first, first + joining):
            devices[f"{group.name}{index}"] = max(devices.get(f"{group.name}{index}", 0), group.devices_per_node)
    example = next(iter(devices), "node0")
    lines = []
    for i, fault in enumerate(sc.faults):
        if fault.node is not None and fault.node not in devices:
            lines.append(f"faults.{i}.node: no node {fault.node!r} in the cluster (nodes are named like {example!r})")
        if fault.worker is not None:
            node, _, gpu = fault.worker.partition("/gpu")
            if not (node in devices and gpu.isdigit() and int(gpu) < devices[node]):
                lines.append(f"faults.{i}.worker: no worker {fault.worker!r} in the cluster (workers are named like "
                             f"'{example}/gpu0')")
    for i, event in enumerate(sc.elastic):
        if event.count is not None and event.count > len(devices):  # it took every node, silently
            lines.append(f"elastic.{i}.count: {event.count:,} nodes to remove, more than the {len(devices):,} the run "
                         "can have")
        unknown = [n for n in event.nodes if n not in devices]
        if unknown:
            lines.append(f"elastic.{i}.nodes: no node {', '.join(map(repr, unknown))} in the cluster (nodes are named "
                         f"like {example!r})")
    return lines


def _devices_at_most(sc: Scenario, groups: list[NodeGroup]) -> int:
    """The most devices the run may hold at once: the cluster, every elastic add, the autoscaler's max_nodes."""
    added = sum(e.add.count * e.add.devices_per_node for e in sc.elastic if e.add is not None)
    scaler = sc.autoscaler.max_nodes * sc.autoscaler.node.devices_per_node if sc.autoscaler is not None else 0
    return sum(g.count * g.devices_per_node for g in groups) + added + scaler


def override(data: object, assignment: str) -> object:
    """Apply one `dotted.path=value` (value in YAML: `48`, `fifo`, `{high: 1, low: 3}`) to scenario data; list
    items by index (`cluster.nodes.0.count=48`). Raises ScenarioError naming the assignment."""
    path, sep, text = assignment.partition("=")
    if not sep or not path:
        raise ScenarioError([f"--set {assignment}: expected path=value, e.g. cluster.nodes.0.count=48"])
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ScenarioError([f"--set {assignment}: the value is not valid YAML: {getattr(e, 'problem', None) or e}"]) \
            from None
    keys = path.split(".")
    node = data
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ScenarioError([f"--set {assignment}: {'.'.join(keys[:i]) or '(top)'} has no item {key!r} "
                                     f"(a list of {len(node)})"])
            if last:
                node[int(key)] = value
            node = node[int(key)]
        elif isinstance(node, dict):
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, {})
        else:
            raise ScenarioError([f"--set {assignment}: {'.'.join(keys[:i])} is not a mapping or a list"])
    return data


def load(path: str | Path, overrides: list[str] = ()) -> Scenario:  # type: ignore[assignment]
    """Read a scenario file, apply `--set path=value` overrides, validate."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ScenarioError([f"{path}: cannot read: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                             f"{e.start})"]) from None
    except OSError as e:
        raise ScenarioError([f"{path}: cannot read: {e.strerror or e}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ScenarioError([f"{path}:{where} not valid YAML: {getattr(e, 'problem', None) or e}"]) from None
    for assignment in overrides:
        data = override(data, assignment)
    return parse(data, str(path.parent), str(path))
