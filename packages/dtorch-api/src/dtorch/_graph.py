"""Whole-step replay without the step's Python: `dtorch.compile(fn, mode="graph")` (issue #12 item 2).

A replayed step (`_capture.py`) still runs the user's Python: every op crosses torch's dispatcher into ours to be
matched, which costs more than plain torch's own step. A *graph* of a step sends its replay with no Python at
all, as a CUDA graph does: the arguments' tensor ids go into the program's slots, and the step's results come
back as new DTensors.

Rules:
  1. A graph is made from a replay that matched its whole program (the *verifying* call), and only where the
     step's Python is invisible to its program:
       - no number in the program changes from call to call (no holes, `_capture` rule 6; torch's AdamW computes
         its step sizes in Python from a step counter, and its `capturable=True` keeps that counter as a plain
         tensor on the client: graph the forward and backward, and let `dtorch.compile(opt.step)` replay the
         update);
       - every DTensor it reads that is not an argument is the one the recording read (a parameter, an
         optimizer's state), still held by the program's user: not one the previous call made;
       - its arguments are DTensors, numbers, strings, None (no plain tensor: its values are not checked);
       - it returns DTensors and None only, and a DTensor it returns is not also kept elsewhere;
       - a DTensor it makes and keeps elsewhere (a gradient on `.grad`) holds no autograd graph.
     Otherwise the step stays a replay, with one warning saying why.
  2. A graph call checks what the Python would have seen and can be seen cheaply: the arguments' structure,
     each DTensor argument's layout (spec id), session and `requires_grad`, each other argument equal to the
     verifying call's (type included), each DTensor read from outside still alive under its tensor id, and
     each value a DTorch component named with `guard` (`dtorch.optim.AdamW`'s hyperparameters) unchanged. A
     miss runs that call as a replay again (which verifies again). A DTensor the step made and kept elsewhere
     that is gone by the next call (dropped by its holder: `zero_grad()` outside the step drops `.grad`) cannot
     be put back where the Python would put it: the step replays with its Python from then on, with a warning.
  3. It makes the step's tensor ids and draws its seeds as a replay does (so random values are an eager run's),
     sends one InstrReplay, and then stands for what the Python would have left behind:
       - a DTensor the step returns is a new DTensor each call (detached: no autograd graph was built);
       - a DTensor it made and keeps elsewhere (a gradient) is the same Python object, now naming the new
         tensor; the tensor it named before is released (the Python would have replaced and dropped it);
       - the tensors it made and dropped are deleted by the program or released after it, as in a replay.
  4. What a graph cannot see, it does not check: Python state the step reads that did not change between the
     recording and the verifying call (a learning rate a scheduler sets between calls, a module's flag, a
     parameter replaced by another object while the old one stays alive) is used as it was then. Pass such a
     value as an argument (a changed one runs the Python; a number that keeps changing turns the graph off)
     or use mode="replay".
"""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch.utils._pytree as pytree

from dtorch import _dispatch
from dtorch._capture import Program, _Op, _Replayer
from dtorch.dtensor import DTensor, wrap
from dtorch.session import Session
from dtorch_protocol import messages as m

MISS = object()  # a graph call's guards failed (rule 2): run the Python


class Verifier(_Replayer):
    """A replay that also notes what a graph needs (rule 1): by slot, the outside DTensors it reads and the
    DTensors it makes."""

    def __init__(self, session: Session, program: Program) -> None:
        super().__init__(session, program)
        self.read: dict[int, weakref.ref] = {}
        self.made: dict[int, weakref.ref] = {}
        self.guards: list[tuple[Callable[[], Any], Any]] = []  # (value, what it was): `guard`

    def _bind(self, op: _Op, leaves: list) -> bool:
        first = len(self.tids)
        if not super()._bind(op, leaves):
            return False
        for leaf, slot in zip(leaves, op.leaf_slots):
            if slot >= first:
                self.read[slot] = weakref.ref(leaf)
        return True

    def _advance(self, op: _Op, leaves: list) -> Any:
        result = super()._advance(op, leaves)
        for v in pytree.tree_leaves(result):
            if type(v) is DTensor:
                slot = self.slot_of[v._tid]
                if slot not in self.program.external:
                    self.made[slot] = weakref.ref(v)
        return result


