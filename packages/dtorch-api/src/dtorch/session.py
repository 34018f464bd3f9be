"""One client session: the instruction stream, the data plane and admission, composed.

    Session ── _stream.Stream       queue, sender thread, Submit, Sync, keep-alive
            ├─ _dataplane.DataPlane Pull/Put straight to workers, relocation (_relocate)
            ├─ _admission.place     OpenMesh, queue position on stderr
            └─ _progress.Line       a long sync point's progress on stderr

The session speaks tensor ids and specs only (DTensors are the dispatcher's). Sync points (`fetch`) flush
the stream, wait until every worker has executed it (bounded), raise any op error with the user's source
line, then read shards straight from the workers. Uploads write shards straight to workers.

A sync point that waits long shows it on one stderr line: at once while the session is frozen (preempted: where it
stands in the queue to resume), after BUSY_QUIET_S while its workers are busy (a long step is the user's own
work); the line ends with the outcome.

Early reads: a fetch does not wait for the Sync's answer to ask for the shards. It ends the stream with an
InstrRead naming a fresh read mark, and pulls with that mark (`PullRequest.after`) while the Sync is under way:
each worker serves the pull once the batch with the mark (every write before it) completed there and its report
is on the way, so the bytes come back about when the Sync's answer does, not a Pull's round trip after it. An
early read that fails for any reason (a move, a loss, a stream
that did not reach the mark in EARLY_WAIT_S) is only a miss: the value is read again after the Sync, as without
it. One early read at a time; `DTORCH_EARLY_READS=0` (or `early_reads = False`) turns them off.

The controller knows the session by its API key; each worker by the capability the controller hands out
next to every location (MeshPlaced, SyncReply, the session's own entry in Status): the session passes them
to the data plane with the locations.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from dtorch import _admission
from dtorch._dataplane import DataPlane
from dtorch._progress import Line
from dtorch._relocate import DeviceLost
from dtorch._source import user_src
from dtorch._stream import Stream
from dtorch._uploads import Uploads
from dtorch._version import __version__
from dtorch.errors import env_float
from dtorch_protocol import auth, wire
from dtorch_protocol import messages as m
from dtorch_protocol.tls import Tls

BUSY_QUIET_S = 60.0  # a sync point waiting on busy workers shows its progress from then on


def _show_wait(line: Line, reply: m.SyncReply, waited: float) -> None:
    """A not-done Sync's news on the progress line (module doc)."""
    if reply.frozen:
        where = (f"position {reply.queue_position} in the queue to resume" if reply.queue_position else
                 "it resumes when its devices free up")
        line.show(f"dtorch: sync point waiting {waited:.0f}s: the session is frozen (preempted); {where}")
    elif waited >= BUSY_QUIET_S:
        line.show(f"dtorch: sync point waiting {waited:.0f}s: {reply.message}")


if TYPE_CHECKING:
    from dtorch._spec import Spec
    from dtorch.device_mesh import DeviceMesh
    from dtorch.local_cluster import LocalCluster


