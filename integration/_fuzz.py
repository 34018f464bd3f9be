"""Hostile messages to every RPC of both services of real processes; counts, refusals, unhandled errors, RSS.

    python integration/_fuzz.py [--messages N] [--seed S]        # nox -s fuzz: 100,000 messages

A controller and a worker started with their CLIs (the worker registered, as in production), plus a standalone
worker process whose secret the fuzzer holds (`_fuzz_worker.py`), so that it can present every credential a
worker accepts (the execute token, client and peer capabilities) and reach the decoders and handlers behind them.
Each message goes to one RPC, chosen in turn, with a credential that is mostly valid for that RPC (the gate
itself is tested by test_auth.py; here the point is what lies behind it), sometimes of the wrong role or wrong.
Its body is one of: random bytes, a valid request with bytes flipped, cut or added, a valid request with one
field replaced by a hostile value (NaN, huge or negative numbers, long strings, deep nesting, unknown tags,
`$t` references to other sessions' tensors, ops outside aten), or a valid request.

What it reports, per RPC: how many messages, how many were refused (by status code), how many went through,
and how many got INTERNAL or UNKNOWN (an exception the handler did not turn into a refusal: a bug) or
UNAVAILABLE (a process died). Then the processes' RSS before and after and whether each is still alive, and a
real computation on the cluster afterwards, compared with torch. Exit status 1 if anything is wrong.

Sizes in the gigabytes are left out of the hostile values on purpose: a session may ask a device for all its
memory in one op (memory caps bound what stays, not peaks inside a command: docs/architecture.md), and this
runs on shared machines. Sizes far beyond any memory (2**62) are in: they must fail fast.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import msgspec

sys.path.insert(0, str(Path(__file__).parent))
from _helpers import Keys, start_controller, start_worker, stop_all  # noqa: E402
from dtorch_protocol import auth, wire  # noqa: E402
from dtorch_protocol import messages as m  # noqa: E402

CONTROLLER, WORKER = "dtorch.Controller", "dtorch.Worker"
UNHANDLED = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
DEAD = {grpc.StatusCode.UNAVAILABLE}
OPS = ["aten.add.Tensor", "aten.mul.Tensor", "aten.empty_like.default", "aten.new_empty.default", "aten.view.default",
       "aten.resize_.default", "aten.cat.default", "aten.mm.default", "aten.sum.dim_IntList", "aten.index.Tensor",
       "aten.as_strided.default", "aten.set_.source_Tensor", "aten.from_file.default", "builtins.eval.default",
       "os.system.default", "aten.add", "prims.empty_strided.default", "aten.copy_.default", "aten.clone.default"]


# ---------------------------------------------------------------- hostile values


def hostile_int(rng: random.Random) -> int:
    return rng.choice([0, 1, -1, 2, 3, 7, 255, 256, rng.randint(-300, 300), rng.randint(0, 1 << 16), 2**62, -(2**62),
                       2**63 - 1, -(2**63), 2**64 - 1])


def hostile_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(16 if depth < 4 else 9)
    if kind == 0:
        return hostile_int(rng)
    if kind == 1:
        return rng.choice([float("nan"), float("inf"), -float("inf"), -0.0, 1e308, -1e-308, 0.5, 3600.5, -1.0])
    if kind == 2:
        return rng.choice(["", "x" * rng.randint(1, 5000), "\x00", "é" * 100, "aten.add.Tensor",
                           "../" * 2 + "etc/passwd", "float32", "$t", "w99", "127.0.0.1:1", "s#s1"])
    if kind == 3:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 4:
        return rng.choice([True, False, None])
    if kind == 5:
        return [hostile_int(rng) for _ in range(rng.randint(0, 4))]  # shape-like
    if kind == 6:
        return {"$t": hostile_int(rng)}
    if kind == 7:
        return {rng.choice(["$dtype", "$device", "$layout", "$mf", "$c", "$lit"]): hostile_value(rng, depth + 2)}
    if kind == 8:
        return {"type": rng.choice(["call", "create", "exec_python", "run", "send", "fetch", "abandon", ""]),
                "op": rng.choice(OPS)}
    if kind == 9:
        nested: Any = hostile_int(rng)
        for _ in range(rng.randint(10, 400)):
            nested = [nested]
        return nested
    if kind == 10:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 20))]
    return {str(hostile_value(rng, depth + 3))[:20] if rng.random() < 0.5 else hostile_int(rng):
            hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 6))}


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            out += _paths(v, prefix + (i,))
    return out


def mutate(rng: random.Random, obj: Any) -> Any:
    """A copy of `obj` (builtins) with one value replaced, removed or added somewhere."""
    obj = msgspec.msgpack.decode(msgspec.msgpack.encode(obj))
    path = rng.choice(_paths(obj))
    if not path:
        return hostile_value(rng)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    action = rng.randrange(4)
    if action == 0 and isinstance(parent, dict):
        del parent[key]
    elif action == 1 and isinstance(parent, dict):
        parent[rng.choice(["extra", "$t", "type", "session", "seq"])] = hostile_value(rng)
    elif action == 2 and isinstance(parent, list):
        parent.append(hostile_value(rng))
    else:
        parent[key] = hostile_value(rng)
    return obj


def flip(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    action = rng.randrange(4)
    if action == 0 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if action == 1:
        return bytes(b[:rng.randrange(len(b) + 1)])
    if action == 2:
        return bytes(b) + rng.randbytes(rng.randint(1, 64))
    return rng.choice([b"\x91" * rng.randint(1000, 200_000) + b"\xc0", b"\xdd\xff\xff\xff\xff", b"\xc1",
                       b"\xdf\x7f\xff\xff\xff", b"\xc6\x7f\xff\xff\xff", b""])


def _encode(obj: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(obj)
    except (TypeError, OverflowError, RecursionError, ValueError):
        return b"\xc1"


# ---------------------------------------------------------------- the cluster and its credentials


@dataclass
class Cluster:
    tmp: Path
    keys: Keys
    address: str
    procs: list[subprocess.Popen]
    standalone: dict
    sessions: list[tuple[str, dict[int, str], dict[str, str]]] = field(default_factory=list)  # sid, where, caps
    fake_workers: list[tuple[str, str]] = field(default_factory=list)  # (worker id, secret) registered by us

    @property
    def pids(self) -> dict[str, int]:
        return {"controller": self.procs[0].pid, "worker": self.procs[1].pid, "standalone": self.standalone["pid"]}


def start(tmp: Path, wait_s: float = 90.0) -> Cluster:
    keys = Keys.make(tmp)
    controller, address = start_controller(tmp / "addr", keys.env(keys.admin), log=tmp / "controller.log",
                                           limit=wait_s)
    procs = [controller]
    procs.append(start_worker(address, keys.env(keys.worker), log=tmp / "worker.log"))
    alone = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_fuzz_worker.py"), str(os.getpid())],
                             stdout=subprocess.PIPE, stderr=open(tmp / "standalone.log", "w"), text=True,
                             env=keys.env(""))
    procs.append(alone)
    line = alone.stdout.readline()  # type: ignore[union-attr]
    if not line:
        stop_all(procs)
        raise RuntimeError(f"the standalone worker did not start: {(tmp / 'standalone.log').read_text()[-2000:]}")
    cluster = Cluster(tmp, keys, address, procs, json.loads(line))
    admin = wire.Stub(CONTROLLER, address, keys.admin)
    deadline = time.monotonic() + wait_s
    while not any(w.state == "alive" for w in admin.call("Status", m.StatusRequest(), timeout=10).workers):
        assert time.monotonic() < deadline, "the worker did not register"
        time.sleep(0.1)
    admin.close()
    alice = wire.Stub(CONTROLLER, address, keys.alice)
    for i in range(4):  # capped sessions of the fuzzing tenant, each with a mesh on the real worker
        sid = alice.call("OpenSession", m.OpenSession(hello=wire.hello("client"), name=f"fuzz{i}",
                                                      memory_cap=64 << 20), timeout=10).session
        placed = alice.call("OpenMesh", m.OpenMesh(session=sid, mesh=1, devices=[0, 1], shape=[2]), timeout=10)
        cluster.sessions.append((sid, placed.locations, placed.caps))
    alice.close()
    worker_key = wire.Stub(CONTROLLER, address, keys.worker)
    for i in range(3):  # fake workers whose reports the fuzzer may send: no memory, so nothing is placed there
        secret = auth.new_worker_secret()
        reg = worker_key.call("Register", m.RegisterWorker(hello=wire.hello("worker"), address=f"127.0.0.1:{9 + i}",
                                                           device_type="cpu", memory_bytes=0, secret=secret),
                              timeout=10)
        cluster.fake_workers.append((reg.worker, secret))
    worker_key.close()
    return cluster


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


# ---------------------------------------------------------------- messages per RPC


class Generator:
    """Valid samples per RPC (as builtins) and credentials; `message` turns one into a hostile call."""

    def __init__(self, rng: random.Random, cluster: Cluster) -> None:
        self.rng, self.c = rng, cluster
        self.seq = {sid: 0 for sid, _, _ in cluster.sessions}
        self.alone_seq = 0
        self.alone_secret = cluster.standalone["secret"]

    # valid requests ------------------------------------------------------------------------------

    def instr(self) -> Any:
        rng = self.rng
        spec = m.TensorSpec(shape=[rng.randint(0, 16), rng.randint(1, 8)], dtype=rng.choice(["float32", "int64"]),
                            mesh=1, placements=[rng.choice(["R", "S0", "S1", "P:sum"])])
        tid = rng.randint(1, 30)
        return rng.choice([
            m.InstrCreate(tid=tid, spec=spec, init=rng.choice(["zeros", "ones", "rand", "empty", "full"]), value=1.5),
            m.InstrCall(op=rng.choice(OPS), mesh=1, args=[{"$t": rng.randint(1, 30)}, 2], kwargs={},
                        outs=[m.OutSpec(tid, spec)], writes=[hostile_int(rng)] if rng.random() < 0.3 else []),
            m.InstrRedistribute(src=rng.randint(1, 30), dst=tid, src_spec=spec, dst_spec=spec),
            m.InstrDelete(tids=[rng.randint(1, 30)]),
            m.InstrAdopt(tid=tid, spec=spec),
            m.InstrRead(tid=rng.randint(1, 30), mark=hostile_int(rng))])

    def controller_sample(self, method: str) -> Any:
        rng, c = self.rng, self.c
        sid = rng.choice(c.sessions)[0]
        if method == "Submit":
            seq = self.seq[sid] + 1 if rng.random() < 0.7 else hostile_int(rng)
            return m.Submit(session=sid, seq=seq, instrs=[self.instr() for _ in range(rng.randint(0, 6))])
        worker, _secret = rng.choice(c.fake_workers)
        return {
            "OpenSession": lambda: m.OpenSession(hello=wire.hello("client"), memory_cap=1 << 20),
            "OpenMesh": lambda: m.OpenMesh(session=sid, mesh=rng.randint(1, 3), devices=[0, 1], shape=[2]),
            "Sync": lambda: m.Sync(session=sid, upto=self.seq[sid], timeout_s=0.05),
            "CloseSession": lambda: m.CloseSession(session=rng.choice([sid + "x", "nope", ""])),
            "KeepAlive": lambda: m.KeepAlive(session=sid),
            "Status": lambda: m.StatusRequest(),
            "Register": lambda: m.RegisterWorker(hello=wire.hello("worker"), address=f"10.9.9.{rng.randint(0, 9)}:1",
                                                 device_type="cpu", memory_bytes=0, secret=auth.new_worker_secret()),
            "Report": lambda: m.WorkerReport(worker=worker, completed=0, errors={sid: [
                m.ErrorReport(op="aten.add.Tensor", src="f.py:1", message="x")]},
                sessions={sid: m.ShardStats(1, 8)}, proof=auth.report_proof(_secret)),
            "Drain": lambda: m.DrainRequest(worker=worker, timeout_s=0.05),
            "Migrate": lambda: m.MigrateRequest(session=sid, device=0, to_worker=worker, timeout_s=0.05),
        }[method]()

    def worker_sample(self, method: str, standalone: bool) -> tuple[Any, str]:
        """(request or list of requests for client streams, the session it names)."""
        rng = self.rng
        if standalone:
            sid = rng.choice(["s1", "s2", "s3"])
        else:
            sid = rng.choice(self.c.sessions)[0]
        tid, dev = rng.randint(1, 30), rng.randint(0, 1)
        if method == "Execute":
            self.alone_seq += 1
            seq = self.alone_seq if rng.random() < 0.8 else rng.choice([1, self.alone_seq, 10**6, -1])
            cmds = [rng.choice([
                m.CmdCreate(tid=tid, dtype="float32", shape=[4, 4], init=rng.choice(["zeros", "randn", "arange"]),
                            boxes={dev: [[0, 4], [0, 4]]}, arange=[0, 16, 1]),
                m.CmdRun(op=rng.choice(OPS), devices=[dev], args=[{"$t": rng.randint(1, 30)}, 1.0], kwargs={},
                         outs=[tid]),
                m.CmdRedistribute(src=rng.randint(1, 30), dst=tid, dtype="float32", plans={dev: m.ShardPlan(
                    shape=[4, 4], groups=[[m.Piece("", dev, [0, 0], [0, 0], [4, 4])]])}),
                m.CmdExpectReads(tid=tid, reads={dev: 1}, dst=tid + 1),
                m.CmdReadable(mark=hostile_int(rng)),
                m.CmdDelete(tids=[tid], devices=[dev]),
                m.CmdSendShards(devices={dev: [tid]}, namespace=f"{sid}#s1"),
                m.CmdFetchShards(devices={dev: [tid]}, namespace=f"{sid}#s1"),
                m.CmdKeepCopies(devices={dev: [tid]}, source=rng.choice([f"{sid}#s1", "other#s1"]),
                                namespace=f"{sid}#s2"),
                m.CmdAbandon(tids=[tid]), m.CmdRebuilt(), m.CmdStay(devices=[dev]), m.CmdCloseSession()])
                for _ in range(rng.randint(1, 4))]
            return m.Execute(seq=seq, session=sid, cmds=cmds, memory_cap=64 << 20), sid
        if method == "Pull":
            return m.PullRequest(session=sid, tid=tid, device=dev, timeout_s=rng.choice([0.0, 0.01, 0.2]),
                                 offset=[0, 0] if rng.random() < 0.5 else None, size=[1, 1],
                                 after=hostile_int(rng) if rng.random() < 0.3 else -1), sid
        if method == "Put":
            n = rng.randint(0, 64)
            return [m.PutChunk(session=sid, tid=100 + tid, device=dev, dtype="float32", shape=[n],
                               data=rng.randbytes(4 * n))], sid
        if method == "Profile":
            return m.ProfileRequest(session=sid, start=rng.random() < 0.5), sid
        if method == "PullShards":
            return m.ShardsRequest(session=f"{sid}#s1" if rng.random() < 0.5 else sid, devices={dev: [tid]},
                                   timeout_s=0.0), sid
        views = [m.ShardView(tid=tid, device=dev, storage=0, dtype="float32", shape=[2], stride=[1], offset=0)]
        return [m.ShardsChunk(views=views, storages=[8], namespace=f"{sid}#s1"), m.ShardsChunk(data=b"\0" * 8)], sid

    # credentials ---------------------------------------------------------------------------------

    def controller_credential(self, method: str) -> str:
        roles = auth.ROLES[CONTROLLER][method]
        keys = self.c.keys
        by_role = {auth.TENANT: keys.alice, auth.ADMIN: keys.admin, auth.WORKER: keys.worker}
        r = self.rng.random()
        if r < 0.85:
            return by_role[sorted(roles)[0] if auth.TENANT not in roles else auth.TENANT]
        if r < 0.95:
            return self.rng.choice(list(by_role.values()))
        return self.rng.choice(["", "x", auth.new_key()[1]])

    def worker_credential(self, method: str, standalone: bool, sid: str) -> str:
        rng = self.rng
        if not standalone:  # the registered worker: only what a tenant holds (its sessions' client capabilities)
            caps = dict(rng.choice(self.c.sessions)[2])
            cap = rng.choice(list(caps.values())) if caps else ""
            return cap if rng.random() < 0.9 else rng.choice(["", "ctl1.00", "cap1.peer.x.1.00"])
        secret = self.alone_secret
        role = sorted(auth.ROLES[WORKER][method])[0] if rng.random() < 0.9 else rng.choice(
            [auth.CONTROLLER, auth.CLIENT, auth.PEER])
        if role == auth.CONTROLLER:
            return auth.execute_token(secret)
        return auth.mint(secret, role, sid if rng.random() < 0.9 else "s9")

    # one hostile call ----------------------------------------------------------------------------

    def message(self, service: str, method: str) -> tuple[str, bytes | list[bytes], Any]:
        """(target address, payload, metadata) for one call."""
        rng = self.rng
        standalone = service == WORKER and rng.random() < 0.6
        if service == CONTROLLER:
            target, sample, credential = self.c.address, self.controller_sample(method), \
                self.controller_credential(method)
        else:
            sample, sid = self.worker_sample(method, standalone)
            target = self.c.standalone["address"] if standalone else next(iter(self.c.sessions[0][1].values()))
            credential = self.worker_credential(method, standalone, sid)
        meta = auth.bearer(credential) if rng.random() > 0.02 else None
        style = rng.random()
        samples = sample if isinstance(sample, list) else [sample]
        if style < 0.08:
            payloads = [rng.randbytes(rng.randint(0, 512)) for _ in samples]
        elif style < 0.3:
            payloads = [flip(rng, wire.encode(s)) for s in samples]
        elif style < 0.85:
            payloads = [_encode(mutate(rng, msgspec.to_builtins(s))) for s in samples]
        else:
            payloads = [wire.encode(s) for s in samples]
        kind = wire.SERVICES[service][method][2]
        return target, (payloads if kind == "stream_in" else payloads[0]), meta

    def went_through(self, service: str, method: str, payload: Any) -> None:
        """Keep the session's batch numbers in step with what the controller accepted."""
        if method == "Submit" and service == CONTROLLER:
            try:
                msg = wire.decode(m.Submit, payload)
            except wire.ProtocolError:
                return
            if msg.session in self.seq:
                self.seq[msg.session] = max(self.seq[msg.session], msg.seq)


