"""Usage records for billing: what each session held and moved, one JSON line per session and interval.

Rules:

1. Every `--usage-interval` seconds (and when a session closes) the controller appends, for each session that
   held or did anything since its last record, one record of that interval (`Record`): tenant, session,
   devices held at its end, device-seconds, memory-byte-seconds, bytes moved, instructions, start and end
   (unix seconds). Records are deltas: a session's usage is the sum of its records.
2. Device-seconds are the core's attained service (`SessionStatus.attained_s`: physical devices held x time
   running; nothing while queued or frozen). Memory-byte-seconds integrate the bytes of the session's shards on
   its workers (their reports) over time. Bytes moved are what its workers received for it (pieces,
   collectives, uploads) and what its client read (`ShardStats.moved_bytes`, cumulative per worker: a worker
   that restarted counts from zero again). Instructions are those of its accepted Submits, as the core counts
   them (notice `Accepted`).
3. The file is append-only and durable: each interval's records are written together and fsync'd once (a batch).
   Every record names the controller run that wrote it and its number in that run (`run`, `seq`), so a reader
   counts a record once however often it appears. A line cut short by a crash is dropped when the next run
   opens the file (it was never complete, so never counted) and skipped by readers. A restarted controller starts
   its sessions' usage from zero (the sessions of the old run ended with it): nothing is counted twice.
4. A file that cannot be written is one line on stderr and the controller goes on without usage records.

`summarise` reads a file back for `dtorch-controller usage` (by tenant or session, since a time); a complete line that
is not a record (a field missing or of another type, another file given by mistake, or values no controller
writes: a negative number, one of 2**63 or more, times outside 1970-9999 or ending before they start) is skipped,
and the command says how many and which first, or refuses a file that holds none.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from dtorch_protocol import messages as m

FIELDS = ("tenant", "session", "name", "devices", "device_seconds", "memory_byte_seconds", "moved_bytes",
          "instructions", "start", "end")


@dataclass(frozen=True)
class Record:
    run: str
    seq: int
    tenant: str
    session: str
    name: str
    devices: int  # physical devices (workers) held at the end of the interval
    device_seconds: float
    memory_byte_seconds: float
    moved_bytes: int
    instructions: int
    start: float  # unix seconds
    end: float
    final: bool = False  # the session closed at `end`


@dataclass
class _Session:
    tenant: str
    name: str = ""
    since: float = 0.0  # unix time its current interval started
    attained: float = 0.0  # attained_s at the last record
    devices: int = 0
    memory_bytes: int = 0  # bytes of its shards now (all workers)
    memory_byte_seconds: float = 0.0  # in the current interval
    moved: int = 0  # bytes moved in the current interval
    instructions: int = 0  # in the current interval
    last_seen: float = 0.0  # unix time of the last sample


@dataclass
class Accounting:
    """Per-session usage as the adapter sees it; `take` turns what accrued into records. Thread-safe."""

    clock: Callable[[], float] = time.time
    run: str = field(default_factory=lambda: secrets.token_hex(4))
    _sessions: dict[str, _Session] = field(default_factory=dict)
    _moved: dict[tuple[str, str], int] = field(default_factory=dict)  # (worker, session) -> its last moved_bytes
    _memory: dict[tuple[str, str], int] = field(default_factory=dict)  # (worker, session) -> bytes held there
    _seq: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    totals: dict[str, tuple[float, int]] = field(default_factory=dict)  # tenant -> (device-s, bytes), ever

    def opened(self, session: str, tenant: str, name: str) -> None:
        now = self.clock()
        with self._lock:
            self._sessions.setdefault(session, _Session(tenant, name, since=now, last_seen=now))

    def submitted(self, session: str, instructions: int) -> None:
        with self._lock:
            s = self._sessions.get(session)
            if s is not None:
                s.instructions += instructions

    def reported(self, worker: str, stats: dict[str, m.ShardStats]) -> None:
        """A worker's report: the moved-bytes counters and the bytes held of the sessions it hosts."""
        with self._lock:
            for key in [k for k in self._memory if k[0] == worker and k[1] not in stats]:
                del self._memory[key]
            for session, st in stats.items():
                if "#" in session:  # copies for recovery: the controller's, in host memory
                    continue
                key = (worker, session)
                before = self._moved.get(key, 0)
                delta = st.moved_bytes - before if st.moved_bytes >= before else st.moved_bytes  # a restart
                self._moved[key] = st.moved_bytes
                self._memory[key] = st.bytes
                s = self._sessions.get(session)
                if s is not None and delta:
                    s.moved += delta
                    self._add(s.tenant, 0.0, delta)

    def _add(self, tenant: str, device_s: float, moved: int) -> None:
        d, b = self.totals.get(tenant, (0.0, 0))
        self.totals[tenant] = (d + device_s, b + moved)

    def tenant_totals(self, status: m.StatusReply) -> dict[str, tuple[float, int]]:
        """tenant -> (device-seconds, bytes moved) so far: recorded, plus what accrued since (metrics)."""
        with self._lock:
            totals = dict(self.totals)
            for st in status.sessions:
                s = self._sessions.get(st.session)
                if s is not None and st.attained_s > s.attained:
                    d, b = totals.get(s.tenant, (0.0, 0))
                    totals[s.tenant] = (d + st.attained_s - s.attained, b)
        return totals

    def take(self, status: m.StatusReply, only: str | None = None) -> list[Record]:
        """Records of what accrued up to now, from the core's `status` (admin view); `only`: of that session alone
        (just before it closes). Sessions gone from `status` get their last record (`final`)."""
        now = self.clock()
        out: list[Record] = []
        with self._lock:
            memory: dict[str, int] = {}
            for (_worker, session), n in self._memory.items():
                memory[session] = memory.get(session, 0) + n
            seen = set()
            for st in status.sessions:
                if only is not None and st.session != only:
                    continue
                s = self._sessions.get(st.session)
                if s is None:  # opened before this run kept accounts (or by another path): from now on
                    s = self._sessions[st.session] = _Session(st.tenant, st.name, since=now, last_seen=now,
                                                              attained=st.attained_s)
                seen.add(st.session)
                s.memory_byte_seconds += s.memory_bytes * max(0.0, now - s.last_seen)
                s.memory_bytes = memory.get(st.session, 0)
                s.last_seen = now
                s.devices = len(set(st.devices.values())) if st.schedule == "running" else 0
                device_s = max(0.0, st.attained_s - s.attained)
                s.attained = st.attained_s
                self._add(s.tenant, device_s, 0)
                if device_s or s.memory_byte_seconds or s.moved or s.instructions:
                    out.append(self._record(st.session, s, device_s, now, False))
            if only is None:
                for session in [x for x in self._sessions if x not in seen]:  # closed or expired meanwhile
                    s = self._sessions.pop(session)
                    s.devices = 0
                    out.append(self._record(session, s, 0.0, now, True))
            self._moved = {k: v for k, v in self._moved.items() if k[1] in self._sessions}
        return out

    def _record(self, session: str, s: _Session, device_s: float, now: float, final: bool) -> Record:
        self._seq += 1
        r = Record(self.run, self._seq, s.tenant, session, s.name, s.devices, device_s, s.memory_byte_seconds,
                   s.moved, s.instructions, s.since, now, final)
        s.since, s.memory_byte_seconds, s.moved, s.instructions = now, 0.0, 0, 0
        return r


