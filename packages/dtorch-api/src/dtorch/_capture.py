"""Recording and replaying steps: the machinery of `dtorch.compile` and `dtorch.auto_compile` (steps.py).

A recording runs a step eagerly and keeps, per operation, what a replay needs to match it; a replay only matches
the step's operations against the program and sends one `InstrReplay(program, tensor ids, seeds, numbers)`.

Rules:
  1. An *operation* is a top-level aten op (`__torch_dispatch__`), a redistribution or a factory; what it
     does inside (nested ops, temporaries) belongs to it. Recording one keeps its key (the op, the spec id of
     each DTensor, every other argument), the slot of each DTensor it reads, how many tensor ids it makes and
     seeds it draws, its instructions in slot form (`dtorch_protocol.programs`) and how its result is built.
  2. Slots are numbered in order of first use: a DTensor from outside the step the first time an operation
     reads it, a tensor id when an operation makes it. A replayed operation matches when its key is equal and
     each DTensor sits in the recorded slot (a new outside tensor where the recording had one); it then makes
     its tensor ids, draws its seeds from torch's generator (so later random values are those of an eager
     run) and builds its result.
  3. A mismatch (other shapes, placements, dtypes, mesh, ops or non-float arguments; a sync point, an upload
     or any other instruction) ends the replay for this step: the instructions of the operations matched so far are
     filled in and emitted, and the step goes on eagerly. The next call records again. Either way the same
     instructions run in the same order with the same seeds, so results are identical to an eager run.
  4. Deletes. A tensor made and dropped by one operation is deleted where it was. A tensor made in the step
     and dropped by the user's code is deleted at its place in the program only if the replay dropped it
     too (else the step falls back at its end, rule 3); dropped tensors the program does not delete, and
     tensors from outside the step dropped during it, are released after the step's instructions.
  5. A recording that holds what a replay cannot reproduce (a sync point, an upload, a plain tensor mixed
     into an op, an operation that changes a DTensor's id or layout in place or that raised, another session's
     tensors, a write that reaches a view of a copy moved before the step: `_views`) makes the step run eagerly
     from then on, with one warning saying why. A view of a moved copy made in the step is rebuilt by a replay
     with its origin (`_views`), so its copy lives as long as it does; while one made before the step lives, a
     replay falls back (rule 3).
  6. Numbers. An op whose float arguments changed (an optimizer's step size, a learning rate schedule) is
     planned again, into a list: when its instructions are the program's but for numbers in the op's
     arguments, those numbers become holes of the program (`{"$s": k}`, defined again once) and the replay
     sends their values. An elementwise or `_foreach_` op then reads them from its key (each at the one float that
     holds its value, or in order when every float of the key is a hole: a list of equal step sizes); any other
     op with holes is planned again in each later replay. Every other op is only matched.

Automatic capture (on by default; `dtorch.auto_compile(False)` turns it off): no step is marked; the operations
between two boundaries are one.
  7. A boundary is a sync point (`loss.item()`, `print(x)`), an upload, a flush or a `dtorch.compile` step (which
     runs as its own, as above). A background fetch (`to_torch_async`) is one where it is asked for.
  8. An automatic step is recorded or replayed as a compiled one is (rules 1-6), and ends at the next boundary,
     also one inside an operation (`.item()` is one): the recording ends before that operation, and a replay
     that has matched its whole program is sent there (an operation past the program's end ends it too). The
     operation goes on eagerly.
  9. Steps are told apart by their first operation's key (at most MAX_TRACKS kinds; the oldest gives way, its
     program id defined again). Per kind, steps run eagerly until two in a row made as many tensor ids (the
     step repeats; a training loop's first step makes the optimizer's state); the next one is recorded, and
     later ones are replayed while they match. A recording that defines nothing (unreplayable, fewer than
     MIN_OPS operations or more than MAX_OPS) or a fallback makes the next 2, 4, ... MAX_WAIT steps of that
     kind run eagerly before the next recording. Sizes cost nothing per op: each boundary takes a tensor id.

Threads:
  10. A step belongs to the thread that runs it (automatic capture: the thread that turned it on). Another
     thread's DTorch calls while it runs (a thread that uploads the next batches, one that logs a loss) go the eager
     way: its ops skip the step hook and the session's per-op calls send its instructions as they come, never into
     the step's program. Its first call also ends automatic capture for the session (one warning), which the owning
     thread carries out at its next step: a program records one thread's operations, and another thread's would
     interleave with them differently each time. Compiled steps (`dtorch.compile`) stay.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import torch.utils._pytree as pytree

from dtorch import _dispatch, _planner, _views
from dtorch._source import stacklevel
from dtorch.dtensor import DTensor, wrap
from dtorch.session import Session
from dtorch_protocol import messages as m
from dtorch_protocol import programs

_decode_instr = msgspec.msgpack.Decoder(m.Instr).decode


class Unreplayable(Exception):
    """The recording holds something a replay cannot reproduce (rule 5); str() says what."""


@dataclass
class _Op:
    key: Any
    leaf_slots: tuple[int, ...]  # the slot of each DTensor read (== slots so far: a new outside tensor)
    made: int  # tensor ids made (the next slots)
    seeds: int
    start: int  # its first instruction in the program
    end: int  # past its last one
    result: Any  # (treespec, [("in", i) | ("new", slot, spec, requires_grad) | ("val", v)])
    # an elementwise op with number holes: (position among the key's floats, hole) of each hole, the floats
    # baked into its instructions (position, value), how many floats its key holds (rule 6)
    func: Any = None  # the aten op (None for redistributions and factories)
    numbers: list[tuple[int, int]] | None = None
    fixed: list[tuple[int, Any]] = field(default_factory=list)
    nfloats: int = 0
    hole: bool = False  # its numbers are holes: read from its key, or planned again (rule 6)
    # an aten op that reads no DTensor new to the step and has no holes: a replay matches it in `dispatch`
    fast: bool = False
    single: tuple[int, Any] | None = None  # (slot, spec) when its result is one new DTensor: built directly


@dataclass
class Program:
    id: int
    ops: list[_Op] = field(default_factory=list)
    instrs: list[m.StepInstr] = field(default_factory=list)  # slot form
    ntids: int = 0
    nseeds: int = 0
    nscalars: int = 0
    external: set[int] = field(default_factory=set)  # slots of tensors from outside the step
    bound: dict[int, int] = field(default_factory=dict)  # their tensor ids when recorded (for `_graph`)
    holes: set[int] = field(default_factory=set)  # ops whose numbers are holes (planned again each step)
    redefine: bool = False  # holes were added since the controller got the definition
    user_deletes: dict[int, int] = field(default_factory=dict)  # instruction index -> slot (rule 4)


class _Mode:
    """What a step installs on its session while it runs: the step hook and the session's three per-op calls.
    `outer`: the automatic capture it runs for (rule 7), which stays the session's `step` meanwhile."""

    def __init__(self, session: Session, outer: AutoSteps | None = None) -> None:
        self.session, self.outer = session, outer
        self.owner = threading.get_ident()  # the thread that runs the step (rule 10)
        self.emit, self.new_tid, self.release = session.emit, session.new_tid, session.release  # the eager ones
        self.slot_of: dict[int, int] = {}
        self.tids: list[int] = []
        self.held: list[int] = []  # outside tensors dropped during the step (rule 4)
        self.active = False

    def install(self) -> None:
        s = self.session
        # (a release from another thread, a tensor it made, is one from outside the step: held until its end)
        s.emit, s.new_tid, s.release = self._owned(self._emit, self.emit), self._owned(self._new_tid, self.new_tid), \
            self._release
        s.step = self.outer or self
        _dispatch.step_hook = self
        self.active = True

    def uninstall(self) -> None:
        if not self.active:
            return
        self.active = False
        s = self.session
        s.emit, s.new_tid, s.release = self.emit, self.new_tid, self.release
        s.step = self.outer
        _dispatch.step_hook = None
        for tid in self.held:
            self.release(tid)
        self.held.clear()

    def _owned(self, mine: Callable[..., Any], eager: Callable[..., Any]) -> Callable[..., Any]:
        """One of the session's per-op calls while the step runs: the step's for its thread, else the eager one."""
        owner, thread = self.owner, threading.get_ident

        def call(*args: Any) -> Any:
            return mine(*args) if thread() == owner else eager(*args)
        return call

    def foreign(self) -> None:
        """Another thread called DTorch while the step runs (rule 10)."""
        if self.outer is not None:
            self.outer.foreign()

    def dispatch(self, cls: type, func: Any, types: Any, args: tuple, kwargs: dict | None) -> Any:
        """An aten op of the step (`DTensor.__torch_dispatch__` while the step runs): keyed, then `run`."""
        try:
            key, leaves = _dispatch.op_key(func, args, kwargs)
        except (_dispatch._Plain, TypeError):
            self.interrupt("it mixes a plain torch.Tensor (or an argument DTorch cannot key) into an op")
            return _dispatch.torch_dispatch(cls, func, types, args, kwargs)
        return self.run(key, leaves, lambda: _dispatch.torch_dispatch(cls, func, types, args, kwargs), func)

    def close(self) -> None:
        """The session closes during the step: what it matched goes out (a replay), it stops."""
        self.interrupt("close")
        self.uninstall()

    # overridden
    def _emit(self, item: Any) -> None: ...
    def _new_tid(self) -> int: ...
    def _release(self, tid: int) -> None: ...
    def run(self, key: Any, leaves: list, thunk: Callable[[], Any], func: Any = None) -> Any: ...
    def interrupt(self, why: str) -> None: ...


