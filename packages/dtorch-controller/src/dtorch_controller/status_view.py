"""Render a StatusReply for people (rich tables) or programs (JSON).

Every string of a reply is shown as plain text (`plain`): session names, a worker's address and device type, event
lines and the rest come from tenants and workers, and an operator's terminal must not take them as instructions.

| in a reply's string                                      | shown as                             |
|----------------------------------------------------------|--------------------------------------|
| rich markup (`[bold]`, `[/]`, `[link=...]`)              | the brackets as they are, no style   |
| C0 and C1 control characters, DEL (ESC sequences, `\r`)  | escaped: `\x1b`                      |
| bidirectional overrides and isolates (U+202A-E, 2066-9)  | escaped: `\u202e`                    |
"""

from __future__ import annotations

import re
import sys

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dtorch_protocol import messages as m


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def plain(text: str) -> Text:
    """A string from the controller as inert text: no markup, unsafe characters escaped (module table)."""
    return Text(_UNSAFE.sub(lambda c: ascii(c.group())[1:-1], text))


def to_json(reply: m.StatusReply) -> str:
    return msgspec.json.format(msgspec.json.encode(reply).decode(), indent=2)


def render(reply: m.StatusReply, console: Console | None = None, events: int = 20) -> None:
    """Workers, sessions and the last `events` events, as tables."""
    console = console or Console(width=None if sys.stdout.isatty() else 200)  # piped: do not cut columns to 80
    workers = Table(title=f"workers ({len(reply.workers)})", title_justify="left")
    numeric = ("memory", "util", "tensors", "bytes", "copies")
    for column in ("worker", "state", "address", "node", "device", "memory", "util", "tensors", "bytes", "copies",
                   "leased by", "devices bound"):
        workers.add_column(column, justify="right" if column in numeric else "left",
                           no_wrap=column in ("worker", "state"), min_width=8 if column == "state" else None)
    for w in reply.workers:
        leased = ", ".join(f"{s[:8]}" + (f" ({human_bytes(cap)})" if cap else "") for s, cap in w.leases.items())
        util = f"{w.utilization:.0%}" if w.utilization >= 0 else "-"
        workers.add_row(*map(plain, (w.worker, w.state, w.address, w.node or "-", w.device_type,
                                     human_bytes(w.memory_bytes), util, str(w.tensors), human_bytes(w.bytes),
                                     human_bytes(w.backup_bytes), leased or "-", ", ".join(w.devices) or "-")))
    title = plain(f"sessions ({len(reply.sessions)}, {reply.queued} queued; policy {reply.policy or '?'})")
    sessions = Table(title=title, title_justify="left")
    for column in ("session", "name", "priority", "kind", "schedule", "queue", "state", "devices", "tensors",
                   "snapshot", "recovered", "moved"):
        sessions.add_column(column, justify="right" if column in ("tensors", "queue", "recovered", "moved") else "left")
    for s in reply.sessions:
        devices = ", ".join(f"{d}->{w}" for d, w in sorted(s.devices.items())) or "-"
        snapshot = f"batch {s.snapshot_batch} +{s.replay_batches}" if s.snapshot_batch >= 0 else "none"
        if s.snapshot_bytes:  # what its copies hold, and what its taking copied (the rest kept: unchanged)
            snapshot += f", {human_bytes(s.snapshot_bytes)} ({human_bytes(s.snapshot_copied_bytes)} copied)"
        sessions.add_row(*map(plain, (s.session[:8], s.name or "-", s.priority, s.kind or "-", s.schedule or "-",
                                      str(s.queue_position) if s.queue_position else "-", s.state, devices,
                                      str(s.tensors), snapshot, str(s.recoveries), str(s.migrations))))
    console.print(workers)
    console.print(sessions)
    console.print(f"recent events ({min(events, len(reply.events))} of {len(reply.events)})", style="bold")
    for line in reply.events[-events:]:
        console.print(plain(f"  {line}"), highlight=False)
