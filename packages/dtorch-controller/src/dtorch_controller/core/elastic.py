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
"""

from __future__ import annotations

from collections.abc import Mapping

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