class _Recorder(_Mode):
    """Runs a step eagerly and records it (rules 1, 2, 4, 5)."""

    def __init__(self, session: Session, program_id: int, outer: AutoSteps | None = None) -> None:
        super().__init__(session, outer)
        self.program = Program(program_id)
        self.op: _Op | None = None  # the operation running now
        self.op_from = (0, 0)  # the slots and seeds before it
        self.op_made: set[int] = set()
        self.seeds: list[int] = []
        self.broken: str | None = None
        self.external: set[int] = set()  # slots of tensors from outside the step

    def abandon(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        self.uninstall()

    def interrupt(self, why: str) -> None:
        self.abandon(why)

    def _new_tid(self) -> int:
        tid = self.new_tid()
        self.slot_of[tid] = len(self.tids)
        self.tids.append(tid)
        if self.op is not None:
            self.op_made.add(tid)
        return tid

    def _emit(self, item: Any) -> None:
        self.emit(item)
        if self.op is None:
            return self.abandon("it issues an instruction outside DTorch's ops (an upload?)")
        try:
            self.program.instrs.append(programs.map_ids(_instruction(item), self._slot, self._seed))
        except (TypeError, Unreplayable) as e:
            self.abandon(str(e))

    def _slot(self, tid: int) -> int:
        slot = self.slot_of.get(tid)
        if slot is None:
            if _views.copying is not None:
                raise Unreplayable("a write in it reaches a view of a copy moved before the step (a view such as "
                                   "x[1] of a row-sharded x, kept from an earlier step)")
            raise Unreplayable(f"an op reads tensor {tid}, which is not among its arguments")
        return slot

    def _seed(self, seed: int) -> int:
        self.seeds.append(seed)
        return len(self.seeds) - 1

    def _release(self, tid: int) -> None:
        slot = self.slot_of.get(tid)
        if slot is None or slot in self.external:
            self.held.append(tid)  # from outside the step: released after it
            return
        self.emit(m.InstrDelete(tids=[tid]))
        if self.op is None or tid not in self.op_made:
            self.program.user_deletes[len(self.program.instrs)] = slot
        self.program.instrs.append(m.InstrDelete(tids=[slot]))

    def run(self, key: Any, leaves: list, thunk: Callable[[], Any], func: Any = None) -> Any:
        if any(leaf._session is not self.session for leaf in leaves):
            self.abandon("it mixes DTensors of another session")
            return thunk()
        if self.outer is not None and len(self.program.ops) >= MAX_OPS:
            self.abandon(f"more than {MAX_OPS} operations")  # an automatic step that goes on and on (rule 9)
            return thunk()
        slots, fresh = [], False
        self.op_from = len(self.tids), len(self.seeds)
        for leaf in leaves:
            slot = self.slot_of.get(leaf._tid)
            if slot is None:
                slot = self.slot_of[leaf._tid] = len(self.tids)
                self.tids.append(leaf._tid)
                self.external.add(slot)
                fresh = True
            slots.append(slot)
        before = [(leaf._tid, leaf._spec) for leaf in leaves]
        first_tid, first_seed = len(self.tids), len(self.seeds)
        self.op = op = _Op(key, tuple(slots), 0, 0, len(self.program.instrs), 0, None, func=func,
                           fast=func is not None and not fresh)
        _dispatch.step_hook = None  # nested ops are part of this one
        try:
            result = thunk()
        except BaseException:
            self.abandon(f"{func if func is not None else key[0]} raised")  # what it emitted ran, once
            raise
        finally:
            if self.active:
                _dispatch.step_hook = self
            self.op = None
        if not self.active:
            return result
        op.made, op.seeds = len(self.tids) - first_tid, len(self.seeds) - first_seed
        op.end = len(self.program.instrs)
        self.op_made.clear()
        if [(leaf._tid, leaf._spec) for leaf in leaves] != before:
            self.abandon(f"{func if func is not None else key[0]} changes a DTensor's id or layout in place")
            return result
        try:
            op.result = self._recipe(result, leaves, first_tid)
        except Unreplayable as e:
            self.abandon(str(e))
            return result
        spec, recipe = op.result
        if spec.is_leaf() and recipe[0][0] == "new" and not recipe[0][3] and recipe[0][4] is None:
            op.single = recipe[0][1], recipe[0][2]
        self.program.ops.append(op)
        return result

    def _recipe(self, result: Any, leaves: list, first_tid: int) -> Any:
        flat, spec = pytree.tree_flatten(result)
        out = []
        for v in flat:
            if isinstance(v, DTensor):
                index = next((i for i, leaf in enumerate(leaves) if leaf is v), None)
                slot = self.slot_of.get(v._tid, -1)
                if index is not None:
                    out.append(("in", index))
                elif slot >= first_tid and slot not in self.external:
                    out.append(("new", slot, v._spec, v.requires_grad, self._origin(v, leaves, first_tid)))
                else:
                    raise Unreplayable("an op returns a DTensor that is neither an argument nor new")
            elif isinstance(v, torch.Tensor):
                raise Unreplayable("an op returns a plain torch.Tensor")
            else:
                out.append(("val", v))
        return spec, out

    def _origin(self, v: DTensor, leaves: list, first_tid: int) -> Any:
        """How a replay gives a view of a moved copy its origin (`_views`): None (no origin), ("leaf", i) (that of
        argument i) or ("moved", i, slot, spec, region) (argument i and its copy, of that region, made by this
        op)."""
        origin = getattr(v, "_origin", None)
        if origin is None:
            return None
        for i, leaf in enumerate(leaves):
            if origin is getattr(leaf, "_origin", None):
                return "leaf", i
            if origin.base is leaf and self.slot_of.get(origin.moved._tid, -1) >= first_tid:
                return "moved", i, self.slot_of[origin.moved._tid], origin.moved._spec, origin.region
        raise Unreplayable("an op returns a view of a copy moved outside it")

    def cut(self) -> None:
        """A sync point inside the operation running now ends an automatic step (rule 8): the program ends before
        that operation, which goes on eagerly (what it emitted so far went out as it ran)."""
        op, p = self.op, self.program
        slots, seeds = self.op_from
        del p.instrs[op.start:], self.seeds[seeds:]
        for tid in self.tids[slots:]:
            del self.slot_of[tid]
        del self.tids[slots:]
        p.user_deletes = {i: slot for i, slot in p.user_deletes.items() if i < op.start}
        self.external = {slot for slot in self.external if slot < slots}
        self.op = None

    def finish(self) -> Program | None:
        """The recorded program, or None when the recording is unreplayable (`broken` says why)."""
        self.uninstall()
        if self.broken is not None:
            return None
        self.program.ntids, self.program.nseeds = len(self.tids), len(self.seeds)
        self.program.external = self.external
        self.program.bound = {slot: self.tids[slot] for slot in self.external}
        return self.program


class _Replayer(_Mode):
    """Matches a step against its program and sends one InstrReplay (rules 2-4, 6)."""

    def __init__(self, session: Session, program: Program, outer: AutoSteps | None = None) -> None:
        super().__init__(session, outer)
        self.program = program
        self.pos = 0
        self.seeds: list[int] = []
        self.scalars: list[Any] = [None] * program.nscalars
        self.dropped: set[int] = set()  # tensor ids made in the step and dropped by the user's code
        self.released: list[int] = []  # tensor ids dropped, not yet sorted out (`_drops`)
        self.pending: list = []  # what an op planned again has emitted so far (a fallback sends it)
        self.fell_back = False

    def _new_tid(self) -> int:  # only outside our operations (an upload): the step goes eager first
        self.interrupt("an upload")
        return self.new_tid()

    def _emit(self, item: Any) -> None:
        self.interrupt("another instruction")
        self.emit(item)

    def install(self) -> None:
        super().install()
        self.session.release = self.released.append  # DTensor.__del__: a list append, sorted out by `_drops`
        if _views.by_root:  # views of copies moved before the step: a write in it may have to reach them, and the
            self.fall_back()  # program was recorded without them (`_views`, rule 4)

    def _release(self, tid: int) -> None:
        slot = self.slot_of.get(tid)
        if slot is not None and slot not in self.program.external:
            self.dropped.add(tid)
        else:
            self.held.append(tid)

    def _drops(self) -> None:
        """Sort out the tensor ids dropped so far (rule 4): made in the step, or from outside it."""
        released = self.released.copy()
        self.released.clear()  # the same list: the session's release is its append
        for tid in released:
            self._release(tid)

    def interrupt(self, why: str) -> None:
        if self.outer is not None:
            self.finish()  # an automatic step ends here (rule 8)
        elif self.active:
            self.fall_back()

    def dispatch(self, cls: type, func: Any, types: Any, args: tuple, kwargs: dict | None) -> Any:
        """The hot path of a replayed step: an aten op as recorded is keyed (`_dispatch.op_key`), its DTensors
        checked against their slots (all bound already: while a replay matches, its slots are numbered as the
        recording's) and advanced over; anything else (a DTensor new to the step, numbers that changed or are
        holes, another op) takes `run`."""
        ops, pos = self.program.ops, self.pos
        op = ops[pos] if pos < len(ops) else None
        if op is not None and op.fast and op.func is func:
            try:
                key, leaves = _dispatch.op_key(func, args, kwargs)
            except (_dispatch._Plain, TypeError):
                key = None
            if key == op.key:
                tids = self.tids
                for leaf, slot in zip(leaves, op.leaf_slots):
                    if tids[slot] != leaf._tid:
                        self.fall_back()
                        return _dispatch.torch_dispatch(cls, func, types, args, kwargs)
                return self._advance(op, leaves)
        return super().dispatch(cls, func, types, args, kwargs)

    def run(self, key: Any, leaves: list, thunk: Callable[[], Any], func: Any = None) -> Any:
        ops, pos = self.program.ops, self.pos
        op = ops[pos] if pos < len(ops) else None
        if op is None and self.outer is not None:  # an automatic step went past its program: replay, go eager
            self.finish()
            return thunk()
        same = op is not None and op.key == key
        if op is None or not (same or _numbers_differ(op.key, key)) or not self._bind(op, leaves):
            self.fall_back()
            return thunk()
        if (not same or op.hole) and not self._read_numbers(op, key):
            return self._plan_again(op, key, leaves, thunk, func)
        return self._advance(op, leaves)

    def _advance(self, op: _Op, leaves: list) -> Any:
        """A matched op: make its tensor ids, draw its seeds, build its result (rule 2)."""
        tids, slot_of, new = self.tids, self.slot_of, self.new_tid
        for _ in range(op.made):
            tid = new()
            slot_of[tid] = len(tids)
            tids.append(tid)
        if op.seeds:
            next_seed = self.session.next_seed
            self.seeds.extend([next_seed() for _ in range(op.seeds)])
        self.pos += 1
        if op.single is not None:  # one new DTensor: the eager fast path's wrapper (dtensor.wrap)
            slot, spec = op.single
            return wrap(spec, tids[slot], self.session)
        spec, recipe = op.result
        out = []
        origins: dict = {}
        for how in recipe:
            if how[0] == "new":
                out.append(DTensor(how[2], tids[how[1]], self.session, how[3]))
                if how[4] is not None:
                    out[-1]._origin = origins.get(how[4]) or origins.setdefault(how[4], self._origin(how[4], leaves))
            elif how[0] == "in":
                out.append(leaves[how[1]])
            else:
                out.append(how[1])
        return pytree.tree_unflatten(out, spec)

    def _origin(self, how: tuple, leaves: list) -> Any:
        """The origin a recorded view of a moved copy gets (`_Recorder._origin` says how)."""
        if how[0] == "leaf":
            return leaves[how[1]]._origin
        return _views.Origin(leaves[how[1]], DTensor(how[3], self.tids[how[2]], self.session), how[4])

    def _bind(self, op: _Op, leaves: list) -> bool:
        tids = self.tids
        if len(leaves) != len(op.leaf_slots):
            return False
        for leaf, slot in zip(leaves, op.leaf_slots):
            tid = leaf._tid
            if slot == len(tids):
                if tid in self.slot_of or leaf._session is not self.session:
                    return False
                self.slot_of[tid] = slot
                tids.append(tid)
            elif tids[slot] != tid:
                return False
        return True

    def _read_numbers(self, op: _Op, key: Any) -> bool:
        """An elementwise op whose holes are known takes their values from its key, unplanned (rule 6)."""
        if op.numbers is None:
            return False
        floats: list = []
        _floats(key, floats)
        if len(floats) != op.nfloats or any(floats[j] != v for j, v in op.fixed):
            return False
        for j, k in op.numbers:
            self.scalars[k] = floats[j]
        return True

    def _plan_again(self, op: _Op, key: Any, leaves: list, thunk: Callable[[], Any], func: Any) -> Any:
        """An op whose numbers changed (an optimizer's step size): run it eagerly into a list, and when its
        instructions are the program's but for numbers in its arguments, those become holes (rule 6)."""
        s, made, items = self.session, [], []

        def new_tid() -> int:
            tid = self.new_tid()
            self.slot_of[tid] = len(self.tids)
            self.tids.append(tid)
            made.append(tid)
            return tid

        def release(tid: int) -> None:
            if tid not in made:  # the op's own temporaries are deleted by its instructions
                self._release(tid)

        s.emit, s.new_tid, s.release = items.append, new_tid, release
        _dispatch.step_hook, self.pending = None, items
        try:
            result = thunk()
        finally:
            self.pending = []
            if self.active:
                s.emit, s.new_tid, s.release = self._emit, self._new_tid, self.released.append
                _dispatch.step_hook = self
        if not self.active:  # a sync point inside the op: the replay fell back (and sent `items`) meanwhile
            return result
        numbers = self._adopt_numbers(op, items, made, result, leaves)
        if numbers is None:
            self.fall_back(items)
            return result
        if func is not None and _planner.numbers_free(func):
            _learn_positions(op, key, numbers, _holes_in(self.program.instrs[op.start:op.end]))
            # (its output shapes cannot depend on the numbers)
        self.pos += 1
        return result

    def _adopt_numbers(self, op: _Op, items: list, made: list, result: Any, leaves: list) -> dict | None:
        """The op's numbers by hole, when its instructions are the program's but for numbers (new holes are added
        to the program); None when they are not."""
        p = self.program
        if len(made) != op.made:
            return None
        try:
            new = [programs.map_ids(_instruction(i), self._slot, self._seed) for i in items]
        except (KeyError, TypeError):
            return None
        if len(new) != op.end - op.start or not _same_result(op, result, leaves, self.tids):
            return None
        found: list[tuple[int, list, Any]] = []  # (instruction, path, number) of new holes
        numbers: dict[int, Any] = {}
        for index, (old, now) in enumerate(zip(p.instrs[op.start:op.end], new)):
            if not _match(_plain(old), _plain(now), [], lambda path, v, i=index: found.append((i, path, v)),
                          numbers):
                return None
        for index, path, value in found:  # the program learns its holes (sent again before the replay)
            plain = _plain(p.instrs[op.start + index])
            _set(plain, path, {programs.SCALAR_HOLE: p.nscalars})
            p.instrs[op.start + index] = _decode_step(msgspec.msgpack.encode(plain))
            numbers[p.nscalars] = value
            p.nscalars += 1
            self.scalars.append(None)
            p.redefine = True
        for k, value in numbers.items():
            self.scalars[k] = value
        p.holes.add(self.pos)
        op.hole, op.fast = True, False
        return numbers

    def _slot(self, tid: int) -> int:
        return self.slot_of[tid]

    def _seed(self, seed: int) -> int:
        self.seeds.append(seed)
        return len(self.seeds) - 1

    def finish(self) -> None:
        """The step ended: one InstrReplay, or the instructions of what ran (rule 3)."""
        if not self.active:
            return
        self._drops()
        p = self.program
        slots_dropped = {self.slot_of[t] for t in self.dropped}
        if self.pos < len(p.ops) or not set(p.user_deletes.values()) <= slots_dropped:
            return self.fall_back()
        if p.redefine:
            self.emit(_definition(self.session, p))
            p.redefine = False
        self.emit(m.InstrReplay(program=p.id, tids=self.tids, seeds=self.seeds, scalars=self.scalars))
        deleted = {self.tids[s] for s in p.user_deletes.values()}
        self.held.extend(t for t in self.dropped if t not in deleted)
        self.uninstall()

    def fall_back(self, then: list = ()) -> None:
        """Emit the filled-in instructions of the operations matched so far (and `then`), then go eager (rule 3)."""
        if not self.active:
            return
        self._drops()
        self.fell_back = True
        p = self.program
        end = p.ops[self.pos].start if self.pos < len(p.ops) else len(p.instrs)
        dropped = {self.slot_of[t] for t in self.dropped}
        tids, seeds, scalars = self.tids, self.seeds, self.scalars
        deleted = set()
        for index in range(end):
            slot = p.user_deletes.get(index)
            if slot is not None:
                if slot not in dropped:
                    continue  # the user's code still holds it
                deleted.add(tids[slot])
            self.emit(programs.map_ids(p.instrs[index], tids.__getitem__, seeds.__getitem__, scalars.__getitem__))
        for item in then or self.pending:
            self.emit(item)
        self.held.extend(t for t in self.dropped if t not in deleted)
        self.uninstall()


_decode_step = msgspec.msgpack.Decoder(m.StepInstr).decode
_NUMBER_FIELDS = ("args", "kwargs", "local")  # where a number may become a hole (rule 6)


def _instruction(item: Any) -> Any:
    """The wire instruction of an emitted item (a fast-path record is encoded by its plan)."""
    if type(item) is tuple:
        item = item[0](item)
        if type(item) is msgspec.Raw:
            return _decode_instr(item)
    return item


def _plain(instr: Any) -> Any:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(instr))


