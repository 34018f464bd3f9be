"""What the core keeps to rebuild a session after a worker loss: its instruction log and its copies.

Rules:

1. Lineage is kept per session as (snapshot, log): a *snapshot* is a complete set of copies of every
   live shard at the end of one client batch, and the *log* holds every client batch accepted after it.
   Replaying the log on top of the snapshot rebuilds every tensor exactly: ops are deterministic on
   the same inputs and random ops carry their seeds.
2. Each logical device's copies exist twice: on the worker that hosted it then (local, cheap to restore
   from when that worker survives) and in host memory of another worker, on another node whenever the
   cluster has one (survives the loss of the first, and of its whole node). A session is *protected* when
   it has a complete snapshot; with a single worker it is not.
3. Uploads (InstrAdopt) have no lineage: their shards are copied (local + another worker) from the point of
   the adopt in the stream, kept while the adopt is in the log. The copies are made in the background
   (`CmdSendShards.background`: the worker's next commands do not wait, bounded bytes in flight); they count
   as complete when the adopt's batch does. A worker lost before its batch did leaves no copy of its own
   devices' shards (the backup may be partial): a replica's copy stands in for them where the upload is
   replicated (`upload_source`, restored with `CmdFetchShards.rename`). A rebuild waits for the copies live
   workers are making (recovery.py rule 1), and a copy to a lost backup worker leaves the primary's own
   (snapshots.py rule 3). What no copy holds, the client Puts again (`reputs`, recovery.py rule 7): the shards its
   lost primary had not copied yet.
4. Copies live on workers under namespaces derived from the session id (`{session}#s{n}` for snapshot
   n, `{session}#a{n}` for uploads adopted in window n); the log is truncated and older namespaces are
   dropped when a newer snapshot is complete. Memory is bounded by two copies of the session's live
   tensors plus its uploads of one window, and the log by the snapshot interval.
5. A routine snapshot copies only what changed: a tensor of the previous snapshot that no batch since wrote
   (`written`: outputs, `InstrCall.writes`, a replayed program's writes), with the same spec and on the same
   two workers, keeps that snapshot's copies (CmdKeepCopies on both, no byte moves); so does an upload nothing
   wrote after its adopt, whose copies (rule 3) are complete, with its upload's copies. The rest is copied. A
   forced snapshot (after a loss, a move, a drain, a failed copy) copies everything, and a tensor whose copy a
   worker found stale (snapshots.py rule 6: aliasing the controller cannot see) is always copied.
6. Nothing here does I/O or reads a clock: the pipeline (the log, uploads' copies at their adopt), snapshots.py
   and recovery.py drive it from the core's events.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from dtorch_controller.core.collectives import ITEMSIZE
from dtorch_controller.core.model import Mesh, Session
from dtorch_controller.core.redistribute import parse_placements
from dtorch_protocol import messages as m
from dtorch_protocol.layout import shard_box


@dataclass
class LoggedBatch:
    """One accepted client batch."""

    seq: int
    instrs: list[m.Instr]  # plain instructions, and replays of captured programs (never their definitions)
    sent: bool = False  # translated and sent to workers
    programs: dict[int, m.InstrDefine] = field(default_factory=dict)  # the definition each replay here names


@dataclass
class Copies:
    """Copies of shards in one namespace: a snapshot, or the uploads of one InstrAdopt."""

    namespace: str
    upto: int  # the client batch they follow (snapshot) or belong to (adopt)
    tensors: dict[int, m.TensorSpec]  # snapshot: every live tensor then; adopt: the uploaded one
    holders: dict[int, list[str]] = field(default_factory=dict)  # logical device -> workers with a copy
    pending: dict[str, int] = field(default_factory=dict)  # worker -> Execute seq to complete (being made)
    unmade: set[int] = field(default_factory=set)  # an upload's devices whose lost worker had not copied them
    failed: str = ""  # why they cannot be used
    started: float = 0.0
    bytes: int = 0  # of every shard they hold
    copied: int = 0  # of those copied when they were made (the rest kept from the snapshot before, rule 5)
    first_seq: dict[str, int] = field(default_factory=dict)  # worker -> its first Execute seq after them
    covers: set[int] = field(default_factory=set)  # snapshot: uploads asked for again, sent before it (snapshots r. 7)

    @property
    def complete(self) -> bool:
        return not self.pending and not self.failed


@dataclass
class Lineage:
    """Per session: the log since the last complete snapshot, the snapshot, uploads' copies."""

    enabled: bool = True  # False once a loss was unrecoverable (or recovery is off): only the held tail is kept
    why: str = ""  # why it was turned off
    log: list[LoggedBatch] = field(default_factory=list)
    snapshot: Copies | None = None  # complete
    taking: Copies | None = None  # being made
    adopts: dict[int, Copies] = field(default_factory=dict)  # tid -> copies of its upload
    window: int = 0  # numbers namespaces: snapshot n opens window n
    namespaces: dict[str, set[str]] = field(default_factory=dict)  # namespace -> workers holding some of it
    origin: dict[int, tuple[str, str]] = field(default_factory=dict)  # tid -> (op, src) that made it
    force: bool = False  # take a snapshot as soon as possible (copies were lost, a drain needs it)
    unkeepable: set[int] = field(default_factory=set)  # tensors whose copies a worker found stale: always copied
    last_snapshot_at: float = 0.0
    sent_upto: int = 0  # the last batch sent to workers
    delivered: int = 0  # highest batch whose errors reached the client (a Sync answered done)
    window_errors: list[tuple[str, m.ErrorReport]] = field(default_factory=list)  # (worker, report) not delivered
    replayed: dict[str, dict[int, int]] = field(default_factory=dict)  # worker -> Execute seq -> replayed batch
    reset_seq: dict[str, int] = field(default_factory=dict)  # worker -> seq of its last CmdAbandon
    recoveries: int = 0
    migrations: int = 0

    def sent_batches(self) -> Iterator[LoggedBatch]:
        return (b for b in self.log if b.sent)

    def batches_since_snapshot(self) -> int:
        upto = self.snapshot.upto if self.snapshot is not None else 0
        return max(0, self.sent_upto - upto)


