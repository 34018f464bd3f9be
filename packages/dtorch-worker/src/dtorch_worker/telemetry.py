"""What a worker measures about itself: each command's time, tensor bytes moved by path, batches and memory.

The executor calls `Telemetry.observe` after every command it ran; the server calls `bytes_moved` for what it serves
or receives. From that come the Prometheus series (served on `--metrics-port`) and, for sessions whose client
asked (`Profile` RPC, `dtorch.profile()`), per-command records (`profiler.Profiler`).

series (prefix dtorch_worker_)  type       labels             meaning
op_seconds                      histogram  op                 one command's time: its aten op (aten.mm.default),
                                                              or create, redistribute, collective (the time to
                                                              issue it: its last step may finish later),
                                                              copy_shards, restore_shards
moved_bytes_total               counter    path, direction    tensor bytes; path: point_to_point (pieces between
                                                              workers), collective, copy (snapshots, restores,
                                                              moves) or client (Pull, Put); direction: in or out
batches_total                   counter                       Execute batches run
busy_seconds_total              counter                       seconds spent running batches
memory_used_bytes               gauge                         bytes of the shards and copies held (all sessions)
memory_capacity_bytes           gauge                         the device memory the controller plans with
memory_capped_bytes             gauge                         the sum of the capped sessions' memory caps here

Point-to-point bytes are counted where they land (`in`, from the redistribution's plan) and where they are
served (`out`); collective bytes where they land (`in`, what each op received from the other ranks); client
bytes where they enter or leave; copies where they are served or pushed. The bytes that land for a session
(pieces, collectives, uploads) and the bytes its client reads are also counted per session
(`TensorStore.count_traffic`): the controller bills them (usage records).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dtorch_protocol import messages as m
from dtorch_protocol.exposition import CallbackCounters
from dtorch_protocol.values import dtype_from_name
from dtorch_worker.profiler import Profiler

# op times span microseconds (a small add) to seconds (a large matmul, a redistribution of gigabytes)
OP_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
PATHS = ("point_to_point", "collective", "copy", "client")
COMMUNICATION = (m.CmdRedistribute, m.CmdCollective, m.CmdSendShards, m.CmdFetchShards)  # the rest computes


def op_name(cmd: m.Cmd) -> str:
    """The `op` label of a command: the aten op of a run, else what the command does ("" for bookkeeping)."""
    if isinstance(cmd, m.CmdRun):
        return cmd.op
    return _NAMES.get(type(cmd), "")


_NAMES = {m.CmdCreate: "create", m.CmdRedistribute: "redistribute", m.CmdCollective: "collective",
          m.CmdSendShards: "copy_shards", m.CmdFetchShards: "restore_shards"}


def received_bytes(cmd: m.CmdRedistribute, is_local: Callable[[str], bool]) -> int:
    """Bytes a redistribution pulls from other workers: its plan's remote pieces."""
    itemsize = dtype_from_name(cmd.dtype).itemsize
    total = 0
    for plan in cmd.plans.values():
        for group in plan.groups:
            for piece in group:
                if not is_local(piece.address):
                    n = itemsize
                    for s in piece.size:
                        n *= s
                    total += n
    return total


class Telemetry:
    """The worker's series, in a registry of its own (several workers may share a process in tests)."""

    def __init__(self, used_bytes: Callable[[], int] = lambda: 0, capacity_bytes: int = 0,
                 capped_bytes: Callable[[], int] = lambda: 0, batches: Callable[[], float] = lambda: 0,
                 busy_s: Callable[[], float] = lambda: 0.0,
                 traffic: Callable[[str, int], None] = lambda session, n: None) -> None:
        self.traffic = traffic  # per-session bytes for the controller's usage records (store.count_traffic)
        self.registry = CollectorRegistry(auto_describe=True)
        self.profiler = Profiler(busy_s)
        self.is_local: Callable[[str], bool] = lambda address: not address
        self.op_seconds = Histogram("dtorch_worker_op_seconds", "Time one command took on this worker, by aten op "
                                    "(or create, redistribute, copy_shards, restore_shards)", ["op"],
                                    buckets=OP_BUCKETS, registry=self.registry)
        self.moved = Counter("dtorch_worker_moved_bytes", "Tensor bytes moved, by path (point_to_point, collective, "
                             "copy, client, shared_memory: a client's through a same-host segment) and direction "
                             "(in, out)", ["path", "direction"], registry=self.registry)
        self.registry.register(CallbackCounters({
            "dtorch_worker_batches": ("Execute batches run", batches),
            "dtorch_worker_busy_seconds": ("Seconds spent running batches", busy_s)}))
        Gauge("dtorch_worker_memory_used_bytes", "Bytes of shards and copies held", registry=self.registry,
              ).set_function(used_bytes)
        Gauge("dtorch_worker_memory_capacity_bytes", "Device memory the controller plans with",
              registry=self.registry).set(capacity_bytes)
        Gauge("dtorch_worker_memory_capped_bytes", "Sum of the memory caps of the capped sessions here",
              registry=self.registry).set_function(capped_bytes)
        for path in PATHS:  # every series exists from the start (a rate over a counter that appears later is wrong)
            for direction in ("in", "out"):
                self.moved.labels(path, direction)
        self._ops: dict[str, Any] = {}  # op -> its histogram child (labels() is slow on the hot path)

    def observe(self, session: str, cmd: m.Cmd, started: float, ended: float, outputs: Callable[[], int]) -> None:
        """The executor ran `cmd` of `session` from `started` to `ended` (perf_counter); `outputs()` sizes its
        outputs (asked only when the session is being profiled)."""
        seconds = ended - started
        name = op_name(cmd)
        moved = 0
        if name:
            child = self._ops.get(name)
            if child is None:
                child = self._ops[name] = self.op_seconds.labels(name)
            child.observe(seconds)
            moved = received_bytes(cmd, self.is_local) if isinstance(cmd, m.CmdRedistribute) else 0
            if moved:
                self.moved.labels("point_to_point", "in").inc(moved)
                self.traffic(session, moved)
        if isinstance(cmd, m.CmdCloseSession):
            self.profiler.discard(session)  # a window its client never closed ends with the session
        elif self.profiler.recording(session):
            self.profiler.record(session, name, cmd, time.time() - (time.perf_counter() - started), seconds,
                                 isinstance(cmd, COMMUNICATION), moved, outputs() if name else 0)

    def collective_in(self, session: str, dst: int, n: int) -> None:
        """A collective op of `session`'s redistribution into tensor `dst` received `n` bytes (on its lane)."""
        self.moved.labels("collective", "in").inc(n)
        self.traffic(session, n)
        if self.profiler.recording(session):
            self.profiler.received(session, dst, n)

    def bytes_moved(self, path: str, direction: str, n: int, session: str = "") -> None:
        """`n` bytes moved by the server; `session` for those billed to it (a client's uploads and reads)."""
        if n:
            self.moved.labels(path, direction).inc(n)
            if session:
                self.traffic(session, n)