def _numbers_differ(a: Any, b: Any) -> bool:
    """Do two op keys differ only in float arguments?"""
    if type(a) is tuple and type(b) is tuple and len(a) == len(b):
        if len(a) == 2 and a[0] is float and b[0] is float:
            return True
        return all(x == y or _numbers_differ(x, y) for x, y in zip(a, b))
    return False


def _floats(key: Any, out: list) -> None:
    """The float arguments in an op key, in order."""
    if type(key) is tuple:
        if len(key) == 2 and key[0] is float:
            out.append(key[1])
        else:
            for x in key:
                _floats(x, out)


def _learn_positions(op: _Op, key: Any, numbers: dict[int, Any], walk: list[int]) -> None:
    """Where each hole's value sits among the floats of the op's `key`: at the one place that holds its value, or,
    when every float of the key is a hole (a `_foreach_` op's list of step sizes, often all equal), in order: the
    k-th float is the k-th hole met in the op's instructions (`walk`), as the instructions list the op's arguments
    in their order."""
    floats: list = []
    _floats(key, floats)
    op.numbers = None
    if len(walk) == len(floats) == len(set(walk)) and set(walk) == numbers.keys() \
            and all(numbers[k] == v for k, v in zip(walk, floats)):
        op.numbers, op.nfloats, op.fixed = list(enumerate(walk)), len(floats), []
        return
    places = []
    for k, value in numbers.items():
        at = [j for j, v in enumerate(floats) if v == value]
        if len(at) != 1:
            return
        places.append((at[0], k))
    taken = {j for j, _ in places}
    op.numbers, op.nfloats = places, len(floats)
    op.fixed = [(j, v) for j, v in enumerate(floats) if j not in taken]


