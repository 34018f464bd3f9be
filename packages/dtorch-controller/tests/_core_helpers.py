"""What the core's tests share: a fake-clock harness that drives the controller core through `handle()` (no gRPC,
no threads, no sleeping), and the instructions and commands they submit and look for."""

from __future__ import annotations

import itertools
from typing import Any

from dtorch_controller.core import Config, ControllerCore, Notice, Refusal, Reply, SendExecute, SetTimer, counter_ids
from dtorch_controller.core import events as ev
from dtorch_protocol import messages as m
from dtorch_protocol import shared
from dtorch_protocol.wire import hello


class Harness:
    """Feeds events at a fake time, keeps the timers the core asks for and fires them as time advances."""

    def __init__(self, policy: Any = None, session_ids: Any = None, **config: Any) -> None:
        self.now = 100.0
        self.core = ControllerCore(Config(**config), session_ids=session_ids or counter_ids("sess"), policy=policy)
        self.timers: dict[Any, float] = {}
        self.sent: list[SendExecute] = []  # every SendExecute so far
        self.replies: dict[Any, Any] = {}  # request id -> reply message (also late ones)
        self.notices: list[Notice] = []  # what the core said happened, in order
        self._rids = itertools.count(1)

    def handle(self, event: ev.Event) -> list[Any]:
        effects = self.core.handle(self.now, event)
        for effect in effects:
            if isinstance(effect, SetTimer):
                self.timers[effect.key] = effect.at
            elif isinstance(effect, SendExecute):
                self.sent.append(effect)
            elif isinstance(effect, Reply):
                assert effect.request_id not in self.replies, "a request was answered twice"
                self.replies[effect.request_id] = effect.message
            elif isinstance(effect, Notice):
                self.notices.append(effect)
        return effects

    def ask(self, cls: type, msg: Any) -> tuple[Any, Any]:
        """Send a request event; returns (request id, reply or None when it is still pending)."""
        rid = next(self._rids)
        self.handle(cls(rid, msg))
        return rid, self.replies.get(rid)

    def call(self, cls: type, msg: Any) -> Any:
        """A request that must be answered at once."""
        rid, reply = self.ask(cls, msg)
        assert rid in self.replies, f"{cls.__name__} was not answered at once"
        return reply

    def advance(self, dt: float) -> None:
        """Move the clock, firing due timers in deadline order."""
        end = self.now + dt
        while True:
            due = sorted((at, repr(key), key) for key, at in self.timers.items() if at <= end)
            if not due:
                break
            at, _, key = due[0]
            del self.timers[key]
            self.now = max(self.now, at)
            self.handle(ev.TimerFired(key))
        self.now = end

    def take_sent(self) -> list[SendExecute]:
        sent, self.sent = self.sent, []
        return sent

    # ------------------------------------------------------------ shortcuts

    def register(self, address: str, memory: int = 1 << 30, labels: dict[str, str] | None = None,
                 device_type: str = "cpu") -> str:
        reply = self.call(ev.Register, m.RegisterWorker(hello=hello("worker"), address=address, device_type=device_type,
                                                        memory_bytes=memory, labels=labels or {}))
        assert isinstance(reply, m.Registered), reply
        return reply.worker

    def report(self, worker: str, completed: int | None = None, errors: dict | None = None,
               sessions: dict | None = None) -> m.ReportReply:
        if completed is None:
            completed = self.core.workers[worker].sent if worker in self.core.workers else 0
        return self.call(ev.Report, m.WorkerReport(worker=worker, completed=completed, errors=errors or {},
                                                   sessions=sessions or {}))

    def report_all(self) -> None:
        """Every live worker reports all its batches done."""
        for wid, w in list(self.core.workers.items()):
            if w.state != "lost":
                self.report(wid)

    def open_session(self, name: str = "test", **fields: Any) -> str:
        reply = self.call(ev.OpenSession, m.OpenSession(hello=hello("client"), name=name, **fields))
        assert isinstance(reply, m.SessionOpened), reply
        return reply.session

    def open_mesh(self, session: str, mesh: int, devices: list[int], shape: list[int] | None = None,
                  min_devices: int = 0) -> Any:
        return self.call(ev.OpenMesh, m.OpenMesh(session=session, mesh=mesh, devices=devices,
                                                 shape=shape or [len(devices)], min_devices=min_devices))

    def submit(self, session: str, seq: int, instrs: list[Any]) -> Any:
        return self.call(ev.Submit, m.Submit(session=session, seq=seq, instrs=instrs))

    def sync(self, session: str, upto: int, timeout_s: float = 5.0) -> tuple[Any, Any]:
        return self.ask(ev.Sync, m.Sync(session=session, upto=upto, timeout_s=timeout_s))

    def status(self) -> m.StatusReply:
        return self.call(ev.Status, m.StatusRequest())


def is_refusal(reply: Any, kind: str = "refused") -> bool:
    return isinstance(reply, Refusal) and reply.kind == kind


# ---------------------------------------------------------------- instructions and commands


def spec(shape, mesh=1, placements=("S0",), dtype="float32") -> m.TensorSpec:
    return m.TensorSpec(shape=list(shape), dtype=dtype, mesh=mesh, placements=list(placements))


def create(tid, shape=(8,), mesh=1, src="train.py:3") -> m.InstrCreate:
    """A random tensor, sharded on dim 0 of `mesh`."""
    return m.InstrCreate(tid=tid, spec=spec(shape, mesh), init="rand", seed=tid, src=src)


def add_(tid, src="train.py:9") -> m.InstrCall:
    """`tensor tid += 1` in place (an (8,) tensor sharded on mesh 1)."""
    return m.InstrCall(op="aten.add_.Scalar", mesh=1, args=[m.tensor_slot(tid), 1.0], kwargs={},
                       outs=[m.OutSpec(tid=tid, spec=spec([8]))], src=src)


def cmds_of(sent: list[SendExecute], worker: str | None = None, kind: type | None = None) -> list[m.Cmd]:
    """The commands of `sent` (to `worker`, of type `kind`), in order, each as its worker runs it (`own`)."""
    return [c for e in sent if worker is None or e.worker_id == worker for c in own(e.execute)
            if kind is None or isinstance(c, kind)]


def own(execute: m.Execute) -> list[m.Cmd]:
    """The commands of one Execute as its worker runs them: a command shared by a mesh's workers with that worker's
    devices (`dtorch_protocol.shared`), CmdMesh itself left out."""
    meshes = shared.Meshes()
    return [c for c in map(meshes.local, execute.cmds) if c is not None]
