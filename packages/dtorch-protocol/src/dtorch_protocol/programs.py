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


def _keep(x: Any) -> Any:
    return {SCALAR_HOLE: x}


def _args(value: Any, f: Map, scalar: Callable[[Any], Any]) -> Any:
    """`value` with the tid of every tensor slot mapped by `f` and every number hole by `scalar` (rule 3)."""
    if type(value) is dict:
        if len(value) == 1:
            if m.TENSOR_SLOT in value:
                return {m.TENSOR_SLOT: f(value[m.TENSOR_SLOT])}
            if SCALAR_HOLE in value:
                return scalar(value[SCALAR_HOLE])
        return {k: _args(v, f, scalar) for k, v in value.items()}
    if type(value) is list or type(value) is tuple:
        return [_args(v, f, scalar) for v in value]
    return value


def map_ids(instr: m.StepInstr, tid: Map, seed: Map, scalar: Callable[[Any], Any] = _keep) -> m.StepInstr:
    """`instr` with each tensor id mapped by `tid`, each seed that is a slot (rule 2) by `seed` and each number
    hole (rule 3) replaced by `scalar(k)` (default: kept as the hole)."""
    t = type(instr)
    if t is m.InstrCall:
        return replace(instr, args=_args(instr.args, tid, scalar), kwargs=_args(instr.kwargs, tid, scalar),
                       outs=[None if o is None else m.OutSpec(tid(o.tid), o.spec) for o in instr.outs],
                       local=None if instr.local is None else _args(instr.local, tid, scalar),
                       seed=None if instr.seed is None else seed(instr.seed))
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


def check_replay(d: m.InstrDefine, r: m.InstrReplay) -> str | None:
    """What is wrong with replay `r` of `d`, in one line, or None."""
    if len(r.tids) != d.ntids or len(r.seeds) != d.nseeds or len(r.scalars) != d.nscalars:
        return (f"replay of program {r.program} names {len(r.tids)} tensors, {len(r.seeds)} seeds and "
                f"{len(r.scalars)} numbers; it was defined with {d.ntids}, {d.nseeds} and {d.nscalars}")
    return None