def _holes_in(instrs: list) -> list[int]:
    """The holes of these instructions, in the order of their fields."""
    out: list[int] = []
    stack = [_plain(i) for i in reversed(instrs)]
    while stack:
        x = stack.pop()
        if type(x) is dict:
            if len(x) == 1 and programs.SCALAR_HOLE in x:
                out.append(x[programs.SCALAR_HOLE])
            else:
                stack.extend(reversed(list(x.values())))
        elif type(x) is list:
            stack.extend(reversed(x))
    return out


def _match(old: Any, new: Any, path: list, hole: Callable[[list, Any], None], numbers: dict[int, Any]) -> bool:
    """Is `new` the instruction `old` but for numbers in its arguments? Reports each new hole to `hole` and the
    value of each existing hole in `numbers`."""
    if type(old) is dict and len(old) == 1 and programs.SCALAR_HOLE in old:
        if type(new) is not float:
            return False
        numbers[old[programs.SCALAR_HOLE]] = new
        return True
    if type(old) is float and type(new) is float and path and path[0] in _NUMBER_FIELDS:
        if not (old == new):  # nan too
            hole(list(path), new)
        return True
    if type(old) is dict and type(new) is dict:
        return old.keys() == new.keys() and all(_match(v, new[k], [*path, k], hole, numbers) for k, v in old.items())
    if type(old) is list and type(new) is list:
        return len(old) == len(new) and all(_match(v, w, [*path, i], hole, numbers)
                                            for i, (v, w) in enumerate(zip(old, new)))
    return type(old) is type(new) and old == new


