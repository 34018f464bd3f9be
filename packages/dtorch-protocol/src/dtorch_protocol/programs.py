"""Captured programs (`InstrDefine`, `InstrReplay`): instructions whose tensor ids and seeds are slots.

The client captures a step once (`dtorch.compile`) and defines it as a program; each later step sends only
the program id, the step's tensor ids and its seeds. The controller fills the program in (`fill`), the client
too when a replay must fall back to eager instructions. Torch-free: the controller uses it.

Rules:
  1. In a program, every tensor id is a slot n, 0 <= n < ntids, standing for `tids[n]` of the replay: tensor
     slots `{"$t": n}` anywhere in op arguments (per-device ones included), `OutSpec.tid`, a redistribution's
     `src` and `dst`, a factory's `tid`, a delete's `tids`.
  2. The seed of a random op (`InstrCall.seed` not None) or of a random factory (`init` rand/randn) is an index
     k, 0 <= k < nseeds, into the replay's `seeds`. Other seeds are kept as they are.
  3. `{"$s": k}` in an op's arguments (`args`, `kwargs`, `local`) is a number hole: the replay's `scalars[k]`,
     0 <= k < nscalars (an optimizer's step size changes every step; its plan does not).
  4. A program holds only `StepInstr`s (no uploads, no nested programs): the decoder refuses anything else.
  5. `check` names what is wrong with a definition in one line (or None); `fill` trusts a checked program and
     a replay whose `tids`, `seeds` and `scalars` have the lengths the definition declared.
  6. On the workers (`CmdProgram`, `CmdReplay`), the same slots in commands: tensor ids anywhere a command names
     one, seeds of random ops and factories, number holes in op arguments; and a collective's op number in a
     group is an offset from the group's last op number before the replay (`CmdReplay.groups`). `check_cmds` and
     `fill_cmds` are `check` and `fill` for them (`map_cmd` maps one command).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from msgspec.structs import replace

from dtorch_protocol import messages as m

RANDOM_INITS = frozenset({"rand", "randn"})
SCALAR_HOLE = "$s"  # `{"$s": k}`: the k-th number of a replay (rule 3)
MAX_PROGRAMS = 64  # programs one session may hold at once (the controller refuses more)

Map = Callable[[int], int]


def keep_hole(x: Any) -> Any:
    """A number hole kept as it is (`map_ids` default)."""
    return {SCALAR_HOLE: x}


def map_args(value: Any, f: Map, scalar: Callable[[Any], Any]) -> Any:
    """`value` with the tid of every tensor slot mapped by `f` and every number hole by `scalar` (rule 3)."""
    if type(value) is dict:
        if len(value) == 1:
            if m.TENSOR_SLOT in value:
                return {m.TENSOR_SLOT: f(value[m.TENSOR_SLOT])}
            if SCALAR_HOLE in value:
                return scalar(value[SCALAR_HOLE])
        return {k: map_args(v, f, scalar) for k, v in value.items()}
    if type(value) is list or type(value) is tuple:
        return [map_args(v, f, scalar) for v in value]
    return value


def map_ids(instr: m.StepInstr, tid: Map, seed: Map, scalar: Callable[[Any], Any] = keep_hole) -> m.StepInstr:
    """`instr` with each tensor id mapped by `tid`, each seed that is a slot (rule 2) by `seed` and each number
    hole (rule 3) replaced by `scalar(k)` (default: kept as the hole)."""
    t = type(instr)
    if t is m.InstrCall:
        return replace(instr, args=map_args(instr.args, tid, scalar), kwargs=map_args(instr.kwargs, tid, scalar),
                       outs=[None if o is None else m.OutSpec(tid(o.tid), o.spec) for o in instr.outs],
                       local=None if instr.local is None else map_args(instr.local, tid, scalar),
                       seed=None if instr.seed is None else seed(instr.seed),
                       writes=[tid(x) for x in instr.writes])
    if t is m.InstrRedistribute:
        return replace(instr, src=tid(instr.src), dst=tid(instr.dst))
    if t is m.InstrCreate:
        return replace(instr, tid=tid(instr.tid), seed=seed(instr.seed) if instr.init in RANDOM_INITS else instr.seed)
    if t is m.InstrDelete:
        return m.InstrDelete(tids=[tid(x) for x in instr.tids])
    raise TypeError(f"a program cannot hold a {t.__name__}")


def fill(instrs: list[m.StepInstr], tids: list[int], seeds: list[int], scalars: list[float] = ()
         ) -> list[m.StepInstr]:
    """The instructions of one replay (rule 5: lengths already checked)."""
    return [map_ids(i, tids.__getitem__, seeds.__getitem__, scalars.__getitem__) for i in instrs]


def _bounded(n: int, what: str) -> Map:
    def check(x: Any) -> int:
        if type(x) is not int or not 0 <= x < n:
            raise ValueError(f"{what} slot {x!r} is outside 0..{n - 1}" if n else f"{what} slot {x!r}: none declared")
        return x
    return check


def check(d: m.InstrDefine) -> str | None:
    """What is wrong with definition `d`, in one line, or None (rules 1-3)."""
    if min(d.ntids, d.nseeds, d.nscalars) < 0:
        return (f"program {d.program}: ntids, nseeds and nscalars must be >= 0, got {d.ntids}, {d.nseeds} and "
                f"{d.nscalars}")
    tid, seed, scalar = _bounded(d.ntids, "tensor"), _bounded(d.nseeds, "seed"), _bounded(d.nscalars, "number")
    for n, instr in enumerate(d.instrs):
        try:
            map_ids(instr, tid, seed, scalar)
        except (ValueError, TypeError) as e:
            return f"program {d.program}, instruction {n}: {e}"
    return None


def map_cmd(c: m.Cmd, tid: Map, seed: Map, scalar: Callable[[Any], Any], seq: Callable[[str, int], int],
            memo: dict[int, Any]) -> m.Cmd:
    """Command `c` with its tensor ids, seeds, numbers and group op numbers mapped (rule 6); a command, and the
    arguments of one op, are mapped once (`memo`, by identity: every worker's command of one instruction shares
    them, or is one shared command)."""
    out = memo.get(id(c))  # a command shared by the workers of a mesh (`shared`) is mapped once
    if out is None:
        out = memo[id(c)] = _map_cmd(c, tid, seed, scalar, seq, memo)
    return out


def _map_cmd(c: m.Cmd, tid: Map, seed: Map, scalar: Callable[[Any], Any], seq: Callable[[str, int], int],
             memo: dict[int, Any]) -> m.Cmd:
    t = type(c)
    if t is m.CmdRun:
        return replace(c, args=_memo(c.args, tid, scalar, memo), kwargs=_memo(c.kwargs, tid, scalar, memo),
                       outs=[None if o is None else tid(o) for o in c.outs],
                       local=None if c.local is None else {d: _memo(v, tid, scalar, memo) for d, v in c.local.items()},
                       seed=None if c.seed is None else seed(c.seed))
    if t is m.CmdDelete:
        return m.CmdDelete(tids=[tid(x) for x in c.tids], devices=c.devices, mesh=c.mesh)
    if t is m.CmdMesh:
        return c
    if t is m.CmdCreate:
        return replace(c, tid=tid(c.tid), seed=seed(c.seed) if c.init in RANDOM_INITS else c.seed)
    if t is m.CmdRedistribute:
        return replace(c, src=tid(c.src), dst=tid(c.dst))
    if t is m.CmdExpectReads:
        return replace(c, tid=tid(c.tid), dst=tid(c.dst))
    if t is m.CmdCollective:
        return replace(c, src=tid(c.src), dst=tid(c.dst), steps=[replace(s, ops=[
            o if not o.group else replace(o, seq=seq(o.group, o.seq)) for o in s.ops]) for s in c.steps])
    raise TypeError(f"a program cannot hold a {t.__name__}")


def _memo(value: Any, tid: Map, scalar: Callable[[Any], Any], memo: dict[int, Any]) -> Any:
    out = memo.get(id(value))
    if out is None:
        out = memo[id(value)] = map_args(value, tid, scalar)
    return out


def check_cmds(c: m.CmdProgram) -> str | None:
    """What is wrong with a worker's program `c`, in one line, or None (rule 6)."""
    if min(c.ntids, c.nseeds, c.nscalars) < 0:
        return f"program {c.program}: ntids, nseeds and nscalars must be >= 0"
    tid, seed, scalar = _bounded(c.ntids, "tensor"), _bounded(c.nseeds, "seed"), _bounded(c.nscalars, "number")

    def offset(_group: str, q: int) -> int:
        if type(q) is not int or q < 1:
            raise ValueError(f"group op offset {q!r} is not >= 1")
        return q

    for n, cmd in enumerate(c.cmds):
        try:
            map_cmd(cmd, tid, seed, scalar, offset, {})
        except (ValueError, TypeError) as e:
            return f"program {c.program}, command {n}: {e}"
    return None


