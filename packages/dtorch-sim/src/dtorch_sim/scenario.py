"""What a simulation runs: the scenario YAML, as pydantic models.

A scenario names a cluster (node groups of devices of a few types), a workload (synthetic or a real
trace), the placement policy, faults, elastic events, heartbeat settings, a seed and a time limit.
`load(path)` returns a `Scenario` or raises `ScenarioError` whose lines each name one field path and
what was expected there.

Relative trace paths are resolved against the folder of the scenario file first, then against the
current directory; the first that exists wins (`Scenario.trace_path()`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ScenarioError(Exception):
    """A scenario that cannot be run; `lines` holds one message per mistake."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class Cluster(_Model):
    device_types: dict[str, DeviceType] = Field(min_length=1)
    nodes: list[NodeGroup] = Field(min_length=1)

    @model_validator(mode="after")
    def _types_known(self) -> Cluster:
        for group in self.nodes:
            if group.device_type not in self.device_types:
                raise ValueError(f"node group device_type {group.device_type!r} is not one of device_types "
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


class Arrival(_Model):
    process: Literal["poisson"] = "poisson"
    rate_per_s: float = Field(gt=0)


class Sizes(_Model):
    """Devices per job: drawn from `choices` with `weights` (equal when omitted)."""

    choices: list[int] = Field(min_length=1)
    weights: list[float] | None = None

    @field_validator("choices")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(c < 1 for c in v):
            raise ValueError("every job size must be >= 1 device")
        return v

    @model_validator(mode="after")
    def _weights(self) -> Sizes:
        if self.weights is not None and (len(self.weights) != len(self.choices) or any(w < 0 for w in self.weights)
                                         or not sum(self.weights) > 0):
            raise ValueError(f"weights must be {len(self.choices)} non-negative numbers, not all zero")
        return self


class Synthetic(_Model):
    jobs: int = Field(ge=1)
    arrival: Arrival
    size: Sizes
    duration: Distribution  # seconds of work on a speed-1.0 device, without contention
    seed: int | None = None  # defaults to the scenario seed


ITP_COLUMNS = {"job_id": "job_id", "submit": "submission_time", "duration": "duration", "num_gpu": "num_gpu"}
OPENB_COLUMNS = {"job_id": "name", "submit": "creation_time", "end": "deletion_time", "num_gpu": "num_gpu",
                 "gpu_milli": "gpu_milli"}


class Trace(_Model):
    """Jobs from a CSV: ITP (`job_id, submission_time, duration, num_gpu`) or openb pods
    (`name, creation_time, deletion_time, num_gpu, gpu_milli`). `columns` overrides the default names."""

    format: Literal["itp", "openb"]
    path: str
    columns: dict[Literal["job_id", "submit", "duration", "end", "num_gpu", "gpu_milli"], str] = {}
    start_s: float = Field(0.0, ge=0)  # skip jobs submitted before this trace time
    limit: int | None = Field(None, ge=1)  # at most this many jobs (after start_s and filtering)
    time_scale: float = Field(1.0, gt=0)  # multiply submit times and durations (0.01: 100x faster)
    max_gpus: int | None = Field(None, ge=1)  # drop jobs asking for more devices
    zero_gpu: Literal["skip", "one"] = "skip"  # openb pods with num_gpu 0
    fractional: Literal["whole", "skip"] = "whole"  # openb pods with gpu_milli < 1000: one whole device, or skip

    def column_map(self) -> dict[str, str]:
        return {**(ITP_COLUMNS if self.format == "itp" else OPENB_COLUMNS), **self.columns}


class Workload(_Model):
    synthetic: Synthetic | None = None
    trace: Trace | None = None
    steps_per_job: int = Field(10, ge=1)  # step batches a job submits (each: one matmul on its whole mesh)
    sync_every: int = Field(5, ge=1)  # steps between Syncs; a Sync is a checkpoint for restarts
    on_failure: Literal["restart", "fail"] = "restart"  # a job whose worker was lost: resume elsewhere, or give up
    retry_s: float = Field(10.0, gt=0)  # wait before asking again when a mesh is not placed
    priorities: dict[Literal["high", "normal", "low"], float] = {}  # weights of each job's class (empty: normal)

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
    whole cluster), or a slow worker. Without a target, a random alive worker/node is hit."""

    kind: Literal["worker_failure", "node_failure", "slow_worker"]
    at: float | None = Field(None, ge=0)
    mtbf_s: float | None = Field(None, gt=0)
    worker: str | None = None  # "node3/gpu1"
    node: str | None = None  # "node3"
    mode: Literal["silent", "crash"] = "silent"  # silent: only heartbeats notice; crash: sends fail at once
    factor: float = Field(0.5, gt=0)  # slow_worker: speed multiplier
    until: float | None = Field(None, gt=0)  # slow_worker: back to normal speed at this time

    @model_validator(mode="after")
    def _when(self) -> Fault:
        if (self.at is None) == (self.mtbf_s is None):
            raise ValueError("give exactly one of at or mtbf_s")
        if self.kind == "node_failure" and self.worker is not None:
            raise ValueError("a node_failure names a node, not a worker")
        if self.kind != "node_failure" and self.node is not None and self.worker is not None:
            raise ValueError("name a worker or a node, not both")
        if self.until is not None and (self.kind != "slow_worker" or self.at is None or self.until <= self.at):
            raise ValueError("until is for slow_worker faults with at, and must be later than at")
        return self


class Elastic(_Model):
    """Nodes joining (`add_nodes`, a group like the cluster's) or leaving (`remove_nodes`, by name or count)."""

    at: float = Field(ge=0)
    action: Literal["add_nodes", "remove_nodes"]
    add: NodeGroup | None = None
    nodes: list[str] = []
    count: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _what(self) -> Elastic:
        if self.action == "add_nodes" and self.add is None:
            raise ValueError("add_nodes needs `add` (a node group: count, devices_per_node, device_type)")
        if self.action == "remove_nodes" and not self.nodes and self.count is None:
            raise ValueError("remove_nodes needs `nodes` (names) or `count` (the newest nodes leave)")
        return self


# ---------------------------------------------------------------- the rest


class Heartbeat(_Model):
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _order(self) -> Heartbeat:
        if self.timeout_s <= self.interval_s:
            raise ValueError(f"timeout_s ({self.timeout_s}) must exceed interval_s ({self.interval_s})")
        return self


class Policy(_Model):
    name: str = "fifo"
    params: dict[str, object] = {}


class CostModel(_Model):
    """Seconds for a command = flops / (reference_tflops * 1e12 * device speed) + launch_s."""

    reference_tflops: float = Field(100.0, gt=0)
    launch_s: float = Field(0.0, ge=0)
    matrix_k: int = Field(1024, ge=1)  # inner size of the jobs' matmuls
    rpc_latency_s: float = Field(0.0, ge=0)  # controller -> worker delivery delay


class Metrics(_Model):
    sample_interval_s: float | None = Field(None, gt=0)  # utilization timeline step (default: 1/200 of the run)


class Scenario(_Model):
    name: str = "scenario"
    seed: int = 0
    duration_s: float | None = Field(None, gt=0)  # stop here even if jobs are still running
    cluster: Cluster
    workload: Workload
    policy: Policy = Policy()
    heartbeat: Heartbeat = Heartbeat()
    faults: list[Fault] = []
    elastic: list[Elastic] = []
    cost: CostModel = CostModel()
    metrics: Metrics = Metrics()
    base_dir: str = Field(".", exclude=True)  # folder of the scenario file, for relative paths

    def trace_path(self) -> Path:
        """The trace CSV: relative to the scenario file's folder, else to the current directory."""
        assert self.workload.trace is not None
        p = Path(self.workload.trace.path).expanduser()
        if p.is_absolute():
            return p
        here = Path(self.base_dir) / p
        return here if here.exists() or not p.exists() else p


def format_errors(err: ValidationError, prefix: str = "") -> list[str]:
    """One line per pydantic error: `field.path: what was expected (got ...)`."""
    lines = []
    for e in err.errors():
        path = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
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
    from dtorch_sim.policies import POLICIES, UnknownPolicy, known, make_policy

    if sc.policy.name not in POLICIES:
        raise ScenarioError([f"{prefix}policy.name: unknown policy {sc.policy.name!r}: known policies are {known()}"])
    try:
        make_policy(sc.policy.name, sc.policy.params)
    except UnknownPolicy as e:
        raise ScenarioError([f"{prefix}policy.params: {e}"]) from None
    if sc.workload.trace is not None and not sc.trace_path().exists():
        raise ScenarioError([f"{prefix}workload.trace.path: file {sc.workload.trace.path!r} not found (looked in "
                             f"{base_dir} and in the current directory)"])
    return sc


def load(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ScenarioError([f"{path}: cannot read: {e.strerror or e}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ScenarioError([f"{path}:{where} not valid YAML: {getattr(e, 'problem', None) or e}"]) from None
    return parse(data, str(path.parent), str(path))
