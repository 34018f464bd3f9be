"""Logical instructions -> per-worker commands, for one Submit batch of one session.

The controller stays op-agnostic: it routes each mesh-wide instruction to the workers hosting the
mesh's logical devices, restricted to the devices each one hosts, and keeps the session's tensor
registry (tid -> TensorSpec) up to date. An instruction it cannot route (unknown mesh or tensor, bad
placements, a device on a lost worker) becomes an ErrorReport for the session's next Sync; the rest
of the batch goes on. Nothing here raises on client input.

Rules:
  1. Each worker's commands keep the instructions' order.
  2. An instruction that runs alike on every device of a mesh (a CmdRun without per-device arguments, a CmdDelete
     of one mesh's tensors) is ONE shared command for all the mesh's workers (`dtorch_protocol.shared`): the
     translator builds one struct, not one per worker, and appends it once to the run of shared commands for
     that mesh's workers (`_shared`), which goes into every worker's list when something else comes (`_flush`).
     So translating such an instruction costs the same at 1 and at 64 workers.
  3. The first time a batch's translator routes to a mesh, each of the mesh's live workers gets a
     CmdMesh(mesh, its devices) first: the shared commands after it in the batch run on those devices.
  4. A read (InstrRead) is a hint, never an error: each live worker of the tensor's mesh gets one CmdReadable at
     that point of its stream, and an unknown tensor sends nothing (the client's early pulls then time out and
     it reads after the Sync instead).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dtorch_controller.core import collectives
from dtorch_controller.core import state as st
from dtorch_controller.core.model import DeferredDelete, Mesh, Session, Worker
from dtorch_controller.core.redistribute import PlanError, check_layout, parse_placements, plan_redistribute
from dtorch_protocol import messages as m
from dtorch_protocol.layout import holds_value, shard_box
from dtorch_protocol.placement_types import Placement


class InstrError(Exception):
    """An instruction that cannot be routed; becomes an ErrorReport."""


@dataclass
class Batch:
    """What one Submit produces."""

    cmds: dict[str, list[m.Cmd]] = field(default_factory=dict)  # worker id -> commands, in instruction order
    errors: list[m.ErrorReport] = field(default_factory=list)
    deferred: list[DeferredDelete] = field(default_factory=list)  # deletes waiting for remote readers


def translate(session: Session, instrs: list[m.Instr], workers: Mapping[str, Worker]) -> Batch:
    """Route `instrs`; updates `session.tensors` and `session.readers` as it goes."""
    return _Translator(session, workers).run(instrs)


def translator(session: Session, workers: Mapping[str, Worker]) -> _Translator:
    """A translator to feed one instruction at a time (`one`), seeing what each emits (programs.py compiles)."""
    return _Translator(session, workers)


def _describe(instr: m.Instr) -> tuple[str, str, int]:
    """(op, src, tid) for an ErrorReport about `instr`."""
    if isinstance(instr, m.InstrCreate):
        return f"create:{instr.init}", instr.src, instr.tid
    if isinstance(instr, m.InstrCall):
        out = next((o.tid for o in instr.outs if o is not None), -1)
        return instr.op, instr.src, out
    if isinstance(instr, m.InstrRedistribute):
        return "redistribute", instr.src_line, instr.dst
    if isinstance(instr, m.InstrAdopt):
        return "adopt", "", instr.tid
    if isinstance(instr, m.InstrRead):
        return "read", "", instr.tid
    return "delete", "", -1


class _Translator:
    def __init__(self, session: Session, workers: Mapping[str, Worker]) -> None:
        self.s = session
        self.workers = workers
        self.batch = Batch()
        self._lost_reported: set[str] = set()
        self._hosted: dict[int, tuple[dict[str, list[int]], dict[str, list[int]], Mesh]] = {}  # mesh id -> hosts
        self._declared: dict[int, dict[str, list[int]]] = {}  # mesh id -> the hosts its CmdMesh named (rule 3)
        self._run_hosts: dict[str, list[int]] | None = None  # the workers of the shared run (rule 2)
        self._run: list[m.Cmd] = []  # shared commands not yet in the workers' lists
        self._checked: set[tuple] = set()  # output layouts checked in this batch (`_out_layout`)

    def run(self, instrs: list[m.Instr]) -> Batch:
        handlers = {m.InstrCreate: self._create, m.InstrCall: self._call, m.InstrRedistribute: self._redistribute,
                    m.InstrDelete: self._delete, m.InstrAdopt: self._adopt, m.InstrRead: self._read}
        for instr in instrs:
            try:
                handlers[type(instr)](instr)
            except (InstrError, PlanError, ValueError) as e:
                self._error(instr, str(e))
            except Exception as e:  # noqa: BLE001 - a client must never crash the controller
                self._error(instr, f"internal controller error: {type(e).__name__}: {e}")
        self._flush()
        return self.batch

    def one(self, instr: m.Instr) -> dict[str, list[m.Cmd]]:
        """Route one more instruction into `batch`; returns the commands it emitted, per worker."""
        before = {w: len(cmds) for w, cmds in self.batch.cmds.items()}
        self.run([instr])
        return {w: cmds[before.get(w, 0):] for w, cmds in self.batch.cmds.items() if len(cmds) > before.get(w, 0)}

    # ------------------------------------------------------------ helpers

    def _error(self, instr: m.Instr, message: str) -> None:
        op, src, tid = _describe(instr)
        self.batch.errors.append(m.ErrorReport(op=op, src=src, message=message, tid=tid, kind=m.ErrorKind.REFUSED))

    def _emit(self, worker: str, cmd: m.Cmd) -> None:
        if self._run:
            self._flush()
        self.batch.cmds.setdefault(worker, []).append(cmd)

    def _shared(self, mesh: Mesh, hosts: dict[str, list[int]], cmd: m.Cmd) -> None:
        """Send `cmd`, which names `mesh` and no devices, to every worker in `hosts` (`_hosts(mesh)`; rules 2-3)."""
        if self._run_hosts is not hosts:
            if self._declared.get(mesh.id) is not hosts:
                self._declared[mesh.id] = hosts
                for worker, devices in hosts.items():
                    self._emit(worker, m.CmdMesh(mesh=mesh.id, devices=devices))
            self._flush()
            self._run_hosts = hosts
        self._run.append(cmd)

    def _flush(self) -> None:
        """The shared run into its workers' lists (one list extend per worker, whatever its length)."""
        run, hosts = self._run, self._run_hosts
        if run and hosts is not None:
            cmds = self.batch.cmds
            for worker in hosts:
                mine = cmds.get(worker)
                if mine is None:
                    cmds[worker] = list(run)
                else:
                    mine.extend(run)
            self._run = []

    def _mesh(self, mesh_id: int) -> Mesh:
        mesh = self.s.meshes.get(mesh_id)
        if mesh is None:
            raise InstrError(f"unknown mesh {mesh_id} (open it with OpenMesh first)")
        return mesh

    def _layout(self, spec: m.TensorSpec) -> tuple[Mesh, tuple[Placement, ...]]:
        mesh = self._mesh(spec.mesh)
        placements = parse_placements(tuple(spec.placements))
        check_layout(spec.shape, mesh.shape, placements)
        return mesh, placements

    def _out_layout(self, spec: m.TensorSpec) -> None:
        """`_layout`'s checks, done once per batch for each (mesh, placements, number of dims) of an op's outputs."""
        key = (spec.mesh, *spec.placements, len(spec.shape))
        if key not in self._checked:
            self._layout(spec)
            self._checked.add(key)
        elif spec.shape and min(spec.shape) < 0:
            raise PlanError(f"negative size in shape {list(spec.shape)}")

    def _spec(self, tid: int) -> m.TensorSpec:
        spec = self.s.tensors.get(tid)
        if spec is None:
            raise InstrError(f"unknown tensor {tid} in this session")
        return spec

    def _hosts(self, mesh: Mesh, instr: m.Instr, report_lost: bool = True) -> dict[str, list[int]]:
        """Worker -> the mesh devices it hosts (mesh order), leaving out lost workers (reported once a batch). Worked
        out once per mesh and batch (the binding does not change while a batch is translated); read-only."""
        known = self._hosted.get(mesh.id)
        if known is None or known[2] is not mesh:
            hosts: dict[str, list[int]] = {}
            for device in mesh.devices:
                hosts.setdefault(self.s.devices[device], []).append(device)
            lost = {w: hosts.pop(w) for w in list(hosts) if self.workers[w].state == st.LOST}
            known = self._hosted[mesh.id] = (hosts, lost, mesh)
        hosts, lost, _mesh = known
        if report_lost:
            for worker, devices in lost.items():
                if worker not in self._lost_reported:
                    self._lost_reported.add(worker)
                    self._error(instr, f"logical devices {devices} were on worker {worker}, which was lost; "
                                       "their part of this batch was skipped")
        return hosts

    # ------------------------------------------------------------ instructions

    def _create(self, instr: m.InstrCreate) -> None:
        mesh, placements = self._layout(instr.spec)
        shape = tuple(instr.spec.shape)
        for worker, devices in self._hosts(mesh, instr).items():  # each worker its own boxes
            boxes = {d: [list(r) for r in shard_box(shape, mesh.shape, placements, mesh.coord[d])] for d in devices}
            zero = [d for d in devices if not holds_value(placements, mesh.coord[d])]
            self._emit(worker, m.CmdCreate(
                tid=instr.tid, dtype=instr.spec.dtype, shape=list(shape), init=instr.init, boxes=boxes, zero=zero,
                value=instr.value, arange=instr.arange, seed=instr.seed, src=instr.src))
        self.s.tensors[instr.tid] = instr.spec

    def _call(self, instr: m.InstrCall) -> None:
        mesh = self._mesh(instr.mesh)
        refs = m.tensor_refs(instr.args)
        if instr.kwargs or instr.local:
            refs += m.tensor_refs([instr.kwargs, instr.local])
        tensors = self.s.tensors
        unknown = [t for t in refs if type(t) is not int or t not in tensors]
        if unknown:
            names = sorted({repr(t) for t in unknown})
            raise InstrError(f"unknown tensor{'s' if len(names) > 1 else ''} {', '.join(names)} in this session")
        for out in instr.outs:
            if out is not None:
                self._out_layout(out.spec)
        outs = [o.tid if o is not None else None for o in instr.outs]
        hosts = self._hosts(mesh, instr)
        if instr.seed is not None and len({self.workers[w].device_type for w in hosts}) > 1:
            kinds = sorted({self.workers[w].device_type for w in hosts})
            raise InstrError(f"{instr.op} draws random numbers on a mesh whose devices are {' and '.join(kinds)} "
                             "workers: each device type has its own generator, so the replicas would differ; "
                             "place the mesh on one device type")
        op, args, kwargs, src, seed, given = instr.op, instr.args, instr.kwargs, instr.src, instr.seed, instr.local
        if given is None:  # alike on every device: one command for all (rule 2)
            self._shared(mesh, hosts, m.CmdRun(op=op, devices=[], args=args, kwargs=kwargs, outs=outs, src=src,
                                               seed=seed, mesh=mesh.id, default_dtype=instr.default_dtype))
        else:  # per-device arguments: each worker only its own devices' (the bytes stay per worker)
            for worker, devices in hosts.items():
                self._emit(worker, m.CmdRun(op=op, devices=devices, args=args, kwargs=kwargs, outs=outs, src=src,
                                            seed=seed, local={d: given[d] for d in devices if d in given},
                                            default_dtype=instr.default_dtype))
        for out in instr.outs:
            if out is not None:
                self.s.tensors[out.tid] = out.spec

    def _redistribute(self, instr: m.InstrRedistribute) -> None:
        self._spec(instr.src)
        src_mesh, src_pl = self._layout(instr.src_spec)
        dst_mesh, dst_pl = self._layout(instr.dst_spec)
        if list(instr.src_spec.shape) != list(instr.dst_spec.shape):
            raise InstrError(f"redistribute cannot change the shape ({instr.src_spec.shape} -> {instr.dst_spec.shape})")
        if src_mesh.key == dst_mesh.key and self._collective(instr, src_mesh, src_pl, dst_pl):
            return  # collectives first: their cost rule needs no pieces, whose plan is O(devices^2) (rule 5)
        devices = sorted(set(src_mesh.devices) | set(dst_mesh.devices))
        where = tuple((d, self.s.devices[d], self.workers[self.s.devices[d]].address) for d in devices)
        plans = plan_redistribute(tuple(instr.src_spec.shape), src_mesh.key, src_pl, dst_mesh.key, dst_pl, where)
        lost_sources = sorted({p.device for _d, plan in plans for g in plan.groups for p in g
                               if self.workers[self.s.devices[p.device]].state == st.LOST})
        if lost_sources:
            raise InstrError(f"source shards on logical devices {lost_sources} were lost with their worker")
        by_device = dict(plans)
        readers = self.s.readers.setdefault(instr.src, {})
        dst_hosts = self._hosts(dst_mesh, instr)
        # Each source worker learns, at this point of its own stream, how many pulls of its shards the other
        # workers will make: it holds later in-place writes to them until those are served.
        expected: dict[str, dict[int, int]] = {}
        for worker, hosted in dst_hosts.items():
            for p in (p for d in hosted for g in by_device[d].groups for p in g):
                if self.s.devices[p.device] != worker:
                    reads = expected.setdefault(self.s.devices[p.device], {})
                    reads[p.device] = reads.get(p.device, 0) + 1
        for worker, reads in expected.items():
            self._emit(worker, m.CmdExpectReads(tid=instr.src, reads=dict(sorted(reads.items())), dst=instr.dst))
        for worker, hosted in dst_hosts.items():
            mine = {d: by_device[d] for d in hosted}
            self._emit(worker, m.CmdRedistribute(src=instr.src, dst=instr.dst, dtype=instr.dst_spec.dtype,
                                                 plans=mine, src_line=instr.src_line))
            if any(p.address for plan in mine.values() for g in plan.groups for p in g):
                readers[worker] = self.workers[worker].sent + 1  # the Execute this batch will send it
        if not readers:
            del self.s.readers[instr.src]
        self.s.tensors[instr.dst] = instr.dst_spec

    def _collective(self, instr: m.InstrRedistribute, mesh: Mesh, src_pl: tuple[Placement, ...],
                    dst_pl: tuple[Placement, ...]) -> bool:
        """The redistribution on collectives when the cost rule picks them (collectives.py); False: pieces."""
        worker_of = {d: self.s.devices[d] for d in mesh.devices}
        info = {w: (self.workers[w].device_type, self.workers[w].state != st.LOST and bool(self.workers[w].rendezvous),
                    collectives.Member(self.workers[w].address, self.workers[w].rendezvous, self.workers[w].device_id))
                for w in set(worker_of.values())}
        cmds = collectives.route(self.s.comm, tuple(instr.src_spec.shape), instr.dst_spec.dtype, mesh.key, src_pl,
                                 dst_pl, worker_of, info, (instr.src, instr.dst), instr.src_line)
        if cmds is None:
            return False
        for worker, batch in cmds.items():
            for cmd in batch:
                self._emit(worker, cmd)
        self.s.tensors[instr.dst] = instr.dst_spec
        return True

    def _delete(self, instr: m.InstrDelete) -> None:
        by_hosts: dict[int, tuple[Mesh, dict[str, list[int]], list[int]]] = {}  # tids deleted now, by hosts
        for tid in instr.tids:
            spec = self.s.tensors.pop(tid, None)  # deleting an unknown tensor is a no-op: delete is idempotent
            readers = self.s.readers.pop(tid, None)
            mesh = self.s.meshes.get(spec.mesh) if spec is not None else None
            if mesh is None:
                continue
            hosts = self._hosts(mesh, instr, report_lost=False)  # lost shards need no deleting
            waits = {w: seq for w, seq in readers.items()
                     if self.workers[w].state != st.LOST and self.workers[w].completed < seq} if readers else None
            if waits:
                self.batch.deferred.append(DeferredDelete(tid=tid, devices=hosts, waits=waits))
                continue
            by_hosts.setdefault(id(hosts), (mesh, hosts, []))[2].append(tid)
        if len(by_hosts) == 1:  # the usual case, tensors of one mesh: one CmdDelete for all its workers (rule 2)
            for mesh, hosts, tids in by_hosts.values():
                self._shared(mesh, hosts, m.CmdDelete(tids=tids, devices=[], mesh=mesh.id))
            return
        groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}  # one CmdDelete per worker and device set
        for _mesh, hosts, tids in by_hosts.values():
            for worker, devices in hosts.items():
                groups.setdefault((worker, tuple(devices)), []).extend(tids)
        for (worker, devices), tids in groups.items():
            self._emit(worker, m.CmdDelete(tids=tids, devices=list(devices)))

    def _read(self, instr: m.InstrRead) -> None:
        spec = self.s.tensors.get(instr.tid)
        mesh = self.s.meshes.get(spec.mesh) if spec is not None else None
        if mesh is not None:  # rule 4
            cmd = m.CmdReadable(mark=instr.mark)
            for worker in self._hosts(mesh, instr, report_lost=False):
                self._emit(worker, cmd)

    def _adopt(self, instr: m.InstrAdopt) -> None:
        self._layout(instr.spec)
        self.s.tensors[instr.tid] = instr.spec