def _set(tree: Any, path: list, value: Any) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _same_result(op: _Op, result: Any, leaves: list, tids: list[int]) -> bool:
    flat, spec = pytree.tree_flatten(result)
    recipe_spec, recipe = op.result
    if spec != recipe_spec or len(flat) != len(recipe):
        return False
    for v, how in zip(flat, recipe):
        if how[0] == "new":
            if not (isinstance(v, DTensor) and v._tid == tids[how[1]] and v._spec == how[2]):
                return False
        elif how[0] == "in":
            if v is not leaves[how[1]]:
                return False
        elif isinstance(v, torch.Tensor) or v != how[1]:
            return False
    return True


def _definition(session: Session, p: Program) -> m.InstrDefine:
    """Program `p`'s definition, kept as the session's with the instructions of its redistribution operations
    (`Session.programs`: what a profile reads of a replay)."""
    # a copy: the sender thread encodes it later, and a replay may meanwhile put holes into p.instrs (rule 6)
    instrs = list(p.instrs)
    session.programs[p.id] = (instrs, frozenset(i for op in p.ops if op.func is None for i in range(op.start, op.end)))
    return m.InstrDefine(program=p.id, instrs=instrs, ntids=p.ntids, nseeds=p.nseeds, nscalars=p.nscalars)