class UsageLog:
    """The append-only JSON-lines file; `append` writes one batch and fsyncs it. Disabled after one line."""

    def __init__(self, path: str | Path, program: str = "dtorch-controller") -> None:
        self.path = Path(path)
        self.program = program
        self._lock = threading.Lock()
        self._fd: int | None = None
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            _drop_torn_tail(self._fd)
        except OSError as e:
            self._fail(e)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def _fail(self, e: OSError) -> None:
        print(f"{self.program}: cannot write usage records to {self.path} ({e.strerror or e}): running without "
              "usage records", file=sys.stderr, flush=True)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None

    def append(self, records: list[Record]) -> None:
        if not records:
            return
        data = "".join(json.dumps(asdict(r), separators=(",", ":")) + "\n" for r in records).encode()
        with self._lock:
            if self._fd is None:
                return
            try:
                os.write(self._fd, data)
                os.fsync(self._fd)
            except OSError as e:
                self._fail(e)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _drop_torn_tail(fd: int) -> None:
    """Cut a last line without its newline (a write a crash interrupted: never complete, never counted)."""
    size = os.fstat(fd).st_size
    if not size:
        return
    tail = os.pread(fd, min(size, 1 << 16), max(0, size - (1 << 16)))
    if tail.endswith(b"\n"):
        return
    cut = tail.rfind(b"\n")
    os.ftruncate(fd, size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= len(tail) else size - len(tail)))


