"""A fake-clock harness that drives the controller core directly: no gRPC, no threads, no sleeping."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from dtorch_controller.core import Config, ControllerCore, Refusal, Reply, SendExecute, SetTimer, counter_ids
from dtorch_controller.core import events as ev
from dtorch_controller.core.policies import make_policy
from dtorch_protocol import messages as m
from dtorch_protocol.wire import hello


class Harness:
    """Feeds events at a fake time, keeps the timers the core asks for and fires them as time advances."""

    def __init__(self, policy: Any = None, **config: Any) -> None:
        self.now = 100.0
        self.core = ControllerCore(Config(**config), session_ids=counter_ids("sess"), policy=policy)
        self.timers: dict[Any, float] = {}
        self.sent: list[SendExecute] = []  # every SendExecute so far
        self.replies: dict[Any, Any] = {}  # request id -> reply message (also late ones)
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

    def register(self, address: str, memory: int = 1 << 30, labels: dict[str, str] | None = None) -> str:
        reply = self.call(ev.Register, m.RegisterWorker(hello=hello("worker"), address=address, device_type="cpu",
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


@pytest.fixture
def h() -> Harness:
    # The scheduling rules' tests were written against the `priority` policy (classes, reservations); the
    # default policy (`dtorch`) has tests of its own (test_core_policy_dtorch.py).
    return Harness(policy=make_policy("priority"))


@pytest.fixture
def make_harness():
    return Harness


@pytest.fixture
def refused():
    return is_refusal


# ---------------------------------------------------------------- keys for the real gRPC server


class Keys:
    """A key file with an admin, a worker and two tenants' keys (alice, bob)."""

    def __init__(self, path: Any) -> None:
        from dtorch_controller.keys import Keyring, new_key_file

        self.path = path
        self.admin, self.worker, self.alice, self.bob = new_key_file(
            path, ("admin", ""), ("worker", ""), ("tenant", "alice"), ("tenant", "bob"))
        self.keyring = Keyring(path)

    def authenticate(self, credential: str) -> Any:
        return self.keyring.authenticate(credential)


@pytest.fixture
def keys(tmp_path) -> Keys:
    return Keys(tmp_path / "keys.json")


@pytest.fixture(scope="module")
def module_keys(tmp_path_factory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys") / "keys.json")


@pytest.fixture(name="register_worker")
def _register_worker_fixture() -> Any:
    return register_worker


def register_worker(stub: Any, address: str, secret: str | None = None, memory: int = 0, **fields: Any) -> Any:
    """Register a (fake) worker at `address` over `stub` (a worker key); returns (Registered, its report proof)."""
    from dtorch_protocol import auth

    secret = secret or auth.new_worker_secret()
    reply = stub.call("Register", m.RegisterWorker(hello=hello("worker"), address=address, device_type="cpu",
                                                   memory_bytes=memory, secret=secret, **fields), timeout=5)
    return reply, auth.report_proof(secret)
