"""What a profile says: per-op and per-worker times, redistributions, a Chrome trace, and suggestions.

Pure functions of the data `dtorch.profile()` gathered: each worker's records (`messages.ProfileReply`: every
command of the session it ran in the window, with its time, the bytes it pulled from other workers and the
user's source line) and the client's own note of each redistribution it asked for (`Move`: from which layout to
which, for which op). Suggestions are rules over that data, each a row of `RULES`:

rule             fires when                                              says
redistribution   one redistribution site (line, from -> to) took >= 20%   which tensor moved how much, for which
                 of the window on a worker, or moved >= 25% of all bytes  op, and which layout to keep instead
                 moved (and >= 1 MiB)
repeated         one tensor redistributed to one layout >= 3 times        redistribute it once, reuse the result
imbalance        a worker idle >= 50% of the window while another is      which worker waits: the work (stages,
                 busy >= 4x longer and >= 20% of the window               shards) is unbalanced
small_ops        >= 100 compute ops, more than half producing < 4 KiB     per-op overhead dominates: bigger ops
client_bound     every worker idle >= 70% of a window of >= 50 ms         the time goes to the client (syncs)
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dtorch_protocol import messages as m
from dtorch_protocol.placement_types import placement_from_wire

SHARE_OF_WINDOW = 0.20
SHARE_OF_BYTES = 0.25
MIN_MOVE_BYTES = 1 << 20
REPEATS = 3
IDLE_SHARE = 0.50
BUSY_RATIO = 4.0  # well above what scheduling noise makes of equal work on a loaded machine
BUSY_SHARE = 0.20  # imbalance needs real work: below it every worker mostly waits (the client's time, or nothing),
# and a 4x ratio of two near-idle workers' busy times is one page fault or one scheduling hiccup
SMALL_OPS = 100
SMALL_BYTES = 4 << 10
CLIENT_IDLE = 0.70
CLIENT_WINDOW_S = 0.05
MOVES = ("redistribute", "collective")  # the workers' records of a redistribution (pieces, collectives)


@dataclass(frozen=True)
class Move:
    """The client's note of one redistribution: tensor `src` laid out `src_placements` -> `dst_placements`."""

    src: int
    src_placements: tuple[str, ...]
    dst_placements: tuple[str, ...]
    line: str
    op: str = ""  # the op it was made for ("" for an explicit `.redistribute`)


@dataclass(frozen=True)
class Suggestion:
    rule: str
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass
class WorkerTimes:
    address: str
    window_s: float
    compute_s: float = 0.0
    comm_s: float = 0.0
    others_s: float = 0.0  # other sessions' commands in the window
    moved_bytes: int = 0

    @property
    def idle_s(self) -> float:
        return max(0.0, self.window_s - self.compute_s - self.comm_s - self.others_s)

    @property
    def busy_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass
class OpRow:
    op: str
    line: str
    tensors: set[int] = field(default_factory=set)  # one per call (each call makes its own output)
    compute_s: float = 0.0
    comm_s: float = 0.0
    moved_bytes: int = 0


@dataclass
class MoveRow:
    line: str
    src_placements: tuple[str, ...]
    dst_placements: tuple[str, ...]
    op: str
    calls: int = 0
    seconds: float = 0.0  # summed over workers
    max_worker_s: float = 0.0  # the most one worker spent on it
    moved_bytes: int = 0
    tensors: set[int] = field(default_factory=set)
    per_worker: dict[str, float] = field(default_factory=dict)


@dataclass
class Report:
    """A profile's data, aggregated."""

    workers: list[WorkerTimes]
    ops: list[OpRow]
    moves: list[MoveRow]
    records: dict[str, list[m.OpRecord]]
    repeated: list[tuple[int, MoveRow, int]]  # (src tensor, its site, times)
    missing: list[str]  # workers that could not report (too old, unreachable): one line each

    @property
    def moved_bytes(self) -> int:
        return sum(w.moved_bytes for w in self.workers)


