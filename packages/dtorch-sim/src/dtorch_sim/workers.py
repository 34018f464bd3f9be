"""Fake workers: register, report, run command batches in seq order for as long as the cost model says.

Like the real worker (dtorch_worker.executor and agent), a fake worker

* registers, then reports: after every batch it finishes, and when it said nothing for a heartbeat interval
  (a report after a batch counts as a heartbeat: idle workers beat, busy ones report anyway); a heartbeat with
  nothing new to say is no report of its own but one entry of its slot's `events.WorkersAlive` (harness.py);
  who makes it (`_next_beat`): the roster of its slot while the worker is idle with everything told, until a
  batch or a fault wakes it; nobody while its running batch reports first; else a beat of its own;
* runs Execute batches strictly in seq order; a batch with a CmdAbandon acts on arrival (the session's earlier
  batches are skipped);
* reports completions, errors, the live shards and bytes of each session it holds (memory), and the fraction
  of the time since its last report it spent executing (utilization);
* stops when it fails or is fenced (a report answered "fenced": it was declared lost, or released after a drain).

It holds no tensor data: only the byte size of every shard, by (session or namespace, tid, logical device), so it
can price commands and report memory. Cost model (`scenario.cost`): a `sim.step` costs its declared flops per
device / (reference_tflops * speed * slow factor); other ops one flop per output element; copying shards
(snapshots, moves, restores: CmdSendShards / CmdFetchShards) costs bytes / bandwidth, `host_gbps` for local and
host-memory copies and `network_gbps` between workers (copies a snapshot keeps from the one before, CmdKeepCopies,
cost nothing); every command adds `launch_s`.

Everything is driven by simpy timeouts with callbacks, not processes: 10,000 workers cost no generators, and
an idle worker costs one dict entry per heartbeat interval (its roster's).
"""

from __future__ import annotations

import math

from dtorch_controller.core import events as ev
from dtorch_protocol import messages as m
from dtorch_sim import __version__
from dtorch_sim.jobs import STEP_OP

HELLO = m.Hello(protocol_version=m.PROTOCOL_VERSION, package_version=__version__, role="worker")
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "bfloat16": 2,
            "float32": 4, "float64": 8, "complex64": 8, "complex128": 16}
COPY_OP = "copy shards"  # op names of failed copies, for people (the core reads `ErrorReport.kind`)
FETCH_OP = "fetch shards"


