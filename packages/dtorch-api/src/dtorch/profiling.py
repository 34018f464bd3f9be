"""`dtorch.profile()`: where a step's time goes, per op and per worker, and what to change.

    with dtorch.profile() as p:
        loss = model(batch).sum(); loss.backward(); opt.step()
    print(p.table())                       # per op and source line, per worker, redistributions, suggestions
    p.export_chrome_trace("step.json")     # open in Perfetto (ui.perfetto.dev) or chrome://tracing
    p.suggestions()                        # the suggestions alone

Entering syncs (nothing earlier is still running) and asks every worker holding the session's devices to
record its commands (`Worker.Profile`, with the session's client capability there: a worker records and
returns only the commands of the session the capability names); leaving syncs again and collects the records.
Meanwhile the client notes each redistribution it asks for (from which layout to which, for which op), which
the workers' records do not know; a replayed step's are its program's (`Session.programs`), with the replay's
tensor ids in its slots.
A worker too old to record (it has no `Profile` service) or unreachable is one line on stderr and one note in the
table; the profile goes on without it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from dtorch import _profile_report as report
from dtorch import runtime
from dtorch_protocol import messages as m
from dtorch_protocol import wire

CALL_TIMEOUT_S = 30.0


class Profile:
    """What one `with dtorch.profile():` block recorded; read it after the block."""

    def __init__(self) -> None:
        self._session: Any = None
        self._stubs: dict[str, wire.Stub] = {}
        self._caps: dict[str, str] = {}  # worker address -> the session's capability there
        self._moves: dict[int, report.Move] = {}
        self._pending: list[int] = []  # redistributions whose op comes next
        self._missing: list[str] = []
        self._replies: dict[str, m.ProfileReply] = {}
        self._emit: Any = None
        self.report: report.Report | None = None
        self.wall_s = 0.0

    # ------------------------------------------------------------ the block
    def __enter__(self) -> Profile:
        s = self._session = runtime.get_session()
        s.sync()
        mine = next((x for x in s.status().sessions if x.session == s.id), None)
        self._caps = dict(mine.caps) if mine is not None else {}
        for address in self._caps:
            self._stubs[address] = wire.Stub("dtorch.Worker", address, "", tls=s.tls)
        for address in list(self._stubs):
            if self._call(address, True) is None:
                self._stubs.pop(address).close()
        self._emit = s.emit
        s.emit = self._tap
        self._started = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        s = self._session
        s.emit = self._emit
        try:
            if kind is None:
                s.sync()
        finally:
            self.wall_s = time.perf_counter() - self._started
            for address, stub in self._stubs.items():
                reply = self._call(address, False)
                if reply is not None:
                    self._replies[address] = reply
                stub.close()
            self.report = report.build(self._replies, self._moves, self._missing)

    def _call(self, address: str, start: bool) -> m.ProfileReply | None:
        try:
            reply = self._stubs[address].call("Profile", m.ProfileRequest(session=self._session.id, start=start),
                                              timeout=CALL_TIMEOUT_S, credential=self._caps.get(address, ""))
        except (wire.RemoteError, wire.ProtocolError, ConnectionError, TimeoutError, PermissionError) as e:
            line = (f"worker at {address} is too old to report a profile (no Profile service): its time is missing"
                    if isinstance(e, wire.Unimplemented)
                    else f"worker at {address} did not report its profile: {str(e).splitlines()[0]}")
            if line not in self._missing:
                self._missing.append(line)
                print(f"dtorch.profile: {line}", file=sys.stderr, flush=True)
            return None
        if reply.message and not start:
            self._missing.append(f"worker at {address}: {reply.message}")
        return reply

    def _tap(self, instr: Any) -> None:
        """The session's `emit` during the block: note redistributions and the op each one is for; a replayed
        step's from its program (its slots are the replay's tensor ids; a redistribution that is an operation of
        its own, `.redistribute()` or a hook's, is for no op)."""
        if isinstance(instr, m.InstrReplay):
            instrs, explicit = self._session.programs.get(instr.program, ((), frozenset()))
            for i, step_instr in enumerate(instrs):
                self._note(step_instr, instr.tids.__getitem__, i in explicit)
        else:
            self._note(instr, None, False)
        self._emit(instr)

    def _note(self, instr: Any, slot: Any, explicit: bool) -> None:
        tid = slot or (lambda t: t)
        if isinstance(instr, m.InstrRedistribute):
            dst = tid(instr.dst)
            self._moves[dst] = report.Move(tid(instr.src), tuple(instr.src_spec.placements),
                                           tuple(instr.dst_spec.placements), instr.src_line)
            if not explicit:
                self._pending.append(dst)
        elif isinstance(instr, m.InstrCall) and self._pending:
            used = {tid(t) for t in (*m.tensor_refs(instr.args), *m.tensor_refs(instr.kwargs))}
            for dst in self._pending:
                move = self._moves[dst]
                if dst in used:
                    self._moves[dst] = report.Move(move.src, move.src_placements, move.dst_placements, move.line,
                                                   instr.op)
            self._pending.clear()

    # ------------------------------------------------------------ reading it
    def _report(self) -> report.Report:
        if self.report is None:
            raise RuntimeError("the profile is read after its `with` block")
        return self.report

    def table(self, rows: int = 20) -> str:
        """Per op and source line, per worker (compute, communication, idle), redistributions, suggestions."""
        return report.table(self._report(), rows)

    def suggestions(self) -> list[report.Suggestion]:
        return report.suggestions(self._report())

    def export_chrome_trace(self, path: str | Path) -> None:
        """Write the Trace Event Format JSON that torch.profiler writes (Perfetto, chrome://tracing)."""
        Path(path).write_text(report.chrome_trace(self._report()))


def profile() -> Profile:
    """Profile the block's DTorch work on the workers: `with dtorch.profile() as p: ...`, then `p.table()`."""
    return Profile()