def build(replies: dict[str, m.ProfileReply], moves: dict[int, Move], missing: Iterable[str] = ()) -> Report:
    """Aggregate the workers' records (by address) with the client's notes of its redistributions (by dst tid)."""
    workers, ops, sites = [], {}, {}
    per_src: dict[tuple[int, tuple[str, ...], tuple[str, ...]], int] = {}
    records = {}
    for address, reply in sorted(replies.items()):
        w = WorkerTimes(address, reply.window_s)
        records[address] = list(reply.records)
        for r in reply.records:
            if r.comm:
                w.comm_s += r.seconds
            else:
                w.compute_s += r.seconds
            w.moved_bytes += r.moved_bytes
            row = ops.setdefault((r.op, r.src), OpRow(r.op, r.src))
            row.tensors.add(r.tid)
            row.moved_bytes += r.moved_bytes
            if r.comm:
                row.comm_s += r.seconds
            else:
                row.compute_s += r.seconds
            move = moves.get(r.tid) if r.op in MOVES else None
            if move is not None:
                site = sites.setdefault((move.line, move.src_placements, move.dst_placements, move.op),
                                        MoveRow(move.line, move.src_placements, move.dst_placements, move.op))
                site.seconds += r.seconds
                site.per_worker[address] = site.per_worker.get(address, 0.0) + r.seconds
                site.moved_bytes += r.moved_bytes
                if r.tid not in site.tensors:
                    site.tensors.add(r.tid)
                    site.calls += 1
        w.others_s = max(0.0, reply.busy_s - max(reply.session_s, w.busy_s))
        workers.append(w)
    for site in sites.values():
        site.max_worker_s = max(site.per_worker.values(), default=0.0)
    for move in moves.values():
        key = (move.src, move.src_placements, move.dst_placements)
        per_src[key] = per_src.get(key, 0) + 1
    repeated = []
    for (src, a, b), n in per_src.items():
        if n >= REPEATS:
            site = next((s for s in sites.values() if s.src_placements == a and s.dst_placements == b
                         and any(moves[t].src == src for t in s.tensors if t in moves)), None)
            if site is not None:
                repeated.append((src, site, n))
    return Report(workers, sorted(ops.values(), key=lambda o: -(o.compute_s + o.comm_s)),
                  sorted(sites.values(), key=lambda s: -s.seconds), records, repeated, list(missing))


# ---------------------------------------------------------------- suggestions


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _layout(placements: tuple[str, ...]) -> str:
    """Wire placements as the user wrote them: ("S1", "R") -> (Shard(dim=1), Replicate())."""
    shown = []
    for p in placements:
        try:
            shown.append(repr(placement_from_wire(p)))
        except ValueError:
            shown.append(p)
    return "(" + ", ".join(shown) + ")"


def _redistribution(rep: Report) -> list[Suggestion]:
    window = max((w.window_s for w in rep.workers), default=0.0)
    total = rep.moved_bytes
    out = []
    for site in rep.moves:
        share_t = site.max_worker_s / window if window > 0 else 0.0
        share_b = site.moved_bytes / total if total else 0.0
        if share_t < SHARE_OF_WINDOW and (share_b < SHARE_OF_BYTES or site.moved_bytes < MIN_MOVE_BYTES):
            continue
        why = f"for {site.op}" if site.op else "asked for explicitly"
        keep = (f"make it {_layout(site.dst_placements)} where it is produced, or pick placements for the "
                f"other operands under which {site.op} accepts {_layout(site.src_placements)}") if site.op else \
            f"keep it {_layout(site.dst_placements)} instead of converting it at every use"
        out.append(Suggestion("redistribution", (
            f"the redistribute at {site.line or '?'} {_layout(site.src_placements)} -> "
            f"{_layout(site.dst_placements)} ({why}) moved {_mib(site.moved_bytes)} in {site.calls} calls, "
            f"{share_t:.0%} of the profiled time on its busiest worker: {keep}")))
    return out


def _repeated(rep: Report) -> list[Suggestion]:
    return [Suggestion("repeated", (
        f"tensor {src} is redistributed {_layout(site.src_placements)} -> {_layout(site.dst_placements)} {n} times "
        f"(at {site.line or '?'}): redistribute it once, keep the result and reuse it"))
        for src, site, n in rep.repeated]


def _imbalance(rep: Report) -> list[Suggestion]:
    if len(rep.workers) < 2:
        return []
    busiest = max(rep.workers, key=lambda w: w.busy_s)
    if busiest.busy_s < BUSY_SHARE * busiest.window_s:
        return []
    out = []
    for w in rep.workers:
        if w is busiest or w.window_s <= 0:
            continue
        idle = w.idle_s / w.window_s
        if idle >= IDLE_SHARE and busiest.busy_s >= BUSY_RATIO * max(w.busy_s, 1e-9):
            out.append(Suggestion("imbalance", (
                f"worker {w.address} idle {idle:.0%} of the profile while {busiest.address} is busy "
                f"{busiest.busy_s / max(busiest.window_s, 1e-9):.0%}: the work is unbalanced (pipeline stages of "
                f"unequal cost, uneven shards, a mesh on some devices only); give {w.address}'s devices more of it")))
    return out