def instr_tids(instr: m.Instr) -> set[int]:
    """Every tensor id an instruction names (made, read, moved or deleted)."""
    if isinstance(instr, (m.InstrCreate, m.InstrAdopt)):
        return {instr.tid}
    if isinstance(instr, m.InstrCall):
        out = {o.tid for o in instr.outs if o is not None}
        return out | {t for t in m.tensor_refs([instr.args, instr.kwargs, instr.local or {}]) if isinstance(t, int)}
    if isinstance(instr, m.InstrRedistribute):
        return {instr.src, instr.dst}
    if isinstance(instr, (m.InstrDelete, m.InstrReplay)):  # a replay names every tensor of its program
        return set(instr.tids)
    return set()


Note = tuple[str, int, tuple[str, str]]  # ("set" | "first" | "drop", tid, (op, src))


def origin_notes(instrs: list[m.Instr]) -> Iterator[Note]:
    """Which op made each tensor, as notes for `note_origins` (a program keeps its own, in slots)."""
    for instr in instrs:
        if isinstance(instr, m.InstrCreate):
            yield "set", instr.tid, (f"create:{instr.init}", instr.src)
        elif isinstance(instr, m.InstrAdopt):
            yield "set", instr.tid, ("upload (distribute_tensor)", "")
        elif isinstance(instr, m.InstrCall):
            for o in instr.outs:
                if o is not None:
                    yield "first", o.tid, (instr.op, instr.src)  # in-place ops keep the first maker
        elif isinstance(instr, m.InstrRedistribute):
            yield "set", instr.dst, ("redistribute", instr.src_line)
        elif isinstance(instr, m.InstrDelete):
            for tid in instr.tids:
                yield "drop", tid, ("", "")