def guard(value: Callable[[], Any]) -> None:
    """Python state a step's numbers come from (an optimizer's hyperparameters), named by the code that reads it:
    a graph made from the call running now checks that `value()` is unchanged before each call (rule 2)."""
    hook = _dispatch.step_hook
    if type(hook) is Verifier:
        hook.guards.append((value, value()))


class Graph:
    """A verified step, called without its Python (rules 2-3)."""

    def __init__(self, session: Session, program: Program) -> None:
        self.session, self.program = session, program
        self.args_spec: Any = None
        self.args: list[tuple[int, int | None, int, bool]] = []  # (leaf, slot or None, spec id, requires_grad)
        self.consts: list[tuple[int, type, Any]] = []  # (leaf, type, value) of the other arguments
        self.template: list[int] = [-1] * program.ntids  # outside tensors' ids filled in
        self.nbound = 0  # slots the arguments fill
        self.captured: list[tuple[int, weakref.ref]] = []  # (tensor id, wrapper) read from outside
        self.made: list[int] = [s for s in range(program.ntids) if s not in program.external]
        self.after: list[int] = []  # slots released after the replay
        self.keep: list[tuple[int, weakref.ref]] = []  # (slot, wrapper) made and kept elsewhere
        self.result_spec: Any = None
        self.result: list[tuple] = []  # ("new", slot, spec) | ("arg", leaf) | ("none",)
        self.broken: str | None = None  # why the graph can no longer stand for the step (rule 2)
        self.guards: list[tuple[Callable[[], Any], Any]] = []

    def __call__(self, session: Session, args: tuple, kwargs: dict) -> Any:
        if session is not self.session:
            return MISS
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.args_spec:
            return MISS
        tids = self.template.copy()
        for i, slot, sid, requires_grad in self.args:
            x = leaves[i]
            if type(x) is not DTensor or x._spec.sid != sid or x._session is not session \
                    or x.requires_grad != requires_grad:
                return MISS
            if slot is not None:
                if tids[slot] not in (-1, x._tid):  # one slot, two tensors
                    return MISS
                tids[slot] = x._tid
        if len({tids[slot] for _, slot, _, _ in self.args if slot is not None}) != self.nbound:
            return MISS  # two slots, one tensor
        for i, kind, value in self.consts:
            x = leaves[i]
            if type(x) is not kind or x != value:
                return MISS
        for tid, ref in self.captured:
            w = ref()
            if w is None or w._tid != tid:
                return MISS
        for value, seen in self.guards:
            if value() != seen:
                return MISS
        if any(ref() is None for _, ref in self.keep):
            self.broken = ("a DTensor it keeps (a .grad?) is dropped between calls (zero_grad() outside the step?): "
                           "the graph could not put the new one back")
            return MISS
        new = session.new_tid
        for slot in self.made:
            tids[slot] = new()
        next_seed = session.next_seed
        seeds = [next_seed() for _ in range(self.program.nseeds)]
        session.emit(m.InstrReplay(program=self.program.id, tids=tids, seeds=seeds, scalars=[]))
        release = session.release
        for slot in self.after:
            release(tids[slot])
        for slot, ref in self.keep:
            w = ref()
            old, w._tid = w._tid, tids[slot]
            release(old)
        out = [wrap(how[2], tids[how[1]], session) if how[0] == "new" else leaves[how[1]] if how[0] == "arg"
               else None for how in self.result]
        return pytree.tree_unflatten(out, self.result_spec)


