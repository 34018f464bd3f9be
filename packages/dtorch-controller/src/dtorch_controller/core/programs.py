"""A session's captured programs (`dtorch.compile`, issue #12 item 2): definitions kept, replays checked, and each
program's translated per-worker commands kept for one binding, so that a replay only fills in its tensor ids,
seeds and numbers. Pure.

`accept(store, instrs)` runs on every Submit: it takes each `InstrDefine` out of the batch (kept in `store`, the
session's `programs`) and checks each `InstrReplay`, which stays in the logged batch as it is (a few bytes: the
log names the definition it used, `LoggedBatch.programs`). When the batch goes out, `Compiled.replay` turns a
replay into commands; a rebuild after a loss translates the filled-in instructions (`fill`) on its new binding.

Rules:
  1. A definition is checked (`dtorch_protocol.programs.check`) and kept under its id, replacing one of the
     same id; a session holds at most MAX_PROGRAMS (a definition beyond them is refused).
  2. A replay of an unknown program, or naming the wrong number of tensor ids, seeds or numbers, is refused: it runs
     nothing and its error is raised at the session's next Sync (the instructions after it go on, as for any
     refused instruction).
  3. One batch's replays stand for at most MAX_EXPANDED instructions: replays beyond that are refused (a few bytes
     of replays must not make the controller translate millions of instructions on a rebuild).
  4. The first replay of a program is translated like the instructions it stands for (translate.py), one at a time,
     and each worker's commands are kept, with the replay's ids turned back into slots, on that worker
     (`CmdProgram`, sent before this replay's commands) and here (`Compiled`). They are kept only when the
     translation had no error and the replay's tensor ids and seeds were distinct. A later replay sends each of
     those workers one `CmdReplay` (the ids, seeds and numbers; `dtorch_protocol.programs.fill_cmds` on the
     worker): nothing is translated, and the core's work per replay is the registry's, not the commands'.
  5. A compiled program holds for one binding (`Compiled.holds`): the session's logical device -> worker map, the
     meshes it uses (the same objects), its process groups' generation, none of its workers lost, and the tensors
     it reads before writing them with the specs they had. Anything else (a rebuild after a loss, a migration, a
     relocation, elastic growth or shrink, a drain all rebind devices; a new mesh under an old id; another
     layout) and that replay is translated again from the instructions and compiled anew: a stale translation
     is never sent.
  6. What depends on the moment is redone per replay: the tensor registry and the tensors' origins (their net
     change), a redistribution's remote readers (this batch's Execute), each process group's op numbers (they go
     on from the group's counter, sent in the CmdReplay; the CmdGroup that made a group is not repeated), and the
     deletes of tensors the program moved to other workers by pulls: held back until those readers are done, as
     translate.py does. A program that deletes a tensor from outside it while remote readers of it are pending
     is translated again (rule 5).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dtorch_controller.core import state as st
from dtorch_controller.core.lineage import Note, instr_tids, note_origins, origin_notes
from dtorch_controller.core.model import DeferredDelete, Mesh, Session, Worker
from dtorch_controller.core.translate import Batch, translator
from dtorch_protocol import messages as m
from dtorch_protocol import programs as p

MAX_EXPANDED = 1 << 18  # instructions one Submit's replays may stand for (rule 3)



def _refusal(program: int, message: str) -> m.ErrorReport:
    return m.ErrorReport(op=f"program:{program}", src="", message=message, kind=m.ErrorKind.REFUSED)


def accept(store: dict[int, m.InstrDefine], instrs: list[m.Instr]
           ) -> tuple[list[m.Instr], dict[int, m.InstrDefine], list[m.ErrorReport]]:
    """The batch to log (definitions out, checked replays in), the definition each replay names, and the refusals
    (rules 1-3). A program defined again after a replay of it in the same batch: that replay is filled in."""
    if not any(type(i) is m.InstrDefine or type(i) is m.InstrReplay for i in instrs):
        return instrs, {}, []
    out: list[m.Instr] = []
    named: dict[int, m.InstrDefine] = {}
    refused: list[m.ErrorReport] = []
    expanded = 0
    for instr in instrs:
        if type(instr) is m.InstrDefine:
            problem = p.check(instr)
            if problem is None and instr.program not in store and len(store) >= p.MAX_PROGRAMS:
                problem = f"program {instr.program}: a session holds at most {p.MAX_PROGRAMS} programs"
            if problem is not None:
                refused.append(_refusal(instr.program, problem))
                continue
            store[instr.program] = instr
            old = named.pop(instr.program, None)
            if old is not None:  # the log names one definition per id: earlier replays become instructions
                out = [i for r in out for i in (fill(old, r) if type(r) is m.InstrReplay and r.program ==
                                                instr.program else [r])]
        elif type(instr) is m.InstrReplay:
            d = store.get(instr.program)
            problem = f"unknown program {instr.program}" if d is None else p.check_replay(d, instr)
            if problem is None and expanded + len(d.instrs) > MAX_EXPANDED:
                problem = f"replay of program {instr.program}: one batch expands to at most {MAX_EXPANDED} instructions"
            if problem is not None:
                refused.append(_refusal(instr.program, problem))
            else:
                expanded += len(d.instrs)
                named[instr.program] = d
                out.append(instr)
        else:
            out.append(instr)
    return out, named, refused


def fill(d: m.InstrDefine, r: m.InstrReplay) -> list[m.StepInstr]:
    """The instructions replay `r` of `d` stands for."""
    return p.fill(d.instrs, r.tids, r.seeds, r.scalars)


def size(instrs: list[m.Instr], named: Mapping[int, m.InstrDefine]) -> int:
    """How many instructions a logged batch stands for (a replay: its program's; the metrics and usage count)."""
    return sum(len(named[r.program].instrs) if type(r) is m.InstrReplay else 1 for r in instrs)


def expand(instrs: list[m.Instr], named: Mapping[int, m.InstrDefine]) -> list[m.Instr]:
    """A logged batch with each replay filled in (a rebuild translates these on its new binding)."""
    return [i for r in instrs for i in (fill(named[r.program], r) if type(r) is m.InstrReplay else [r])]


# ------------------------------------------------------------------ compiled programs (rules 4-6)


@dataclass
class Compiled:
    """A program translated for one binding (rules 4-6); slots stand for a replay's ids."""

    define: m.InstrDefine
    version: int  # its workers' CmdProgram.version
    devices: dict[int, str]  # the binding it holds for (rule 5)
    meshes: tuple[tuple[int, Mesh], ...]
    generation: int
    workers: tuple[str, ...]  # every worker hosting a device of its meshes
    inputs: tuple[tuple[int, m.TensorSpec | None], ...]  # slot -> spec of what it reads before writing (None: no
    # such tensor, a delete of it did nothing)
    deleted_inputs: tuple[int, ...]  # inputs it deletes: they must have no remote readers pending (rule 6)
    programs: dict[str, m.CmdProgram]  # worker -> its commands
    registry: tuple[tuple[int, m.TensorSpec | None], ...]  # slot -> spec after it (None: deleted)
    notes: tuple[Note, ...]  # origins, net
    readers: tuple[tuple[int, tuple[str, ...]], ...]  # source slot -> workers that pull it (redistributions)
    held: tuple[tuple[int, dict[str, list[int]]], ...]  # deletes held back for those pulls: slot -> its devices
    groups: dict[str, int]  # group -> op numbers one replay takes

    def holds(self, s: Session, workers: Mapping[str, Worker], tids: list[int]) -> bool:
        """Rule 5 (and rule 6's inputs deleted while read)."""
        if s.comm.generation != self.generation or s.devices != self.devices:
            return False
        if any(s.meshes.get(k) is not mesh for k, mesh in self.meshes):
            return False
        if any((w := workers.get(wid)) is None or w.state == st.LOST for wid in self.workers):
            return False
        tensors, readers = s.tensors, s.readers
        if any(tids[k] in readers for k in self.deleted_inputs):
            return False
        return all((have := tensors.get(tids[k])) is spec or have == spec for k, spec in self.inputs)

    def replay(self, s: Session, workers: Mapping[str, Worker], r: m.InstrReplay, origin: dict[int, tuple[str, str]]
               ) -> Batch:
        """One CmdReplay per worker, and the session changed as the instructions would have (rule 6). Call only when
        it `holds`."""
        tids = r.tids
        comm = {g.id: g for g in s.comm.groups.values() if g.id in self.groups}
        base = {gid: g.seq for gid, g in comm.items()}
        cmd = m.CmdReplay(program=r.program, version=self.version, tids=tids, seeds=r.seeds, scalars=r.scalars,
                          groups=base)
        batch = Batch(cmds={w: [cmd] for w in self.programs})
        tensors, readers = s.tensors, s.readers
        for k, spec in self.registry:
            if spec is None:
                tensors.pop(tids[k], None)
            else:
                tensors[tids[k]] = spec
        for k, pulled_by in self.readers:
            mine = readers.setdefault(tids[k], {})
            for w in pulled_by:
                mine[w] = workers[w].sent + 1  # the Execute this batch will send it
        for k, devices in self.held:
            tid = tids[k]
            waits = {w: q for w, q in readers.pop(tid, {}).items()
                     if workers[w].state != st.LOST and workers[w].completed < q}
            if waits:
                batch.deferred.append(DeferredDelete(tid=tid, devices=devices, waits=waits))
            else:
                for w, devs in devices.items():
                    batch.cmds.setdefault(w, []).append(m.CmdDelete(tids=[tid], devices=devs))
        for gid, g in comm.items():
            g.seq = base[gid] + self.groups[gid]
        note_origins(origin, self.notes, tids.__getitem__)
        return batch


def compile_replay(s: Session, workers: Mapping[str, Worker], d: m.InstrDefine, r: m.InstrReplay,
                   origin: dict[int, tuple[str, str]], version: int) -> tuple[Batch, Compiled | None]:
    """Translate replay `r` of `d` instruction by instruction; returns its batch (with each worker's CmdProgram first
    when the program can be kept) and the compiled program, or None (rule 4)."""
    # numbers stay holes while translating (routing never reads them): the workers' programs keep them, this
    # replay's commands get its numbers after
    instrs = [p.map_ids(i, r.tids.__getitem__, r.seeds.__getitem__) for i in d.instrs]
    note_origins(origin, origin_notes(instrs))
    slot = {t: k for k, t in enumerate(r.tids)}
    seed_slot = {x: k for k, x in enumerate(r.seeds)}
    keep = len(slot) == len(r.tids) and len(seed_slot) == len(r.seeds)
    groups_before = {g.id: g.seq for g in s.comm.groups.values()}
    inputs: dict[int, m.TensorSpec | None] = {}
    deleted_inputs: set[int] = set()
    written: set[int] = set()
    readers: dict[int, set[str]] = {}
    held: list[tuple[int, dict[str, list[int]]]] = []
    one = translator(s, workers)
    for instr in instrs:
        made = _made(instr)
        for t in instr_tids(instr) - made:
            if t not in written:
                inputs.setdefault(slot[t], s.tensors.get(t))
                if type(instr) is m.InstrDelete:
                    deleted_inputs.add(slot[t])
        written |= made
        src = instr.src if type(instr) is m.InstrRedistribute else None
        had = dict(s.readers.get(src, {})) if src is not None else {}
        deferred = len(one.batch.deferred)
        one.one(instr)
        if src is not None:
            readers.setdefault(slot[src], set()).update(w for w, q in s.readers.get(src, {}).items() if had.get(w) != q)
        for dd in one.batch.deferred[deferred:]:
            if dd.tid not in written or slot[dd.tid] not in readers:
                keep = False  # an outside tensor's pending readers (rule 6)
            held.append((slot[dd.tid], dd.devices))
    batch = one.batch
    keep = keep and not batch.errors
    memo: dict[int, Any] = {}
    unslot, unseed = slot.__getitem__, seed_slot.__getitem__

    def offset(group: str, q: int) -> int:
        return q - groups_before.get(group, 0)

    programs = {w: m.CmdProgram(program=d.program, version=version, ntids=d.ntids, nseeds=d.nseeds,
                                nscalars=d.nscalars, cmds=[p.map_cmd(c, unslot, unseed, p.keep_hole, offset, memo)
                                                           for c in cmds if type(c) is not m.CmdGroup])
                for w, cmds in batch.cmds.items()} if keep else {}
    if d.nscalars:  # this replay's numbers into its own commands
        fill_in, memo = r.scalars.__getitem__, {}
        batch.cmds = {w: [c if type(c) is m.CmdGroup else p.map_cmd(c, int, int, fill_in, _same, memo) for c in cmds]
                      for w, cmds in batch.cmds.items()}
    if not keep:
        return batch, None
    for w, program in programs.items():
        batch.cmds[w].insert(0, program)
    used = {instr.mesh for instr in instrs if type(instr) is m.InstrCall}
    used |= {spec.mesh for instr in instrs for spec in _spec_of(instr)}
    used |= {spec.mesh for spec in inputs.values() if spec is not None}
    meshes = tuple((k, s.meshes[k]) for k in sorted(used) if k in s.meshes)
    bound = {s.devices.get(dev, "") for _k, mesh in meshes for dev in mesh.devices} - {""}
    registry: dict[int, m.TensorSpec | None] = {}
    for instr in d.instrs:
        registry.update(_specs(instr))
    return batch, Compiled(
        define=d, version=version, devices=dict(s.devices), meshes=meshes, generation=s.comm.generation,
        workers=tuple(sorted(bound)), inputs=tuple(inputs.items()), deleted_inputs=tuple(sorted(deleted_inputs)),
        programs=programs, registry=tuple(registry.items()), notes=tuple(_net(origin_notes(d.instrs))),
        readers=tuple((k, tuple(sorted(ws))) for k, ws in readers.items() if ws), held=tuple(held),
        groups={g.id: g.seq - groups_before.get(g.id, 0) for g in s.comm.groups.values()
                if g.seq != groups_before.get(g.id, 0)})


def replay(cache: dict[int, Compiled], s: Session, workers: Mapping[str, Worker], d: m.InstrDefine,
           r: m.InstrReplay, origin: dict[int, tuple[str, str]], version: int) -> Batch:
    """The commands of replay `r` of `d`: its compiled program's CmdReplay when that holds (rule 5), else translated
    and compiled again as translation `version` (rule 4). `cache`: the session's compiled programs by id."""
    c = cache.get(r.program)
    if c is not None and c.define is d and c.holds(s, workers, r.tids):
        return c.replay(s, workers, r, origin)
    batch, c = compile_replay(s, workers, d, r, origin, version)
    if c is None:
        cache.pop(r.program, None)
    else:
        cache[r.program] = c
    return batch


def _same(_group: str, q: int) -> int:
    return q


def _net(notes: Iterable[Note]) -> list[Note]:
    """What notes leave behind whatever came before them: one per tensor (`note_origins` keeps the first maker)."""
    net: dict[int, Note] = {}
    for how, tid, what in notes:
        last = net.get(tid)
        if how != "first" or last is None:
            net[tid] = (how, tid, what)
        elif last[0] == "drop":
            net[tid] = ("set", tid, what)
    return list(net.values())


def _made(instr: m.Instr) -> set[int]:
    """The tensors an instruction writes and does not read (an in-place output is in its arguments)."""
    if type(instr) is m.InstrCreate:
        return {instr.tid}
    if type(instr) is m.InstrCall:
        return {o.tid for o in instr.outs if o is not None} - set(m.tensor_refs([instr.args, instr.kwargs,
                                                                                instr.local or {}]))
    if type(instr) is m.InstrRedistribute:
        return {instr.dst}
    return set()


def _spec_of(instr: m.StepInstr) -> list[m.TensorSpec]:
    if type(instr) is m.InstrCreate:
        return [instr.spec]
    if type(instr) is m.InstrCall:
        return [o.spec for o in instr.outs if o is not None]
    if type(instr) is m.InstrRedistribute:
        return [instr.src_spec, instr.dst_spec]
    return []


def _specs(instr: m.StepInstr) -> list[tuple[int, m.TensorSpec | None]]:
    """The registry changes of a translated instruction, in slots (what translate.py does to `tensors`)."""
    if type(instr) is m.InstrCreate:
        return [(instr.tid, instr.spec)]
    if type(instr) is m.InstrCall:
        return [(o.tid, o.spec) for o in instr.outs if o is not None]
    if type(instr) is m.InstrRedistribute:
        return [(instr.dst, instr.dst_spec)]
    if type(instr) is m.InstrDelete:
        return [(t, None) for t in instr.tids]
    return []