def note_instrs(origin: dict[int, tuple[str, str]], instrs: list[m.Instr]) -> None:
    """`note_origins(origin, origin_notes(instrs))` without making the notes: an eager batch's path, run for every
    instruction (`test_core_translate` holds the two to the same result)."""
    for instr in instrs:
        t = type(instr)
        if t is m.InstrCall:
            for o in instr.outs:
                if o is not None and o.tid not in origin:
                    origin[o.tid] = (instr.op, instr.src)
        elif t is m.InstrDelete:
            for tid in instr.tids:
                origin.pop(tid, None)
        else:
            note_origins(origin, origin_notes([instr]))


def note_origins(origin: dict[int, tuple[str, str]], notes: Iterable[Note], tids: Callable[[int], int] = int,
                 ) -> None:
    """Remember which op made each tensor (for the message when it cannot be rebuilt); `tids` maps a note's id."""
    for how, tid, what in notes:
        if how == "set":
            origin[tids(tid)] = what
        elif how == "first":
            origin.setdefault(tids(tid), what)
        else:
            origin.pop(tids(tid), None)


def written(batches: Iterable[LoggedBatch], adopts: bool = True) -> set[int] | None:
    """Every tensor the batches write (rule 5), their uploads (adopts) too unless told not to; None when that
    cannot be told (a replay of an unknown program)."""
    out: set[int] = set()
    for b in batches:
        for instr in b.instrs:
            if not adopts and type(instr) is m.InstrAdopt:
                continue
            if type(instr) is m.InstrReplay:
                d = b.programs.get(instr.program)
                if d is None:
                    return None
                slots = set().union(*(_writes(i) for i in d.instrs))
                out.update(t for k, t in enumerate(instr.tids) if k in slots)
            else:
                out |= _writes(instr)
    return out


def _writes(instr: m.Instr) -> set[int]:
    t = type(instr)
    if t is m.InstrCall:
        return {o.tid for o in instr.outs if o is not None} | set(instr.writes)
    if t is m.InstrRedistribute:
        return {instr.dst}
    if t is m.InstrCreate or t is m.InstrAdopt:
        return {instr.tid}
    return set()  # deletes


def shard_bytes(spec: m.TensorSpec, mesh: Mesh, device: int) -> int:
    """Logical bytes of `device`'s shard of a tensor (0 when the device is not in the mesh)."""
    coord = mesh.coord.get(device)
    if coord is None:
        return 0
    try:
        box = shard_box(tuple(spec.shape), mesh.shape, parse_placements(tuple(spec.placements)), coord)
    except (ValueError, IndexError):
        return 0
    return math.prod(n for _, n in box) * ITEMSIZE.get(spec.dtype, 4)


def tensors_on(tensors: dict[int, m.TensorSpec], meshes: dict[int, Mesh], device: int) -> list[int]:
    """Tensors (sorted ids) with a shard on logical `device`."""
    return sorted(tid for tid, spec in tensors.items()
                  if (mesh := meshes.get(spec.mesh)) is not None and device in mesh.coord)


def copy_source(copies: Copies, device: int, target: str, alive: Callable[[str], bool]) -> str | None:
    """Where `target` restores `device`'s copies from: itself when it holds them, else a live holder."""
    holders = [w for w in copies.holders.get(device, []) if alive(w)]
    if target in holders:
        return target
    return holders[0] if holders else None