# ---------------------------------------------------------------- reading it back (`dtorch-controller usage`)


_DECODER = msgspec.json.Decoder(Record)  # typed: a field of another type is no record


# Bounds of a record's values, as a controller writes them: sums of many stay finite, and every time shows as a date
MAX_AMOUNT = 2**63
LAST_TIME = 253_402_128_000.0  # 9999-12-30 UTC: the last day a date can show in any time zone


def _record(line: bytes) -> Record | None:
    """The record a line holds, or None: not a JSON object of Record's fields with their types, or values no
    controller writes (a hand-edited start of -1e300 or 1e300 was a traceback from the table's dates)."""
    try:
        r = _DECODER.decode(line)
    except msgspec.DecodeError:  # (ValidationError included)
        return None
    amounts = (r.seq, r.devices, r.device_seconds, r.memory_byte_seconds, r.moved_bytes, r.instructions)
    if not all(0 <= a < MAX_AMOUNT for a in amounts) or not 0 <= r.start <= r.end <= LAST_TIME:
        return None
    return r


def read(path: str | Path, foreign: list[int] | None = None) -> Iterator[Record]:
    """Every complete record once (by run and seq); a torn last line is skipped, and so is a complete line that is
    not a record, whose number goes into `foreign`."""
    seen: set[tuple[str, int]] = set()
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 (a damaged disk block) is a foreign line, not the end
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break
            r = _record(line)
            if r is None:
                if foreign is not None and line.strip():
                    foreign.append(number)
            elif (r.run, r.seq) not in seen:
                seen.add((r.run, r.seq))
                yield r


@dataclass
class Row:
    key: str
    tenant: str
    sessions: set[str] = field(default_factory=set)
    devices: int = 0  # the most held at once (per record)
    device_seconds: float = 0.0
    memory_byte_seconds: float = 0.0
    moved_bytes: int = 0
    instructions: int = 0
    start: float = float("inf")
    end: float = 0.0


def summarise(records: Iterable[Record], by: str, since: float = 0.0) -> list[Row]:
    """Sum records ending after `since` per tenant or per session (`by`)."""
    rows: dict[str, Row] = {}
    for r in records:
        if r.end < since:
            continue
        key = r.tenant if by == "tenant" else r.session
        row = rows.setdefault(key, Row(key, r.tenant))
        row.sessions.add(r.session)
        row.devices = max(row.devices, r.devices)
        row.device_seconds += r.device_seconds
        row.memory_byte_seconds += r.memory_byte_seconds
        row.moved_bytes += r.moved_bytes
        row.instructions += r.instructions
        row.start = min(row.start, r.start)
        row.end = max(row.end, r.end)
    return sorted(rows.values(), key=lambda row: (-row.device_seconds, row.key))