def _small_ops(rep: Report) -> list[Suggestion]:
    compute = [r for rs in rep.records.values() for r in rs if not r.comm]
    if len(compute) < SMALL_OPS:
        return []
    small = sum(1 for r in compute if r.out_bytes < SMALL_BYTES)
    if small * 2 <= len(compute):
        return []
    median = statistics.median(r.seconds for r in compute)
    return [Suggestion("small_ops", (
        f"{small} of {len(compute)} ops ({small / len(compute):.0%}) produce less than {SMALL_BYTES >> 10} KiB each "
        f"(median {median * 1e6:.0f} us an op): per-op overhead dominates; work on bigger tensors (a larger batch, "
        f"fewer and larger ops) so each op does more"))]


def _client_bound(rep: Report) -> list[Suggestion]:
    windows = [w for w in rep.workers if w.window_s >= CLIENT_WINDOW_S]
    if not windows or len(windows) < len(rep.workers):
        return []
    idle = min(w.idle_s / w.window_s for w in windows)
    if idle < CLIENT_IDLE:
        return []
    return [Suggestion("client_bound", (
        f"every worker was idle at least {idle:.0%} of the profile: the time goes to the client, not the devices "
        f"(sync points inside the step such as .item(), print or to_torch(), uploads of plain tensors, planning "
        f"new op signatures); sync once per step and keep the data on the workers"))]


RULES: dict[str, Callable[[Report], list[Suggestion]]] = {
    "redistribution": _redistribution, "repeated": _repeated, "imbalance": _imbalance, "small_ops": _small_ops,
    "client_bound": _client_bound}


def suggestions(rep: Report) -> list[Suggestion]:
    return [s for rule in RULES.values() for s in rule(rep)]


# ---------------------------------------------------------------- the table and the trace


def table(rep: Report, rows: int = 20) -> str:
    lines = []
    for line in rep.missing:
        lines.append(f"note: {line}")
    lines.append(f"{'op':<34}{'source line':<34}{'calls':>7}{'compute ms':>12}{'comm ms':>10}{'moved':>12}")
    for o in rep.ops[:rows]:
        lines.append(f"{o.op[:33]:<34}{(o.line or '-')[-33:]:<34}{len(o.tensors):>7}{o.compute_s * 1e3:>12.3f}"
                     f"{o.comm_s * 1e3:>10.3f}{_mib(o.moved_bytes):>12}")
    if len(rep.ops) > rows:
        lines.append(f"... {len(rep.ops) - rows} more")
    lines.append("")
    lines.append(f"{'worker':<24}{'window ms':>11}{'compute ms':>12}{'comm ms':>10}{'others ms':>11}{'idle':>7}"
                 f"{'moved':>12}")
    for w in rep.workers:
        idle = w.idle_s / w.window_s if w.window_s > 0 else 0.0
        lines.append(f"{w.address:<24}{w.window_s * 1e3:>11.1f}{w.compute_s * 1e3:>12.3f}{w.comm_s * 1e3:>10.3f}"
                     f"{w.others_s * 1e3:>11.3f}{idle:>7.0%}{_mib(w.moved_bytes):>12}")
    if rep.moves:
        lines.append("")
        lines.append(f"{'redistribution':<60}{'for':<24}{'calls':>7}{'ms':>10}{'moved':>12}")
        for s in rep.moves[:rows]:
            what = f"{(s.line or '?')[-24:]} {_layout(s.src_placements)} -> {_layout(s.dst_placements)}"
            lines.append(f"{what[:59]:<60}{(s.op or 'explicit')[:23]:<24}{s.calls:>7}{s.seconds * 1e3:>10.3f}"
                         f"{_mib(s.moved_bytes):>12}")
    tips = suggestions(rep)
    if tips:
        lines.append("")
        lines.append("suggestions:")
        lines.extend(f"  - {t}" for t in tips)
    return "\n".join(lines)


def chrome_trace(rep: Report) -> str:
    """The Trace Event Format torch.profiler exports (Perfetto and chrome://tracing open it): one process per
    worker, a compute and a communication track each, every command a complete ("X") event in microseconds."""
    starts = [r.start for rs in rep.records.values() for r in rs]
    t0 = min(starts, default=0.0)
    events: list[dict] = []
    for pid, (address, records) in enumerate(sorted(rep.records.items())):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"worker {address}"}})
        for tid, name in ((0, "compute"), (1, "communication")):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        for r in records:
            events.append({"name": r.op, "cat": "comm" if r.comm else "compute", "ph": "X", "pid": pid,
                           "tid": 1 if r.comm else 0, "ts": (r.start - t0) * 1e6, "dur": r.seconds * 1e6,
                           "args": {"source": r.src, "tensor": r.tid, "devices": r.devices,
                                    "moved_bytes": r.moved_bytes, "output_bytes": r.out_bytes}})
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