def upload_source(copies: Copies, spec: m.TensorSpec, mesh: Mesh, device: int, target: str,
                  alive: Callable[[str], bool]) -> tuple[int, str] | None:
    """Where `target` restores `device`'s shard of an upload from: (the device whose copy it takes, a live holder of
    it). Its own copy when one is live; else a replica's, a device of the mesh whose shard is the same box of the
    same value (no Partial placement), as when the lost worker's own copy was partial (rule 3)."""
    source = copy_source(copies, device, target, alive)
    if source is not None:
        return device, source
    placements = parse_placements(tuple(spec.placements))
    if device not in mesh.coord or any(p.is_partial() for p in placements):
        return None
    box = shard_box(tuple(spec.shape), mesh.shape, placements, mesh.coord[device])
    for other in mesh.devices:
        if other != device and shard_box(tuple(spec.shape), mesh.shape, placements, mesh.coord[other]) == box \
                and (source := copy_source(copies, other, target, alive)) is not None:
            return other, source
    return None


def reputs(s: Session, rec: Lineage, alive: Callable[[str], bool]) -> dict[int, list[int]]:
    """The uploads the replayed log restores that the client must Put again (rule 3), tensor id -> logical devices:
    each device whose copy its lost primary was making (no holder left) and no replica's stands in for."""
    out: dict[int, list[int]] = {}
    for b in rec.sent_batches():
        for instr in b.instrs:
            if type(instr) is m.InstrAdopt and (copies := rec.adopts.get(instr.tid)) is not None and copies.unmade \
                    and (mesh := s.meshes.get(instr.spec.mesh)) is not None:
                devices = [d for d in mesh.devices if d in copies.unmade
                           and upload_source(copies, instr.spec, mesh, d, "", alive) is None]
                if devices:
                    out[instr.tid] = devices
    return out


def copy_upload(s: Session, rec: Lineage, instr: m.InstrAdopt, seq: int, now: float, cmds: dict[str, list[m.Cmd]],
                backup_for: Callable[[str], str | None], address: Callable[[str], str]) -> Copies | None:
    """Append to `cmds` the copies of an upload at its adopt (rule 3: on its worker and on `backup_for` it)."""
    mesh = s.meshes.get(instr.spec.mesh)
    if mesh is None:
        return None
    namespace = f"{s.id}#a{rec.window}"
    copies = Copies(namespace=namespace, upto=seq, tensors={instr.tid: instr.spec}, started=now)
    by_worker: dict[str, list[int]] = {}
    for d in mesh.devices:
        by_worker.setdefault(s.devices[d], []).append(d)
    for primary, devices in by_worker.items():
        holder = backup_for(primary)
        shards = {d: [instr.tid] for d in devices}
        cmds.setdefault(primary, []).append(m.CmdSendShards(devices=shards, namespace=namespace, host=True,
                                                            background=True))
        holders = [primary]
        if holder is not None:
            cmds[primary].append(m.CmdSendShards(devices=shards, namespace=namespace, to=address(holder), host=True,
                                                 background=True))
            holders.append(holder)
        for d in devices:
            copies.holders[d] = holders
        copies.pending[primary] = 0  # the seq is known once sent
        for w in holders:
            rec.namespaces.setdefault(namespace, set()).add(w)
    rec.adopts[instr.tid] = copies
    return copies


def restore_upload(s: Session, rec: Lineage, instr: m.InstrAdopt, cmds: dict[str, list[m.Cmd]],
                   alive: Callable[[str], bool], address: Callable[[str], str]) -> None:
    """Append to `cmds` the restore of an upload from its copies, replaying its adopt after a loss."""
    copies = rec.adopts.get(instr.tid)
    mesh = s.meshes.get(instr.spec.mesh)
    if copies is None or not copies.tensors or mesh is None:
        return
    for d in mesh.devices:
        target = s.devices[d]
        found = upload_source(copies, instr.spec, mesh, d, target, alive)
        if found is None:
            continue  # checked before the rebuild started; a read of it will say it is missing
        of, source = found
        cmds.setdefault(target, []).append(m.CmdFetchShards(
            devices={of: [instr.tid]}, namespace=copies.namespace, address="" if source == target else address(source),
            rename={of: d} if of != d else {}))
