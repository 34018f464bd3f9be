"""Per-session command records for `dtorch.profile()`: what ran here, when, for how long, and what it moved.

A client opens a window with `Profile(start=True)` after a sync (so nothing of its earlier work is still queued)
and closes it with `Profile(start=False)` after another, which returns the records and the window's length and
busy time (any session's: time this worker was not free for the profiled one). Windows of different sessions are
independent; a session's records are bounded (`MAX_RECORDS`, then counted as dropped).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from dtorch_protocol import messages as m

MAX_RECORDS = 200_000


@dataclass
class _Window:
    opened: float  # time.time()
    opened_mono: float
    busy_then: float
    records: list[m.OpRecord] = field(default_factory=list)
    dropped: int = 0
    session_s: float = 0.0  # every command of the session, recorded or not (deletes, announced reads)
    landed: dict[int, int] = field(default_factory=dict)  # dst -> bytes its collectives received (after they ran)
    landed_at: dict[int, float] = field(default_factory=dict)  # dst -> when its last transfer here finished


def first_output(cmd: m.Cmd) -> int:
    if isinstance(cmd, m.CmdRun):
        return next((t for t in cmd.outs if t is not None), -1)
    if isinstance(cmd, (m.CmdRedistribute, m.CmdCollective)):
        return cmd.dst
    if isinstance(cmd, m.CmdCreate):
        return cmd.tid
    return -1


def source_line(cmd: m.Cmd) -> str:
    if isinstance(cmd, (m.CmdRedistribute, m.CmdCollective)):
        return cmd.src_line
    return getattr(cmd, "src", "") if isinstance(cmd, (m.CmdRun, m.CmdCreate)) else ""


def devices(cmd: m.Cmd) -> int:
    if isinstance(cmd, m.CmdRun):
        return len(cmd.devices)
    if isinstance(cmd, m.CmdCreate):
        return len(cmd.boxes)
    if isinstance(cmd, m.CmdRedistribute):
        return len(cmd.plans)
    if isinstance(cmd, m.CmdCollective):
        return len(cmd.out_shapes)
    return 0


class Profiler:
    def __init__(self, busy_s: Callable[[], float]) -> None:
        self._busy_s = busy_s
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}

    def recording(self, session: str) -> bool:
        return bool(self._windows) and session in self._windows  # lock-free: the common case is no window

    def start(self, session: str) -> None:
        with self._lock:
            self._windows[session] = _Window(time.time(), time.monotonic(), self._busy_s())

    def stop(self, session: str) -> m.ProfileReply:
        with self._lock:
            w = self._windows.pop(session, None)
        if w is None:
            return m.ProfileReply(message="no profile was started for this session on this worker")
        if w.landed:  # a collective's bytes and end are known once its ops ran on their lanes, after its command
            w.records = [msgspec.structs.replace(r, moved_bytes=r.moved_bytes + w.landed.pop(r.tid),
                                                 landed=w.landed_at[r.tid])
                         if r.op == "collective" and r.tid in w.landed else r for r in w.records]
        return m.ProfileReply(records=w.records, started=w.opened, window_s=time.monotonic() - w.opened_mono,
                              busy_s=self._busy_s() - w.busy_then, session_s=w.session_s, dropped=w.dropped)

    def discard(self, session: str) -> None:
        with self._lock:
            self._windows.pop(session, None)

    def received(self, session: str, dst: int, n: int) -> None:
        """A collective of the recorded session's redistribution into `dst` received `n` bytes (its op just ended)."""
        now = time.time()
        with self._lock:
            w = self._windows.get(session)
            if w is not None:
                w.landed[dst] = w.landed.get(dst, 0) + n
                w.landed_at[dst] = max(w.landed_at.get(dst, 0.0), now)

    def record(self, session: str, name: str, cmd: m.Cmd, started: float, seconds: float, comm: bool, moved: int,
               out_bytes: int) -> None:
        """One command of a recorded session ran; `name` "" (bookkeeping) counts its time, not a record."""
        with self._lock:
            w = self._windows.get(session)
            if w is None:
                return
            w.session_s += seconds
            if not name:
                return
            if len(w.records) >= MAX_RECORDS:
                w.dropped += 1
                return
            w.records.append(m.OpRecord(op=name, src=source_line(cmd), tid=first_output(cmd), comm=comm,
                                        start=started, seconds=seconds, moved_bytes=moved, out_bytes=out_bytes,
                                        devices=devices(cmd)))