class Worker:
    """One simulated device (one worker process). `sim` is the Simulation that owns it."""

    def __init__(self, sim, address: str, node: str, device_type: str, speed: float, memory_gb: float,
                 labels: dict[str, str]) -> None:
        self.sim, self.env = sim, sim.env
        self.address, self.node, self.device_type = address, node, device_type
        self.speed, self.memory_gb, self.labels = speed, memory_gb, labels
        self.slow = 1.0  # slow_worker faults scale the speed
        self.id: str | None = None  # the core's id, once registered
        self.alive = True  # the process runs (False: failed, fenced or removed)
        self.crash = False  # when failed: sends to it fail at once (else they vanish)
        self.partitioned = False  # cut off from the controller: its reports are lost, sends to it fail
        self.draining = False  # a drain was asked: "fenced" then means released, not a fault
        self.interval = 1.0
        self.completed = 0
        self.pending: dict[int, m.Execute] = {}  # seq -> batch received, not started
        self.skip_below: dict[str, int] = {}  # session -> batches below this seq were abandoned
        self.current: m.Execute | None = None
        self.started = 0.0  # when `current` started
        self.seconds = 0.0  # how long `current` takes
        self.work: tuple | None = None  # `current`'s step work: (job record, {device: step}, device-seconds)
        self.token = 0  # bumps when the worker stops: scheduled completions of the old life are ignored
        self.store: dict[str, dict[tuple[int, int], int]] = {}  # session/namespace -> (tid, device) -> bytes
        self.totals: dict[str, int] = {}  # session/namespace -> bytes
        self.errors: dict[str, list[m.ErrorReport]] = {}
        self.offloaded: dict[str, int] = {}  # session -> bytes of its state offloaded to host memory (see _swap)
        self._resident: set[str] = set()  # keys with bytes here that are not offloaded (what a swap may offload)
        self._stats: dict[str, m.ShardStats] = {}  # the shard stats last worked out (`_shards`)
        self._dirty: set[str] = set()  # sessions/namespaces whose shards changed since
        self._created = False  # and whether one of them is a key made (again) since
        self._told = (0, self._stats)  # `completed` and shard stats of the last report that got through (registered:
        # none and none, as the core's record of it says)
        self.busy_s = 0.0  # finished busy time
        self.last_report = 0.0
        self.reported_at: float | None = None  # when the controller last got a report (utilization span)
        self.busy_at_report = 0.0
        self.beat_armed = False  # a beat of its own is pending (`_beat`)
        self._due: tuple[float | None, float] = (None, 0.0)  # the last report and the slot of the heartbeat after it
        self.quiet: tuple[int | None, float] | None = None  # in a roster: (phase, since when); joining: (None, when)

    # ------------------------------------------------------------ life

    def start(self) -> None:
        """Register now; then report every heartbeat interval (the first at a seeded offset)."""
        reply = self.sim.register(self, m.RegisterWorker(
            hello=HELLO, address=self.address, device_type=self.device_type,
            memory_bytes=int(self.memory_gb * 2**30), labels=self.labels))
        if not isinstance(reply, m.Registered):
            self.alive = False
            self.sim.note(f"worker {self.address} could not register: {getattr(reply, 'message', reply)}")
            return
        self.id = reply.worker
        self.interval = reply.heartbeat_interval_s
        self._due = (None, 0.0)
        self.last_report = self.env.now - self.interval + self.sim.rng.uniform(0, self.interval)
        self.sim.registered(self)
        self._next_beat()

    def stop(self) -> None:
        """Stop everything at once: no more reports, no more work (the batch running now is cut short)."""
        if not self.alive:
            return
        self.alive = False
        self.token += 1  # a beat still pending is of the old life: it does nothing
        self.beat_armed = False
        self.sim.unhold(self)
        self._leave_roster()
        if self.id is not None:
            self.sim.alive_n -= 1
        if self.current is not None:
            elapsed = self.env.now - self.started
            self.busy_s += elapsed
            self.sim.busy_end(self.started, elapsed)
            if self.work is not None and self.seconds > 0:
                rec, _steps, work = self.work
                self.sim.work_lost(rec, work * min(1.0, elapsed / self.seconds))
            self.current = self.work = None
        self.pending.clear()

    # ------------------------------------------------------------ reports

    def _next_beat(self) -> None:
        """Who makes the next heartbeat, due an interval after the last report: the roster of its slot while the
        worker is idle with everything told (`Simulation.quiet`: one dict entry an interval, no call of its own);
        nobody while the batch it runs ends, and reports, before then; else a beat of its own (`_beat`). Called
        whenever that may change (a report, a batch started, a wake); at most one beat of its own is pending."""
        if self.beat_armed or self.quiet is not None or not self.alive:
            return
        last = self.last_report
        if last != self._due[0]:  # asked again and again between two reports: worked out once per report
            self._due = (last, self.sim.slot_after(last + self.interval))
        due = self._due[1]
        if self.current is not None:
            if self.started + self.seconds < due:
                return
        elif not self.pending and self._all_told() and self.sim.quiet(self, due):
            return
        self._arm(due - self.env.now)

    def _arm(self, delay: float) -> None:
        if not self.beat_armed:
            self.beat_armed = True
            self.sim.later(self.sim.slot_after(self.env.now + max(0.0, delay)), self._beat, self.token)

    def _leave_roster(self) -> None:
        """If a roster beats for it, it leaves it: its last report is the roster's last beat for it (idle since, so
        `busy_at_report` holds)."""
        if self.quiet is not None:
            self.last_report = self.reported_at = self.sim.wake(self)

    def _all_told(self) -> bool:
        """Nothing new since the last report that got through: the same completed batches, no errors, the same
        shards (a step writes its outputs again at the same sizes)."""
        return not self.partitioned and not self.errors and self.completed == self._told[0] and \
            self._shards() is self._told[1]

    def _beat(self, token: int) -> None:
        if not self.alive or token != self.token:
            return  # a beat of an earlier life (see `stop`)
        self.beat_armed = False
        # The next heartbeat is due in the slot an interval after its last report. Compared on the slot grid (the
        # same rounding `_arm` used), with a relative tolerance: re-arming is for a strictly later time, so the
        # clock always advances (an absolute 1e-9 s against a rounding of 1e-9 slot looped forever at 3600 s).
        sim = self.sim
        due = sim.slot_after(self.last_report + self.interval)
        now = self.env.now
        if due > now + 1e-9 * max(1.0, abs(due)):  # it reported since
            self._next_beat()
            return
        if not self._all_told():
            self.report()
            self._next_beat()
            return
        # Nothing new: no report of its own, one entry of the slot's `WorkersAlive` (`Simulation.alive`), which the
        # core handles as the same report.
        self.last_report = now
        sim.alive(self, self._utilization(now))
        self._next_beat()

    def cut_off(self) -> None:
        """A partition cuts it off from the controller: its reports are lost; it beats on its own (and is lost)."""
        self.partitioned = True
        self._leave_roster()
        self._next_beat()

    def heal(self) -> None:
        """The partition that cut it off from the controller healed: report now."""
        self.partitioned = False
        self.report()
        self._next_beat()

    def report(self) -> None:
        """Report now: after a batch, on a partition's end, or as a heartbeat with something new to say (the caller
        sees to the next heartbeat, `_next_beat`, once it knows what it runs next)."""
        now = self.env.now
        self.last_report = now
        if self.partitioned:
            return  # lost on the way; the completions and errors ride along with a later report
        utilization = self._utilization(now)
        sessions = self._shards()
        errors, self.errors = self.errors, {}
        self._told = (self.completed, sessions)
        report = m.WorkerReport(worker=self.id, completed=self.completed, errors=errors,  # type: ignore[arg-type]
                                sessions=sessions, utilization=utilization)
        reply = self.sim.call(ev.Report, report)
        if isinstance(reply, m.ReportReply) and not reply.ok:
            self.sim.fenced(self)

    def _utilization(self, now: float) -> float:
        """The busy fraction since the last report, which `now` becomes."""
        busy = self.busy_until_now()
        span = now - self.reported_at if self.reported_at is not None else 0.0
        utilization = min(1.0, (busy - self.busy_at_report) / span) if span > 0 else 0.0
        self.reported_at, self.busy_at_report = now, busy
        return utilization

    def _shards(self) -> dict[str, m.ShardStats]:
        """The shard stats to report: the last ones reported while the shards did not change (frozen sessions' shards
        stay put; a step writes its outputs again at the same sizes), so that `is` tells whether they are new."""
        dirty, stats = self._dirty, self._stats
        if not dirty:
            return stats
        totals, store = self.totals, self.store
        changed = {}
        for k in dirty:  # most often a step's new outputs replaced the old ones at the same sizes: no change
            b = totals.get(k, 0)
            old = stats.get(k)
            if b and old is not None and old.bytes == b and old.tensors == len(store[k]):
                continue
            v = m.ShardStats(tensors=len(store[k]), bytes=b) if b else None
            if old != v:
                changed[k] = v
        dirty.clear()
        if not changed:
            return stats
        if self._created or any(v is not None and k not in stats for k, v in changed.items()):
            self._created = False  # a key new to the stats: worked out whole, in the order of `totals`
            stats = {k: m.ShardStats(tensors=len(store[k]), bytes=b) for k, b in totals.items() if b}
        else:  # the keys keep their places
            stats = dict(stats)
            for k, v in changed.items():
                if v is None:
                    del stats[k]
                else:
                    stats[k] = v
        self._stats = stats = self._told[1] if stats == self._told[1] else stats
        return stats

    def busy_until_now(self) -> float:
        return self.busy_s + (self.env.now - self.started if self.current is not None else 0.0)

    # ------------------------------------------------------------ execution

    def deliver(self, batch: m.Execute) -> None:
        """A batch arrived (the harness checked that it can): queue it; a CmdAbandon acts now."""
        if batch.seq <= self.completed or batch.seq in self.pending:
            return
        if self.quiet is not None:
            self._leave_roster()
        if m.CmdAbandon in map(type, batch.cmds):
            self.skip_below[batch.session] = max(self.skip_below.get(batch.session, 0), batch.seq)
            self.errors.pop(batch.session, None)  # reports of abandoned work: nobody wants them
        self.pending[batch.seq] = batch
        if self.current is None:
            self._next()
        self._next_beat()

    def _next(self) -> None:
        """Start the next batch in seq order, if it is here (a gap waits, as on a real worker)."""
        batch = self.pending.pop(self.completed + 1, None)
        if batch is None:
            return
        self.current, self.started = batch, self.env.now
        self.sim.busy_start(self.started)
        if batch.seq < self.skip_below.get(batch.session, 0):
            self.seconds, self.work = 0.0, None
        else:
            self.seconds = self._run(batch)
        self.sim.at_end(self.seconds, self._done, self.token)  # one simpy event for a step's workers

    def _done(self, token: int) -> None:
        if token != self.token or not self.alive:
            return
        batch = self.current
        assert batch is not None
        sim = self.sim
        elapsed = self.env._now - self.started
        self.busy_s += elapsed
        sim.busy_end(self.started, elapsed)
        if self.work is not None:
            rec, steps, work = self.work
            sim.work_done(rec, steps, work)
        self.current = self.work = None
        self.completed = batch.seq
        self.report()
        if self.alive:
            if self.current is None:
                self._next()
            self._next_beat()

    # ------------------------------------------------------------ the cost model

    def _put(self, key: str, shard: tuple[int, int], nbytes: int) -> None:
        store = self.store.get(key)
        if store is None:
            store = self.store[key] = {}
            self.totals[key] = 0
            self._created = True
        self._dirty.add(key)
        held = self.totals[key] = self.totals[key] + nbytes - store.get(shard, 0)
        store[shard] = nbytes
        if held and key not in self.offloaded:
            self._resident.add(key)
        else:
            self._resident.discard(key)

    def _drop(self, key: str, shard: tuple[int, int]) -> None:
        store = self.store.get(key)
        if store is not None and shard in store:
            self._dirty.add(key)
            self.totals[key] -= store.pop(shard)
            if not self.totals[key]:
                self._resident.discard(key)
            if not store:  # its last shard: forget the key (namespaces of copies come and go all the time)
                del self.store[key], self.totals[key]

    def _error(self, session: str, seq: int, op: str, message: str, kind: m.ErrorKind = m.ErrorKind.OP) -> None:
        self.errors.setdefault(session, []).append(m.ErrorReport(op=op, src="", message=message, seq=seq, kind=kind))

    def _run(self, batch: m.Execute) -> float:
        """Apply a batch to the shard sizes and price it; notes its step work for the job's accounting."""
        sim = self.sim
        cost = sim.scenario.cost
        ref_flops = cost.reference_tflops * 1e12
        rate = ref_flops * self.speed * self.slow
        session = batch.session
        cmds = batch.cmds
        seconds = self._swap(batch) if m.CmdRun in map(type, cmds) else 0.0
        work = 0.0
        steps: dict[int, int] = {}
        launch = cost.launch_s
        # Commands shared by a mesh's workers (protocol 1.7, dtorch_protocol/shared.py) name the mesh: this worker's
        # devices of it are the batch's CmdMesh before them (read here, not copied into a command of its own each)
        meshes: dict[int, list[int]] = {}
        for cmd in cmds:
            kind = type(cmd)
            if kind is m.CmdMesh:
                meshes[cmd.mesh] = cmd.devices
                continue
            seconds += launch
            if kind is m.CmdRun:
                devices = cmd.devices if cmd.mesh < 0 else meshes[cmd.mesh]
                store = self.store.get(session, {})
                args = cmd.args  # the input whose size the outputs take: a step's workers share the command
                if args is not _last_ref[0]:
                    _last_ref[:] = args, _first_ref(args)
                first = _last_ref[1]
                if cmd.op == STEP_OP:  # jobs.Steps: per logical device, plus the serial part once per worker
                    kw = cmd.kwargs
                    flops = float(kw.get("flops", 0.0)) * len(devices) + float(kw.get("serial_flops", 0.0))
                    step = cmd.kwargs.get("step")
                    if step is not None:
                        steps.update(dict.fromkeys(devices, step))
                    work += flops / ref_flops
                else:
                    flops = 0.0
                for d in devices:
                    nbytes = store.get((first, d), 0) if first is not None else 0
                    if cmd.op != STEP_OP:
                        flops += nbytes / 4
                    for tid in cmd.outs:
                        if tid is not None:
                            self._put(session, (tid, d), nbytes)
                seconds += flops / rate
            elif kind is m.CmdCreate:
                size = ITEMSIZE.get(cmd.dtype, 4)
                for d, box in cmd.boxes.items():
                    self._put(session, (cmd.tid, d), size * math.prod(length for _start, length in box))
            elif kind is m.CmdDelete:
                for tid in cmd.tids:
                    for d in (cmd.devices if cmd.mesh < 0 else meshes[cmd.mesh]):
                        self._drop(session, (tid, d))
            elif kind is m.CmdCloseSession:
                self.store.pop(session, None)
                self.totals.pop(session, None)
                self._dirty.add(session)
                self._resident.discard(session)
                self.offloaded.pop(session, None)
            elif kind is m.CmdSendShards:
                seconds += self._send_shards(batch, cmd)
            elif kind is m.CmdKeepCopies:
                self._keep_copies(batch, cmd)
            elif kind is m.CmdFetchShards:
                seconds += self._fetch_shards(batch, cmd)
            elif kind is m.CmdAbandon:
                drop = set(cmd.tids)
                for shard in [s for s in self.store.get(session, {}) if s[0] in drop]:
                    self._drop(session, shard)
            elif kind is m.CmdRedistribute:
                size = ITEMSIZE.get(cmd.dtype, 4)
                moved = 0
                for d, plan in cmd.plans.items():
                    nbytes = size * math.prod(plan.shape)
                    self._put(session, (cmd.dst, d), nbytes)
                    moved += nbytes
                seconds += moved * 8 / (cost.network_gbps * 1e9)
            # CmdExpectReads, CmdRebuilt, CmdStay, CmdFence (simulated workers wait on no peer): bookkeeping only
        rec = sim.session_jobs.get(session)
        self.work = (rec, steps, work) if rec is not None and work else None
        return seconds

    def _swap(self, batch: m.Execute) -> float:
        """Device memory (the freeze and resume cost): a session running on a whole device (memory_cap 0) uses all of
        its memory, so the state of every other session on this worker (a frozen one's) is offloaded to host memory
        first; a session whose state was offloaded here loads it back before it computes here again. Both copies
        take bytes / `host_gbps`, on this batch's clock. Packed (capped) sessions fit by their caps: no swapping."""
        session = batch.session
        nbytes = 0
        if self.offloaded and self.offloaded.pop(session, None) is not None:  # loaded back
            nbytes = self.totals.get(session, 0)
            if nbytes:
                self._resident.add(session)
        resident = self._resident
        if not batch.memory_cap and (len(resident) > 1 or resident and session not in resident):  # others' state
            live = self.sim.session_jobs
            for other in [k for k in resident if k != session and k in live]:
                held = self.offloaded[other] = self.totals[other]
                nbytes += held
                self._resident.discard(other)
        if not nbytes:
            return 0.0
        seconds = nbytes * 8 / (self.sim.scenario.cost.host_gbps * 1e9)
        self.sim.swapped(nbytes, seconds)
        return seconds

    def _send_shards(self, batch: m.Execute, cmd: m.CmdSendShards) -> float:
        cost = self.sim.scenario.cost
        store = self.store.get(batch.session, {})
        shards = [((tid, d), store[(tid, d)]) for d, tids in cmd.devices.items() for tid in tids if (tid, d) in store]
        nbytes = sum(b for _s, b in shards)
        remote = bool(cmd.to) and cmd.to != self.address
        dest = self.sim.by_address.get(cmd.to) if remote else self
        if dest is None or not dest.alive:
            self._error(batch.session, batch.seq, COPY_OP, f"copy to {cmd.to} failed: worker unreachable",
                        m.ErrorKind.COPY)
            return 0.0
        for shard, b in shards:
            dest._put(cmd.namespace, shard, b)
        gbps = cost.network_gbps if remote else cost.host_gbps
        seconds = nbytes * 8 / (gbps * 1e9)
        if cmd.move:
            self.sim.moved(batch.session, nbytes, seconds)
        return seconds

    def _keep_copies(self, batch: m.Execute, cmd: m.CmdKeepCopies) -> None:
        """Copies kept from an earlier snapshot: filed under the new namespace, no time, no bytes moved."""
        store = self.store.get(cmd.source, {})
        for d, tids in cmd.devices.items():
            for tid in tids:
                b = store.get((tid, d))
                if b is None:
                    self._error(batch.session, batch.seq, COPY_OP, f"no copy of tensor {tid} on device {d} in "
                                                                   f"{cmd.source} at {self.address}", m.ErrorKind.COPY)
                    return
                self._put(cmd.namespace, (tid, d), b)

    def _fetch_shards(self, batch: m.Execute, cmd: m.CmdFetchShards) -> float:
        cost = self.sim.scenario.cost
        remote = bool(cmd.address) and cmd.address != self.address
        source = self.sim.by_address.get(cmd.address) if remote else self
        kind = m.ErrorKind.COPY if cmd.move else m.ErrorKind.OP  # a move's copy, or a restore
        if source is None or not source.alive:
            self._error(batch.session, batch.seq, FETCH_OP, f"fetch from {cmd.address} failed: worker unreachable",
                        kind)
            return 0.0
        store = source.store.get(cmd.namespace, {})
        nbytes = 0
        for d, tids in cmd.devices.items():
            for tid in tids:
                b = store.get((tid, d))
                if b is None:
                    self._error(batch.session, batch.seq, FETCH_OP, f"shard of tensor {tid} on device {d} is not "
                                                                    f"in {cmd.namespace} at {source.address}", kind)
                    continue
                self._put(batch.session, (tid, cmd.rename.get(d, d)), b)
                nbytes += b
        gbps = cost.network_gbps if remote else cost.host_gbps
        seconds = nbytes * 8 / (gbps * 1e9)
        if cmd.move:
            self.sim.moved(batch.session, nbytes, seconds)
        return seconds


_NONE = object()
_last_ref: list = [None, None]  # the args `_first_ref` read last and what it found (a step's workers ask in a row)


def _first_ref(value: object, top: bool = True) -> object:
    """The first tensor id in op arguments, as `m.tensor_refs(value)[0]` (None when there is none), without listing
    them all (every batch of every worker asks)."""
    if isinstance(value, dict):
        if len(value) == 1 and m.TENSOR_SLOT in value:
            return value[m.TENSOR_SLOT]
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return None if top else _NONE
    for v in value:
        if isinstance(v, (dict, list, tuple)):
            found = _first_ref(v, False)
            if found is not _NONE:
                return found
    return None if top else _NONE