# ---------------------------------------------------------------- running it


@dataclass
class Report:
    calls: dict[str, Counter] = field(default_factory=dict)  # "Service.Method" -> status code name -> n
    unhandled: list[str] = field(default_factory=list)
    rss_before: dict[str, int] = field(default_factory=dict)
    rss_after: dict[str, int] = field(default_factory=dict)
    alive: dict[str, bool] = field(default_factory=dict)
    tracebacks: dict[str, int] = field(default_factory=dict)
    computation: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (not self.unhandled and all(self.alive.values()) and self.computation == "same"
                and not any(self.tracebacks.values()))

    def render(self) -> str:
        lines = [f"{'RPC':28}{'sent':>8}{'through':>9}{'refused':>9}{'unhandled':>10}  refusals by code"]
        for name, codes in sorted(self.calls.items()):
            refused = {k: v for k, v in codes.items() if k not in ("OK", "INTERNAL", "UNKNOWN")}
            bad = codes.get("INTERNAL", 0) + codes.get("UNKNOWN", 0)
            lines.append(f"{name:28}{sum(codes.values()):8d}{codes.get('OK', 0):9d}{sum(refused.values()):9d}"
                         f"{bad:10d}  " + ", ".join(f"{k} {v}" for k, v in sorted(refused.items())))
        total = sum(sum(c.values()) for c in self.calls.values())
        lines.append(f"{total} messages in {self.seconds:.1f} s")
        for name in self.rss_before:
            lines.append(f"{name}: RSS {self.rss_before[name] / 1024:.1f} MiB before, "
                         f"{self.rss_after.get(name, -1) / 1024:.1f} MiB after, "
                         f"{'alive' if self.alive.get(name) else 'DEAD'}, {self.tracebacks.get(name, 0)} tracebacks")
        for line in self.unhandled[:20]:
            lines.append(f"unhandled: {line}")
        lines.append(f"a real computation afterwards: {self.computation or 'not run'}")
        return "\n".join(lines)


