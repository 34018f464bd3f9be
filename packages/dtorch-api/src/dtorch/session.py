"""One client session: the instruction stream to the controller and the data plane to workers.

The user thread only appends instructions to a queue; a sender thread ships them to the
controller in batches. Sync points (`fetch`) flush the queue, wait until every worker has
executed it (bounded), raise any op error with the user's source line, then read shards
straight from the workers. Uploads (`distribute_tensor`) write shards straight to workers.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
import torch

from dtorch._relocate import Moved, Watch, relocating
from dtorch._version import __version__
from dtorch.errors import ClusterError, DTorchError, RemoteOpError
from dtorch_protocol import messages as m
from dtorch_protocol import wire
from dtorch_protocol.layout import coords, gather_groups, holds_value, shard_box
from dtorch_protocol.values import dtype_name, tensor_from_bytes, tensor_to_bytes

if TYPE_CHECKING:
    from dtorch._spec import Spec
    from dtorch.device_mesh import DeviceMesh
    from dtorch.dtensor import DTensor

MAX_BATCH = 4096  # instructions per Submit


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {os.environ[name]!r}") from None


def _drain(q: deque) -> list:
    out = []
    try:
        while True:
            out.append(q.popleft())
    except IndexError:
        return out


def _slices(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in box)


class Session:
    """A connection to a controller; every DTensor belongs to one."""

    def __init__(self, controller: str, token: str | None = None, *, name: str = "", priority: str = "normal",
                 kind: str = "batch", memory_cap: int = 0, min_devices: int = 0) -> None:
        self.address = controller
        self.token = wire.token_from_env() if token is None else token
        self.timeout = _env_float("DTORCH_TIMEOUT", 300.0)  # bound on any single wait for workers
        self.stub = wire.Stub("dtorch.Controller", controller, self.token)
        try:
            opened = self.stub.call("OpenSession", m.OpenSession(hello=wire.hello("client", __version__), name=name,
                                                                  priority=priority, kind=kind, memory_cap=memory_cap),
                                    timeout=10.0)
        except ConnectionError:
            raise ConnectionError(f"cannot reach the DTorch controller at {controller}: is dtorch-controller "
                                  "running there? (unset DTORCH_CONTROLLER to start a local cluster)") from None
        except TimeoutError:
            raise ConnectionError(f"the DTorch controller at {controller} did not answer within 10 s") from None
        self.id = opened.session
        self.min_devices = min_devices  # elastic: each mesh accepts this many physical devices (0: all of them)
        self._keepalive_s, self._keepalive_at = opened.keepalive_s, time.monotonic()
        self._tids = itertools.count(1)
        self._queue: deque = deque()
        self._dead: deque = deque()
        self._send_lock = threading.Lock()
        self._seq = 0
        self._broken: Exception | None = None  # a failed Submit: the stream can no longer be trusted
        self._locations: dict[int, str] = {}
        self._placed: set[int] = set()
        self._workers: dict[str, wire.Stub] = {}
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dtorch-io")
        # async fetches wait on pulls in `_pool`: they must not occupy its threads (a pool waiting on itself)
        self._fetches = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtorch-fetch")
        self._seed, self._rng_counter = 0, 0
        self._wake = threading.Event()
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="dtorch-sender", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------------ the instruction stream
    def new_tid(self) -> int:
        return next(self._tids)

    def emit(self, instr: Any) -> None:
        """Queue an instruction; never blocks on the cluster."""
        q = self._queue
        q.append(instr)
        if len(q) >= 512:
            self._wake.set()

    def release(self, tid: int) -> None:
        """The last reference to a DTensor is gone: free its shards (batched)."""
        self._dead.append(tid)

    def _send_loop(self) -> None:
        while not self._closed:
            self._wake.wait(0.005)
            self._wake.clear()
            if (self._queue or len(self._dead) > 64) and self._broken is None:
                try:
                    self.flush()
                except Exception:  # recorded in _broken, raised at the next sync point
                    pass
            if self._keepalive_s and time.monotonic() - self._keepalive_at >= self._keepalive_s:
                self._keepalive_at = time.monotonic()  # the controller closes sessions that fall silent
                try:
                    self.stub.call("KeepAlive", m.KeepAlive(session=self.id), timeout=5.0)
                except Exception:
                    pass

    def flush(self) -> None:
        """Send everything queued so far, in order."""
        with self._send_lock:
            if self._broken is not None:
                raise self._broken
            dead = _drain(self._dead)  # before the queue: every use of a dead tid is already queued
            instrs = _drain(self._queue)
            if dead:
                instrs.append(m.InstrDelete(tids=dead))
            for start in range(0, len(instrs), MAX_BATCH):
                self._seq += 1
                try:
                    self.stub.call("Submit", m.Submit(session=self.id, seq=self._seq,
                                                      instrs=instrs[start:start + MAX_BATCH]), timeout=60.0)
                except Exception as e:
                    self._broken = ClusterError(f"lost the instruction stream to the controller at "
                                                f"{self.address}: {e}")
                    raise self._broken from None

    # ------------------------------------------------------------------ meshes
    def ensure_mesh(self, mesh: DeviceMesh) -> None:
        """Have the controller place the mesh's logical devices; waits in its queue, showing the position."""
        if mesh.id in self._placed:
            return
        deadline = time.monotonic() + _env_float("DTORCH_QUEUE_TIMEOUT", 600.0)
        shown = False
        while True:
            reply = self.stub.call("OpenMesh", m.OpenMesh(session=self.id, mesh=mesh.id, devices=list(mesh.devices),
                                                          shape=list(mesh.shape), min_devices=self.min_devices),
                                   timeout=30.0)
            if reply.placed:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"{mesh} could not be placed: {reply.message or 'no free devices'}")
            line = f"dtorch: waiting for {mesh.size()} devices ({reply.message or 'queued'}); " \
                   f"position {reply.queue_position} in the queue"
            sys.stderr.write("\r" + line.ljust(100))
            sys.stderr.flush()
            shown = True
            time.sleep(0.2)
        if shown:
            sys.stderr.write("\r" + "dtorch: devices placed".ljust(100) + "\n")
        self._locations.update(reply.locations)
        self._placed.add(mesh.id)

    def next_seed(self) -> int:
        """The next seed of this session's random stream (see `dtorch.manual_seed`)."""
        self._rng_counter += 1
        z = (self._seed * 0x9E3779B97F4A7C15 + self._rng_counter * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 30)) * 0x94D049BB133111EB) & (2**64 - 1)
        return (z ^ (z >> 31)) & (2**63 - 1)

    def manual_seed(self, seed: int) -> None:
        self._seed, self._rng_counter = int(seed), 0

    # ------------------------------------------------------------------ sync points
    def sync(self) -> None:
        """Wait until the workers executed everything issued so far; raise the first op error, if any."""
        self.flush()
        deadline = time.monotonic() + self.timeout
        while True:
            wait = max(0.1, min(30.0, deadline - time.monotonic()))
            reply = self.stub.call("Sync", m.Sync(session=self.id, upto=self._seq, timeout_s=wait),
                                   timeout=wait + 10.0)
            self._locations.update(reply.locations)
            if reply.errors:
                first = reply.errors[0]
                err: DTorchError = RemoteOpError(first.op, first.src, first.message) if first.src else \
                    ClusterError(first.message)
                for more in reply.errors[1:4]:
                    err.add_note(f"also: {more.op} at {more.src}: {more.message}")
                if len(reply.errors) > 4:
                    err.add_note(f"and {len(reply.errors) - 4} more errors")
                raise err
            if reply.done:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"workers did not finish within {self.timeout:.0f} s (DTORCH_TIMEOUT): "
                                   f"{reply.message}")

    def _worker(self, address: str) -> wire.Stub:
        stub = self._workers.get(address)
        if stub is None:
            stub = self._workers[address] = wire.Stub("dtorch.Worker", address, self.token)
        return stub

    def _address(self, device: int) -> str:
        address = self._locations.get(device)
        if address is None:
            raise ClusterError(f"logical device {device} is not placed on any worker")
        return address

    def _pull(self, tid: int, device: int) -> torch.Tensor:
        return relocating(self, device, lambda address: self._pull_from(address, tid, device))

    def _pull_from(self, address: str, tid: int, device: int) -> torch.Tensor:
        call, replies = self._worker(address).open_stream(
            "Pull", m.PullRequest(session=self.id, tid=tid, device=device, timeout_s=self.timeout),
            timeout=self.timeout + 10.0)
        with Watch(self, device, address, call.cancel) as watch:
            try:
                return self._receive(replies)
            except (ConnectionError, wire.RemoteError):
                if watch.fired:
                    raise Moved(f"moved: logical device {device} left {address}") from None
                raise

    @staticmethod
    def _receive(replies: Any) -> torch.Tensor:
        parts: list[bytes] = []
        dtype, shape = "", []
        for chunk in replies:
            if chunk.report is not None:
                raise RemoteOpError(chunk.report.op, chunk.report.src, chunk.report.message)
            if chunk.error:
                raise (Moved if chunk.kind == m.ErrorKind.MOVED else DTorchError)(chunk.error)
            if chunk.dtype:
                dtype, shape = chunk.dtype, chunk.shape
            parts.append(chunk.data)
        return tensor_from_bytes(b"".join(parts), dtype, shape)

    def fetch(self, dt: DTensor) -> torch.Tensor:
        """The full value of `dt` on the client: reads one replica of each distinct shard."""
        self.sync()
        spec = dt._spec
        groups, op = gather_groups(spec.shape, spec.mesh.shape, spec.placements)
        jobs = [[(box, self._pool.submit(self._pull, dt._tid, spec.mesh.devices[flat]))
                 for flat, box in group if all(n for _, n in box)] for group in groups]
        parts = []
        for group in jobs:
            full = torch.empty(spec.shape, dtype=spec.dtype)
            for box, future in group:
                full[_slices(box)] = future.result()
            parts.append(full)
        if op is None:
            return parts[0]
        stacked = torch.stack(parts)
        if op == "sum":
            return stacked.sum(0, dtype=spec.dtype) if spec.dtype != torch.bool else stacked.any(0)
        if op == "avg":
            return stacked.mean(0) if spec.dtype.is_floating_point else stacked.sum(0) // len(parts)
        return stacked.amax(0) if op == "max" else stacked.amin(0)

    def fetch_async(self, dt: DTensor) -> Future:
        """`fetch` in the background, in call order (`dt` should not change meanwhile: DTensor.to_torch_async
        passes a copy)."""
        return self._fetches.submit(self.fetch, dt)

    # ------------------------------------------------------------------ uploads
    def upload(self, tensor: torch.Tensor, spec: Spec) -> int:
        """Write each device's shard of `tensor` straight to its worker; returns the new tensor id."""
        self.ensure_mesh(spec.mesh)
        tensor = tensor.detach().to("cpu", spec.dtype)
        tid = self.new_tid()
        futures = []
        for flat, c in enumerate(coords(spec.mesh.shape)):
            box = shard_box(spec.shape, spec.mesh.shape, spec.placements, c)
            local = tensor[_slices(box)] if holds_value(spec.placements, c) else torch.zeros(
                [n for _, n in box], dtype=spec.dtype)
            futures.append(self._pool.submit(self._put, tid, spec.mesh.devices[flat], local))
        for f in futures:
            f.result()
        self.emit(m.InstrAdopt(tid=tid, spec=spec.to_wire()))
        return tid

    def _put(self, tid: int, device: int, local: torch.Tensor) -> None:
        relocating(self, device, lambda address: self._put_to(address, tid, device, local))

    def _put_to(self, address: str, tid: int, device: int, local: torch.Tensor) -> None:
        data = tensor_to_bytes(local)
        dtype, shape = dtype_name(local.dtype), list(local.shape)
        stub = self._worker(address)
        future = stub.send_stream_future(
            "Put", (m.PutChunk(session=self.id, tid=tid, device=device, dtype=dtype, shape=shape, data=bytes(c))
                    for c in wire.chunks(data)), timeout=self.timeout)
        with Watch(self, device, address, future.cancel) as watch:
            try:
                stub.decode_reply("Put", future)
            except (ConnectionError, wire.RemoteError, grpc.FutureCancelledError):
                if watch.fired:
                    raise Moved(f"moved: logical device {device} left {address}") from None
                raise

    # ------------------------------------------------------------------ admin and shutdown
    def status(self) -> m.StatusReply:
        return self.stub.call("Status", m.StatusRequest(), timeout=10.0)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._broken is None:
                self.flush()
            self.stub.call("CloseSession", m.CloseSession(session=self.id), timeout=5.0)
        except Exception:
            pass  # the controller frees a vanished session's shards itself
        self._closed = True
        self._wake.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fetches.shutdown(wait=False, cancel_futures=True)
        for stub in self._workers.values():
            stub.close()
        self.stub.close()
