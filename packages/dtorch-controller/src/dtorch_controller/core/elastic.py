"""Which logical devices move when the scheduler grows a session or relocates a frozen one. Pure planning.

Rules:

1. The scheduler decides who grows and onto which workers (`Changes.grown`, scheduler.py rule 5); this
   module only decides which logical devices move there. The controller hands the moves to moves.py, which
   copies the shards worker to worker while the session's batches are held, then rebinds.
2. Devices move from the session's most loaded worker (most bound devices of this session), highest
   logical ids first, until each new worker hosts its share (the session's devices divided by its workers,
   rounded down); a new worker that gets no device is given back at once (`Scheduler.shrink`).
3. Relocation (scheduler.py rule 6, `Changes.relocated`): a frozen session resumes on substitutes for the
   devices its preemptor took; every logical device bound to such a device moves to its substitute, one
   move per device pair, pulled by the substitute from the lost device's server (moves.py rule 3: not
   behind the preemptor's work queued there). Its held batches go out once the moves are done.
4. Shrink (scheduler.py rule 10, `Changes.shrunk`): an elastic session gives up some of its workers to a
   preemptor and keeps running on the rest; every logical device bound to a worker given up moves to the kept
   worker hosting the fewest of its devices, as a pull (rule 3: the preemptor's work may be queued there). It
   runs on fewer workers (virtual devices) until it grows again (rule 1).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

Plan = list[tuple[str, str, list[int]]]  # (src worker, dst worker, logical devices)


def grow(devices: Mapping[int, str], new: list[str]) -> tuple[Plan, list[str]]:
    """Moves spreading `devices` (logical -> worker) onto the `new` workers, and the new workers left unused."""
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
    used = {dst for _src, dst in moves}
    return [(src, dst, sorted(ds)) for (src, dst), ds in moves.items()], [w for w in new if w not in used]


def relocate(devices: Mapping[int, str], swap: Mapping[str, str]) -> tuple[Plan, list[str]]:
    """Moves of the devices bound to each worker in `swap` onto its substitute, and the substitutes not needed
    (the lease on that worker held none of the session's devices)."""
    moves, unused = [], []
    for src, dst in swap.items():
        on_src = sorted(d for d, w in devices.items() if w == src)
        if on_src:
            moves.append((src, dst, on_src))
        else:
            unused.append(dst)
    return moves, unused


def shrink(devices: Mapping[int, str], gone: Collection[str], order: Callable[[str], int]) -> Plan:
    """Moves of the devices bound to the workers in `gone` (given up to a preemptor: scheduler rule 10) onto the
    workers kept, each to the kept worker hosting the fewest of the session's devices so far, by `order` among
    equals (rule 4). Nothing moves when no worker is kept."""
    load: dict[str, int] = {}
    for _d, w in sorted(devices.items()):
        if w not in gone:
            load[w] = load.get(w, 0) + 1
    moves: dict[tuple[str, str], list[int]] = {}
    for d, src in sorted(devices.items()):
        if src in gone and load:
            dst = min(load, key=lambda w: (load[w], order(w)))
            load[dst] += 1
            moves.setdefault((src, dst), []).append(d)
    return [(src, dst, ds) for (src, dst), ds in moves.items()]