@dataclass
class _Track:
    """Automatic steps that begin with one operation (rule 9)."""

    program_id: int
    program: Program | None = None
    size: int = -1  # tensor ids the last eager one made
    again: bool = False  # the last two eager ones made as many (it repeats: record the next one)
    wait: int = 0  # steps to run eagerly before the next recording
    misses: int = 0  # recordings or replays in a row that did not replay


class AutoSteps:
    """Automatic capture (rules 7-9): the session's `step` while it is on, told of every sync point, upload and
    flush (a boundary); installs a recording or a replay at the first operation after a boundary."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.tracks: dict[Any, _Track] = {}  # by the key of a step's first operation, oldest first
        self.track: _Track | None = None  # the automatic step running now
        self.mode: _Mode | None = None
        self.mark = 0  # a tensor id taken at the last boundary: the next one's minus this one is a step's size
        self.replays = 0  # automatic steps that ran as one InstrReplay
        self.fallbacks = 0  # replays that fell back to eager (rule 3)
        self.owner = threading.get_ident()  # rule 10
        self.stopped = False  # another thread used the session: off at the owner's next step

    def arm(self) -> None:
        """After a boundary: the next operation starts an automatic step."""
        self.mark = self.session.new_tid()
        self.session.step = self
        _dispatch.step_hook = self

    def pause(self) -> None:
        self.session.step = _dispatch.step_hook = None

    def foreign(self) -> None:
        if not self.stopped:
            self.stopped = True
            warnings.warn("dtorch: automatic capture is off for this session: DTensors are used from more than one "
                          "thread, and a captured step holds one thread's operations (dtorch.compile steps still "
                          "run)", stacklevel=stacklevel())

    def _begin(self, key: Any) -> None:
        if self.stopped:  # (rule 10: carried out here, by the owning thread)
            self.close()
            return
        _dispatch.step_hook = None
        key = (key, torch.get_default_dtype())  # a step recorded under another default dtype is another step
        track = self.track = self.tracks.get(key)
        if track is None:
            if len(self.tracks) < MAX_TRACKS:
                program_id = self.session.new_program_id()
            else:  # the oldest track's program id is defined again (rule 9)
                program_id = self.tracks.pop(next(iter(self.tracks))).program_id
            track = self.track = self.tracks[key] = _Track(program_id)
        if track.program is not None:
            self.mode = _Replayer(self.session, track.program, self)
        elif track.wait > 0 or not track.again:
            track.wait = max(0, track.wait - 1)
            return
        else:
            self.mode = _Recorder(self.session, track.program_id, self)
        self.mode.install()

    # the step hook (`_dispatch.step_hook`) between a boundary and the first operation after it
    def dispatch(self, cls: type, func: Any, types: Any, args: tuple, kwargs: dict | None) -> Any:
        try:
            key = _dispatch.op_key(func, args, kwargs)[0]
        except (_dispatch._Plain, TypeError):
            key = id(func)
        self._begin(key)
        hook = _dispatch.step_hook
        if hook is None:
            return _dispatch.torch_dispatch(cls, func, types, args, kwargs)
        return hook.dispatch(cls, func, types, args, kwargs)

    def run(self, key: Any, leaves: list, thunk: Callable[[], Any], func: Any = None) -> Any:
        self._begin(key)
        hook = _dispatch.step_hook
        return thunk() if hook is None else hook.run(key, leaves, thunk, func)

    def interrupt(self, why: str) -> None:
        """A boundary: the automatic step running now ends (its program defined, or its replay sent: rule 8)."""
        mode, track, self.mode, self.track, start = self.mode, self.track, None, None, self.mark
        if isinstance(mode, _Recorder):
            if mode.op is not None and mode.broken is None:
                mode.cut()
            program = mode.finish()
            if program is not None and len(program.ops) >= MIN_OPS:
                track.program = program
                self.session.emit(_definition(self.session, program))
            else:
                self._miss(track)
        elif isinstance(mode, _Replayer):
            mode.finish()
            if mode.fell_back:
                self.fallbacks += 1
                track.program = None
                self._miss(track)
            else:
                self.replays += 1
                track.misses = 0
        if self.stopped:
            self.pause()
        else:
            self.arm()  # (after the mode is gone: its mark is a tensor id of the session's own)
        if mode is None and track is not None:  # an eager step: does its kind repeat?
            size = self.mark - start
            track.again, track.size = size == track.size, size

    @staticmethod
    def _miss(track: _Track) -> None:
        track.misses += 1
        track.wait = min(2 ** track.misses, MAX_WAIT)

    def close(self) -> None:
        """Automatic capture stops (`auto_compile(False)`, the session closing): the step running now ends."""
        self.interrupt("close")
        self.pause()



class Eager:
    """A block in which every operation runs eagerly (`dtorch.debug.CommDebugMode`: counting what each operation
    sends needs each one's instructions, which a replay does not emit). It is the session's `step` while it lasts:
    `Compiled` runs its function eagerly under any step, and automatic capture, if on, is paused (its step running
    now ends first, as at a boundary) and armed again at the end. A replay would have run the same instructions
    (rule 3), so what the block sees is what the program runs."""

    def __init__(self, session: Session) -> None:
        self.session, self.owner = session, threading.get_ident()
        self.outer: AutoSteps | Eager | None = None

    def __enter__(self) -> Eager:
        step = self.session.step
        if type(step) is Eager:  # nested: the outer block stays the session's step
            self.outer = step
            return self
        if step is not None and type(step) is not AutoSteps:
            raise RuntimeError("dtorch: a block that runs every operation eagerly (CommDebugMode) cannot start inside "
                               "a dtorch.compile step: enter it around the step's call")
        if step is not None:
            step.interrupt("an eager block")
            step.pause()
            self.outer = step
        self.session.step = self
        return self

    def __exit__(self, *exc: object) -> None:
        if type(self.outer) is Eager:
            return
        self.session.step = None
        if self.outer is not None and not self.outer.stopped:
            self.outer.arm()

    # what the session tells its step: nothing to end, nothing to stop
    def interrupt(self, why: str) -> None:
        pass

    def foreign(self) -> None:
        pass

    def close(self) -> None:
        pass


MIN_OPS = 8  # an automatic step with fewer operations is not worth a program (rule 9)
MAX_OPS = 20_000  # nor one with more: a loop that never reaches a boundary (rule 9)
MAX_WAIT = 64  # at most this many eager steps between two tries (rule 9)
MAX_TRACKS = 8  # kinds of automatic steps (first operations) a session keeps programs for (rule 9)
