"""A session's captured programs (`dtorch.compile`, issue #12 item 2): definitions kept, replays filled in.

Pure: `expand(store, instrs)` returns the batch with each `InstrDefine` taken out (kept in `store`, the
session's `programs`) and each `InstrReplay` replaced by its program's instructions with the replay's tensor ids
and seeds, plus an ErrorReport for each one it refused. The core calls it on every Submit before logging and
translating, so the log, recovery, migration and elastic growth only ever see plain instructions: a replay is
translated for the binding of the moment, never from a stale translation.

Rules:
  1. A definition is checked (`dtorch_protocol.programs.check`) and kept under its id, replacing one of the
     same id; a session holds at most MAX_PROGRAMS (a definition beyond them is refused).
  2. A replay of an unknown program, or naming the wrong number of tensor ids, seeds or numbers, is refused: it runs
     nothing and its error is raised at the session's next Sync (the instructions after it go on, as for any
     refused instruction).
  3. One batch expands to at most MAX_EXPANDED instructions: replays beyond that are refused (a few bytes of
     replays must not make the controller translate millions of instructions).
Not done yet: keeping the translated per-worker batches of a program (replays are translated again).
"""

from __future__ import annotations

from dtorch_protocol import messages as m
from dtorch_protocol import programs as p

MAX_EXPANDED = 1 << 18  # instructions one Submit may expand to (rule 3)


def _refusal(program: int, message: str) -> m.ErrorReport:
    return m.ErrorReport(op=f"program:{program}", src="", message=message, kind=m.ErrorKind.REFUSED)


def expand(store: dict[int, m.InstrDefine], instrs: list[m.Instr]) -> tuple[list[m.Instr], list[m.ErrorReport]]:
    """The batch to log and translate, and the refusals (rules 1-2). Leaves batches without programs as they are."""
    if not any(type(i) is m.InstrDefine or type(i) is m.InstrReplay for i in instrs):
        return instrs, []
    out: list[m.Instr] = []
    refused: list[m.ErrorReport] = []
    for instr in instrs:
        if type(instr) is m.InstrDefine:
            problem = p.check(instr)
            if problem is None and instr.program not in store and len(store) >= p.MAX_PROGRAMS:
                problem = f"program {instr.program}: a session holds at most {p.MAX_PROGRAMS} programs"
            if problem is not None:
                refused.append(_refusal(instr.program, problem))
            else:
                store[instr.program] = instr
        elif type(instr) is m.InstrReplay:
            d = store.get(instr.program)
            problem = f"unknown program {instr.program}" if d is None else p.check_replay(d, instr)
            if problem is None and len(out) + len(d.instrs) > MAX_EXPANDED:
                problem = f"replay of program {instr.program}: one batch expands to at most {MAX_EXPANDED} instructions"
            if problem is not None:
                refused.append(_refusal(instr.program, problem))
            else:
                out.extend(p.fill(d.instrs, instr.tids, instr.seeds, instr.scalars))
        else:
            out.append(instr)
    return out, refused
