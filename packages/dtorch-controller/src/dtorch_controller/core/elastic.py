"""Moves the scheduler asks for: elastic growth, and relocation of a frozen session onto substitute devices.

Rules:

1. The scheduler decides who grows and onto which workers (`Changes.grown`, scheduler.py rule 5); this
   module only decides which logical devices move there and hands the moves to the mover (migration.py),
   which copies the shards worker to worker while the session's batches are held, then rebinds.
2. Devices move from the session's most loaded worker (most bound devices of this session), highest
   logical ids first, until each new worker hosts its share (the session's devices divided by its workers,
   rounded down); a new worker that gets no device is given back at once (`Scheduler.shrink`).
3. Relocation (scheduler.py rule 6, `Changes.relocated`): a frozen session resumes on substitutes for the
   devices its preemptor took; every logical device bound to such a device moves to its substitute, one
   move per device pair, pulled by the substitute from the lost device's server (migration.py rule 3: not
   behind the preemptor's work queued there). Its held batches go out once the moves are done.
4. Shrink (scheduler.py rule 10, `Changes.shrunk`): an elastic session gives up some of its workers to a
   preemptor and keeps running on the rest; every logical device bound to a worker given up moves to the kept
   worker hosting the fewest of its devices, as a pull (rule 3: the preemptor's work may be queued there). It
   runs on fewer workers (virtual devices) until it grows again (rule 1).
5. Pure planning (`plan`) is separate from effects, so it is tested on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtorch_controller.core.controller import ControllerCore, Effects


def plan(devices: Mapping[int, str], new: list[str]) -> list[tuple[str, str, list[int]]]:
    """(src, dst, logical devices) moves spreading `devices` (logical -> worker) onto the `new` workers."""
    by_worker: dict[str, list[int]] = {}
    for d, w in sorted(devices.items()):
        by_worker.setdefault(w, []).append(d)
    workers = len(by_worker) + len(new)
    share = len(devices) // workers if workers else 0
    moves: dict[tuple[str, str], list[int]] = {}
    for dst in new:
        for _ in range(share):
            src = max(by_worker, key=lambda w: (len(by_worker[w]), w))
            if len(by_worker[src]) <= share:
                break
            moves.setdefault((src, dst), []).append(by_worker[src].pop())
    return [(src, dst, sorted(ds)) for (src, dst), ds in moves.items()]


def grow(core: ControllerCore, now: float, session: str, workers: list[str], out: Effects) -> None:
    """Queue the moves that put some of `session`'s logical devices on `workers` (leased to it already)."""
    s = core.sessions.get(session)
    moves = plan(s.devices, workers) if s is not None and _mover(core) is not None else []
    used = {dst for _src, dst, _ds in moves}
    unused = [w for w in workers if w not in used]
    if unused:
        core._apply(now, core.sched.shrink(now, session, unused), out)
    _queue(core, now, session, moves, "grows", out)


def relocate(core: ControllerCore, now: float, session: str, swap: Mapping[str, str], out: Effects) -> None:
    """Queue the moves of `session`'s logical devices off the workers in `swap` onto their substitutes."""
    s = core.sessions.get(session)
    if s is None:
        return
    moves, unused = [], []
    for src, dst in swap.items():
        devices = sorted(d for d, w in s.devices.items() if w == src)
        if devices:
            moves.append((src, dst, devices))
        else:
            unused.append(dst)  # its lease on `src` held none of its devices: the substitute is not needed
    if unused:
        core._apply(now, core.sched.shrink(now, session, unused, stop_growing=False), out)
    _queue(core, now, session, moves, "relocates", out, pull=True)


def shrink(core: ControllerCore, now: float, session: str, workers: list[str], out: Effects) -> None:
    """Queue the moves of `session`'s logical devices off `workers` (given up to a preemptor: scheduler rule 10)
    onto the workers it keeps, each to the kept worker hosting the fewest of its devices so far (rule 4). They
    are pulls (rule 3): the preemptor's work may already be queued on the workers given up."""
    s = core.sessions.get(session)
    if s is None:
        return
    gone = set(workers)
    load: dict[str, int] = {}
    for _d, w in sorted(s.devices.items()):
        if w not in gone:
            load[w] = load.get(w, 0) + 1
    moves: dict[tuple[str, str], list[int]] = {}
    for d, src in sorted(s.devices.items()):
        if src in gone and load:
            dst = min(load, key=lambda w: (load[w], core.workers[w].order))
            load[dst] += 1
            moves.setdefault((src, dst), []).append(d)
    _queue(core, now, session, [(src, dst, ds) for (src, dst), ds in moves.items()], "shrinks", out, pull=True)


def _mover(core: ControllerCore):  # noqa: ANN202 - the core's Mover, when it has one
    return getattr(getattr(core, "faults", None), "mover", None)


def _queue(core: ControllerCore, now: float, session: str, moves: list[tuple[str, str, list[int]]], verb: str,
           out: Effects, pull: bool = False) -> None:
    from dtorch_controller.core.migration import Move

    mover = _mover(core)
    s = core.sessions.get(session)
    if not moves or mover is None or s is None:
        return
    for src, dst, devices in moves:
        mover.queues.setdefault(session, []).append(Move(session=session, devices=devices, src=src, dst=dst,
                                                         requested=now, pull=pull))
    core.log.add(now, f"session {session[:8]} {verb}: " + "; ".join(f"logical {ds} {src} -> {dst}"
                                                                   for src, dst, ds in moves))
    core.faults.active.add(session)
    mover.start_next(s, out)
