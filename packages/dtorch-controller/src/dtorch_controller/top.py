"""`dtorch-controller top`: a live view of a running controller, refreshed every second (rich).

One `Status` call per refresh; rates come from the difference between two replies: a session's batches/s (its
accepted Submit batches) and devices busy (device-seconds attained per second: the devices it ran on, nothing
while queued or frozen). Workers show their utilization as they reported it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dtorch_controller.status_view import human_bytes, plain
from dtorch_protocol import messages as m


@dataclass
class Snapshot:
    at: float
    reply: m.StatusReply


def _rates(prev: Snapshot | None, now: Snapshot) -> dict[str, tuple[float, float]]:
    """session -> (batches/s, devices busy) since the previous snapshot (nothing for the first one)."""
    if prev is None or now.at <= prev.at:
        return {}
    dt = now.at - prev.at
    before = {s.session: s for s in prev.reply.sessions}
    out = {}
    for s in now.reply.sessions:
        b = before.get(s.session)
        if b is not None:
            out[s.session] = (max(0, s.batches - b.batches) / dt, max(0.0, s.attained_s - b.attained_s) / dt)
    return out


def frame(prev: Snapshot | None, now: Snapshot, target: str) -> Group:
    """One screen: a summary line, the workers, the sessions with their throughput, the queue, recent events."""
    reply = now.reply
    alive = sum(1 for w in reply.workers if w.state == "alive")
    running = sum(1 for s in reply.sessions if s.schedule == "running")
    rates = _rates(prev, now)
    head = plain(f"dtorch-controller {target}  {time.strftime('%H:%M:%S')}  policy {reply.policy or '?'}  "
                 f"workers {alive}/{len(reply.workers)} alive  sessions {len(reply.sessions)} ({running} running)  "
                 f"queue {reply.queued}")
    head.stylize("bold")
    workers = Table(title="workers", title_justify="left", expand=True)
    for c in ("worker", "state", "node", "device", "util", "memory", "held", "sessions"):
        workers.add_column(c, justify="right" if c in ("util", "memory", "held") else "left")
    for w in reply.workers:
        util = f"{w.utilization:.0%}" if w.utilization >= 0 else "-"
        workers.add_row(*map(plain, (w.worker, w.state, w.node or "-", w.device_type, util, human_bytes(w.memory_bytes),
                                     human_bytes(w.bytes),
                                     ", ".join(sorted({d.split(":")[0][:8] for d in w.devices})) or "-")))
    sessions = Table(title="sessions", title_justify="left", expand=True)
    for c in ("session", "name", "priority", "schedule", "devices", "batches/s", "devices busy", "device-s",
              "tensors"):
        sessions.add_column(c, justify="right" if c in ("devices", "batches/s", "devices busy", "device-s",
                                                        "tensors") else "left")
    for s in reply.sessions:
        batches, busy = rates.get(s.session, (0.0, 0.0))
        sessions.add_row(*map(plain, (s.session[:8], s.name or "-", s.priority, s.schedule or "-", str(len(s.devices)),
                                      f"{batches:.1f}", f"{busy:.2f}", f"{s.attained_s:.0f}", str(s.tensors))))
    queue = Table(title=f"queue ({reply.queued})", title_justify="left", expand=True)
    for c in ("position", "session", "name", "priority", "kind"):
        queue.add_column(c)
    for s in sorted((s for s in reply.sessions if s.queue_position), key=lambda s: s.queue_position):
        queue.add_row(*map(plain, (str(s.queue_position), s.session[:8], s.name or "-", s.priority, s.kind or "-")))
    events = Text("\n").join(plain(line) for line in reply.events[-5:])
    events.stylize("dim")
    return Group(head, workers, sessions, queue, events)


def run(ask: Callable[[], m.StatusReply | None], target: str, refresh_s: float = 1.0, iterations: int = 0,
        console: Console | None = None, clock: Callable[[], float] = time.monotonic) -> int:
    """Show `frame`s until interrupted (or for `iterations`); returns 1 when the controller cannot be asked."""
    prev: Snapshot | None = None
    shown = 0
    with Live(console=console, refresh_per_second=4, screen=False, auto_refresh=False) as live:
        try:
            while not iterations or shown < iterations:
                started = clock()
                reply = ask()
                if reply is None:
                    return 1
                snap = Snapshot(clock(), reply)
                live.update(frame(prev, snap, target), refresh=True)
                prev = snap
                shown += 1
                if not iterations or shown < iterations:
                    time.sleep(max(0.0, refresh_s - (clock() - started)))
        except KeyboardInterrupt:
            pass
    return 0