COMPUTATION = textwrap.dedent("""
    import torch, dtorch
    from dtorch import Replicate, Shard
    dtorch.connect(memory_cap=64 << 20)  # packed beside the fuzzed sessions
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = torch.arange(48.0).reshape(8, 6)
    d = dtorch.distribute_tensor(x, mesh, [Shard(0)])
    y = (d @ d.T).redistribute(mesh, [Replicate()]) + torch.ones(8, 8)
    print("same" if torch.equal(y.to_torch(), x @ x.T + 1) else "DIFFERENT", flush=True)
""")


def run(tmp: Path, messages: int, seed: int, progress: Callable[[str], None] = lambda s: None,
        call_timeout_s: float = 2.0) -> Report:
    cluster = start(tmp)
    report = Report()
    try:
        rng = random.Random(seed)
        gen = Generator(rng, cluster)
        rpcs = [(s, meth) for s in (CONTROLLER, WORKER) for meth in sorted(wire.SERVICES[s])]
        report.rss_before = {name: rss_kib(pid) for name, pid in cluster.pids.items()}
        channels: dict[str, grpc.Channel] = {}
        started = time.monotonic()
        for i in range(messages):
            service, method = rpcs[i % len(rpcs)]
            target, payload, meta = gen.message(service, method)
            channel = channels.get(target) or channels.setdefault(target, wire.open_channel(target))
            code, details = wire.raw_call(channel, service, method, payload, meta, timeout=call_timeout_s)
            name = f"{service.split('.')[1]}.{method}"
            report.calls.setdefault(name, Counter())[code.name] += 1
            if code in UNHANDLED or code in DEAD:
                report.unhandled.append(f"{name}: {code.name}: {details[:300]}")
            elif code == grpc.StatusCode.OK:
                gen.went_through(service, method, payload)
            if (i + 1) % 5000 == 0:
                progress(f"{i + 1} messages, {len(report.unhandled)} unhandled, {time.monotonic() - started:.0f} s")
        report.seconds = time.monotonic() - started
        for channel in channels.values():
            channel.close()
        time.sleep(1.5)  # fake workers are declared lost, parked calls end
        report.rss_after = {name: rss_kib(pid) for name, pid in cluster.pids.items()}
        report.alive = {name: p.poll() is None for name, p in zip(("controller", "worker", "standalone"),
                                                                   cluster.procs)}
        out = subprocess.run([sys.executable, "-c", COMPUTATION], capture_output=True, text=True, timeout=180,
                             env=cluster.keys.env(cluster.keys.bob, DTORCH_CONTROLLER=cluster.address))
        report.computation = out.stdout.strip() or f"failed: {out.stderr.strip().splitlines()[-1:]}"
    finally:
        stop_all(cluster.procs)
        for name, log in (("controller", "controller.log"), ("worker", "worker.log"),
                          ("standalone", "standalone.log")):
            text = (tmp / log).read_text(errors="replace") if (tmp / log).exists() else ""
            report.tracebacks[name] = text.count("Traceback")
    return report


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dtorch-fuzz-") as tmp:
        report = run(Path(tmp), args.messages, args.seed, progress=lambda s: print(s, flush=True))
        print(report.render())
        if report.tracebacks and any(report.tracebacks.values()):
            for log in ("controller.log", "worker.log", "standalone.log"):
                text = (Path(tmp) / log).read_text(errors="replace")
                if "Traceback" in text:
                    i = text.index("Traceback")
                    print(f"--- first traceback in {log}:\n{text[i:i + 3000]}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