def fill_cmds(c: m.CmdProgram, r: m.CmdReplay) -> list[m.Cmd]:
    """The commands of replay `r` of a checked worker program `c`; ValueError names a replay that does not fit."""
    if len(r.tids) != c.ntids or len(r.seeds) != c.nseeds or len(r.scalars) != c.nscalars:
        raise ValueError(f"replay of program {r.program} names {len(r.tids)} tensors, {len(r.seeds)} seeds and "
                         f"{len(r.scalars)} numbers; its commands take {c.ntids}, {c.nseeds} and {c.nscalars}")
    groups = r.groups

    def seq(group: str, offset: int) -> int:
        base = groups.get(group)
        if base is None:
            raise ValueError(f"replay of program {r.program} does not say where group {group}'s ops go on from")
        return base + offset

    memo: dict[int, Any] = {}
    tid, seed, scalar = r.tids.__getitem__, r.seeds.__getitem__, r.scalars.__getitem__
    return [map_cmd(cmd, tid, seed, scalar, seq, memo) for cmd in c.cmds]


def check_replay(d: m.InstrDefine, r: m.InstrReplay) -> str | None:
    """What is wrong with replay `r` of `d`, in one line, or None."""
    if len(r.tids) != d.ntids or len(r.seeds) != d.nseeds or len(r.scalars) != d.nscalars:
        return (f"replay of program {r.program} names {len(r.tids)} tensors, {len(r.seeds)} seeds and "
                f"{len(r.scalars)} numbers; it was defined with {d.ntids}, {d.nseeds} and {d.nscalars}")
    return None