def graph_of(v: Verifier, args: tuple, kwargs: dict, result: Any) -> Graph | str:
    """The graph of a step whose replay `v` just matched whole, or why it cannot have one (rule 1)."""
    p = v.program
    if p.nscalars:
        names = sorted({str(p.ops[i].func or p.ops[i].key[0]) for i in p.holes if i < len(p.ops)})
        return (f"numbers in its ops change from call to call ({', '.join(names[:3])}; torch's AdamW computes its "
                "step sizes in Python: use dtorch.optim.AdamW, or graph the forward and backward and "
                "dtorch.compile(opt.step) apart)")
    gc.collect()  # what is kept must be what is referred to, not garbage awaiting the collector
    g = Graph(v.session, p)
    g.guards = v.guards
    leaves, g.args_spec = pytree.tree_flatten((args, kwargs))
    return _arguments(g, v, leaves) or _outside(g, v) or _results(g, v, leaves, result) or g


def _arguments(g: Graph, v: Verifier, leaves: list) -> str | None:
    """The checks of each argument, and the slots the DTensors among them fill."""
    for i, x in enumerate(leaves):
        if type(x) is DTensor:
            g.args.append((i, v.slot_of.get(x._tid), x._spec.sid, x.requires_grad))
        elif x is None or type(x) in (bool, int, float, str):
            g.consts.append((i, type(x), x))
        else:
            return f"an argument is a {type(x).__name__} (a graph checks DTensors, numbers, strings and None)"
    g.nbound = len({slot for _, slot, _, _ in g.args if slot is not None})
    return None


def _outside(g: Graph, v: Verifier) -> str | None:
    """The DTensors read from outside that no argument brings: each the one the recording read."""
    p = v.program
    for slot in sorted(p.external - {slot for _, slot, _, _ in g.args}):
        ref = v.read.get(slot)
        if ref is None or ref() is None or p.bound.get(slot) != v.tids[slot]:
            return ("it reads a DTensor that is not an argument and is not the one the recording read (one the "
                    "previous call made?)")
        g.template[slot] = v.tids[slot]
        g.captured.append((v.tids[slot], ref))
    return None


def _results(g: Graph, v: Verifier, leaves: list, result: Any) -> str | None:
    """How each result is made, what the step keeps elsewhere and what it drops (rule 3)."""
    flat, g.result_spec = pytree.tree_flatten(result)
    returned: dict[int, DTensor] = {}
    arg_index = {id(leaf): i for i, leaf in enumerate(leaves)}  # (no closure over x: a cell would refer to it)
    for x in flat:
        index = arg_index.get(id(x)) if type(x) is DTensor else None
        if x is None:
            g.result.append(("none",))
        elif index is not None:
            g.result.append(("arg", index))
        elif type(x) is DTensor and v.made.get(v.slot_of.get(x._tid, -1), lambda: None)() is x:
            g.result.append(("new", v.slot_of[x._tid], x._spec))
            returned[v.slot_of[x._tid]] = x
        else:
            return f"it returns a {type(x).__name__} that is neither an argument nor made by the step"
    g.after = sorted({v.slot_of[t] for t in v.dropped} - set(v.program.user_deletes.values()))
    for slot, ref in sorted(v.made.items()):
        w = ref()
        if w is None or slot in returned:
            continue
        if w.requires_grad:
            return "it keeps a DTensor that holds an autograd graph"
        g.keep.append((slot, ref))
    if _kept_elsewhere(returned, result, flat):
        return "it returns a DTensor that it also keeps elsewhere (a graph returns new ones: that one would go stale)"
    return None


def _kept_elsewhere(returned: dict[int, DTensor], result: Any, flat: list) -> bool:
    """Is a returned DTensor referred to by something other than the containers of `result` and frames? (Once
    per graph: `gc.get_referrers` walks every object.)"""
    allowed = {id(flat), id(returned)}
    stack = [result]
    while stack:
        c = stack.pop()
        if type(c) in (tuple, list, dict):
            allowed.add(id(c))
            stack.extend(c.values() if type(c) is dict else c)
    return any(type(r) is not types.FrameType and id(r) not in allowed
               for x in returned.values() for r in gc.get_referrers(x))