class Session:
    """A connection to a controller; every DTensor belongs to one."""

    def __init__(self, controller: str, api_key: str | None = None, *, tls: Tls | None = None, name: str = "",
                 priority: str = "normal", kind: str = "batch", memory_cap: int = 0, min_devices: int = 0,
                 expected_steps: int = 0) -> None:
        self.address = controller
        self.tls = tls  # also for the workers' client ports (the data plane, profiles)
        self.api_key = auth.key_from_env() if api_key is None else api_key
        self.timeout = env_float("DTORCH_TIMEOUT", 300.0)  # bound on any single wait for workers
        self.queue_timeout = env_float("DTORCH_QUEUE_TIMEOUT", 600.0)  # and for devices (a mesh queued, or frozen)
        self.stub = wire.Stub("dtorch.Controller", controller, self.api_key, tls=tls)
        try:
            opened = self.stub.call("OpenSession", m.OpenSession(hello=wire.hello("client", __version__), name=name,
                                                                  priority=priority, kind=kind, memory_cap=memory_cap,
                                                                  expected_steps=expected_steps),
                                    timeout=10.0)
        except ConnectionError as e:
            if str(e).startswith("TLS handshake"):
                raise ConnectionError(str(e)) from None
            raise ConnectionError(f"cannot reach the DTorch controller at {controller}: is dtorch-controller "
                                  "running there? (unset DTORCH_CONTROLLER to start a local cluster)") from None
        except TimeoutError:
            raise ConnectionError(f"the DTorch controller at {controller} did not answer within 10 s") from None
        self.id = opened.session
        self.min_devices = min_devices  # elastic: each mesh accepts this many physical devices (0: all of them)
        self._tids = itertools.count(1)
        self._placed: set[int] = set()
        self._lost: Exception | None = None  # the loss error, once a transfer met a device lost for good
        self._lost_lock = threading.Lock()
        self._uploads = Uploads(opened.recovery)  # kept until they are safe: a rebuild may ask for them again
        self._stream = Stream(self._call, self.id, controller, opened.keepalive_s,
                              on_uploads=lambda reput, safe: self._uploads.heard(reput, safe, self._data))
        # the user thread's per-op calls, bound once (the hot path counts every call):
        self.new_tid: Callable[[], int] = self._tids.__next__  # a fresh tensor id
        self.emit: Callable[[Any], None] = self._stream.emit  # queue an instruction (or a record); never blocks
        self.release: Callable[[int], None] = self._stream.release  # a DTensor's last reference is gone (batched)
        self._data = DataPlane(self.id, self.timeout, self.status, tls=tls)
        # async fetches wait on pulls in the data plane's pool: they must not occupy its threads
        self._fetches = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtorch-fetch")
        self.early_reads = os.environ.get("DTORCH_EARLY_READS", "1") != "0"
        self._early = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtorch-early-read")  # the same rule
        self._early_read: Future | None = None  # the last one, until it ends (one at a time)
        self._marks = itertools.count(1)  # read marks (InstrRead)
        self.reads = {"early": 0, "after_sync": 0}  # how this session's fetches got their values
        self._closed = False
        self.cluster: LocalCluster | None = None  # the local cluster started for this session: close() stops it
        self.step: Any = None  # automatic capture or the compiled step running now (dtorch._capture): told of sync
        # points, uploads and flushes
        self._programs = itertools.count(1)
        # program id -> its instructions (slot form) as last defined, and those of its redistribution operations
        self.programs: dict[int, tuple[list, frozenset[int]]] = {}  # (_capture: a profile reads replays there)

    def _call(self, method: str, request: Any, timeout: float) -> Any:
        return self.stub.call(method, request, timeout=timeout)

    # ------------------------------------------------------------------ the instruction stream
    def flush(self) -> None:
        """Send everything queued so far, in order."""
        self._boundary("a flush")
        self._stream.flush()

    def new_program_id(self) -> int:
        return next(self._programs)

    # ------------------------------------------------------------------ meshes and seeds
    def ensure_mesh(self, mesh: DeviceMesh) -> None:
        """Have the controller place the mesh's logical devices; waits in its queue, showing the position."""
        if mesh.id in self._placed:
            return
        self._data.learn(*_admission.place(self._call, self.id, mesh, self.min_devices))
        self._placed.add(mesh.id)

    @staticmethod
    def next_seed() -> int:
        """A random op's seed, drawn from torch's default generator: `torch.manual_seed(s)` (transformers'
        `set_seed`, Lightning's `seed_everything`) and `torch.set_rng_state` govern DTensor random values as they
        do plain ones, and the values never depend on the mesh, the placements or the plan (one draw per op)."""
        return int(torch.empty((), dtype=torch.int64).random_())

    # ------------------------------------------------------------------ sync points
    def _boundary(self, why: str) -> None:
        """A boundary of the step running now (`_capture` rule 7), told by the thread that runs it; another
        thread's uploads and sync points end automatic capture instead (rule 10)."""
        step = self.step
        if step is None:
            return
        if step.owner == threading.get_ident():
            step.interrupt(why)
        else:
            step.foreign()

    def sync(self, carry: bool = True) -> None:
        """Wait until the workers executed everything issued so far; raise the first op error, if any. `carry`: the
        last batch rides in the Sync (`_stream` rule 7), not for a thread that must not stop the stream (a background
        fetch, which was a sync point for the step when it was asked for: `fetch_async`)."""
        if carry:
            self._boundary("a sync point")
        self._uploads.check()
        uploads, keep = self._uploads.kept(), []
        line, started, outcome = Line(), time.monotonic(), "failed"  # the user thread's waits show progress
        try:
            for reply in self._stream.sync(self.timeout, carry, self.queue_timeout):
                self._data.learn(reply.locations, reply.caps)
                if reply.reput:
                    self._uploads.put_again(reply.reput, self._data)
                keep = reply.keep
                if carry and not reply.done:
                    _show_wait(line, reply, time.monotonic() - started)
            outcome = "done"
        finally:
            line.end(f"dtorch: sync point {outcome} after {time.monotonic() - started:.0f}s")
            self._uploads.check()  # an upload a rebuild asked for that could not be made again (the sender's too)
        self._uploads.safe(uploads, keep)

    def _loss(self, lost: DeviceLost) -> Exception:
        """The error a sync raises about a loss; every transfer that meets it raises the same one."""
        with self._lost_lock:
            if self._lost is not None:
                return self._lost
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - that is the one
                self._lost = e
                return e
            return lost

    def fetch(self, tid: int, spec: Spec, carry: bool = True) -> torch.Tensor:
        """The full value of tensor `tid` (laid out as `spec`) on the client (early when it can: module doc)."""
        early = self._read_early(tid, spec) if carry else None
        self.sync(carry)
        if early is not None:
            # the future is done with: kept, it held the value, or a miss whose traceback (re-raised here) held the
            # caller's frames, their DTensors and so their shards on the workers, until the next early read
            self._early_read = None
            try:
                value = early.result()
            except Exception as e:  # noqa: BLE001 - a miss (module doc): read it now, the ordinary way
                e.__traceback__ = None
            else:
                self.reads["early"] += 1
                return value
        self.reads["after_sync"] += 1
        try:
            return self._data.read(tid, spec)
        except DeviceLost as e:
            raise self._loss(e) from None

    def _read_early(self, tid: int, spec: Spec) -> Future | None:
        """Mark the read in the stream and start pulling with that mark (module doc); None when it cannot."""
        if not self.early_reads or self._closed or self._stream.broken or (self._early_read is not None
                                                            and not self._early_read.done()):
            return None
        self._boundary("a sync point")  # before the InstrRead: it belongs to no step
        mark = next(self._marks)
        self.emit(m.InstrRead(tid=tid, mark=mark))
        self._early_read = self._early.submit(self._data.read, tid, spec, mark)
        return self._early_read

    def fetch_async(self, tid: int, spec: Spec) -> Future:
        """`fetch` in the background, in call order (the tensor should not change meanwhile)."""
        self._stream.check_open()
        self._boundary("a sync point")
        return self._fetches.submit(self.fetch, tid, spec, False)  # the user thread goes on streaming

    # ------------------------------------------------------------------ uploads
    def upload(self, tensor: torch.Tensor, spec: Spec) -> int:
        """Write each device's shard of `tensor` straight to its worker; returns the new tensor id."""
        self._stream.check_open()
        self._boundary("an upload")
        self.ensure_mesh(spec.mesh)
        tensor = tensor.detach().to("cpu", spec.dtype)
        tid = self.new_tid()
        sent = self._data.spread(spec, tensor.numel() * tensor.element_size())  # replicated: sent once, gathered
        sent_tid = tid if sent is None else self.new_tid()
        try:
            self._data.write(tensor, sent or spec, sent_tid)
        except DeviceLost as e:
            raise self._loss(e) from None
        self.emit(m.InstrAdopt(tid=sent_tid, spec=(sent or spec).to_wire()))
        self._uploads.keep(sent_tid, tensor, sent or spec)
        if sent is not None:
            self.emit(m.InstrRedistribute(src=sent_tid, dst=tid, src_spec=sent.to_wire(), dst_spec=spec.to_wire(),
                                          src_line=user_src()))
            self.emit(m.InstrDelete(tids=[sent_tid]))
        return tid

    # ------------------------------------------------------------------ admin and shutdown
    def status(self) -> m.StatusReply:
        reply = self.stub.call("Status", m.StatusRequest(), timeout=10.0)
        mine = next((s for s in reply.sessions if s.session == self.id), None)
        if mine is not None:  # fresh capabilities for its workers (relocation, or the old ones near expiry)
            self._data.learn({}, mine.caps)
        return reply

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        """`with dtorch.connect(...) as s:` closes the session when the block ends (and the local cluster started
        for it, if any); the next DTensor opens a new default session."""
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the session's tensors on the cluster and stop the local cluster started for it, if any."""
        if self._closed:
            return
        if self.step is not None:  # a replay sends what it matched, automatic capture stops (dtorch._capture)
            self.step.close()
        try:
            if not self._stream.broken:
                self._stream.flush()
            self.stub.call("CloseSession", m.CloseSession(session=self.id), timeout=5.0)
        except Exception:  # noqa: BLE001
            pass  # the controller frees a vanished session's shards itself
        self._closed = True
        self._stream.close()
        self._data.close()
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self._early.shutdown(wait=False, cancel_futures=True)
        self.stub.close()
        if self.cluster is not None:
            self.cluster.stop()
