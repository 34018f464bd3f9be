"""`dtorch-controller usage`: the usage records summed by tenant or session, as a table, CSV or JSON."""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import time
from datetime import datetime

from rich.console import Console
from rich.table import Table

from dtorch_controller.status_view import human_bytes, plain
from dtorch_controller.usage import Row, read, summarise

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
COLUMNS = ("tenant", "sessions", "devices", "device_seconds", "memory_byte_seconds", "moved_bytes", "instructions",
           "start", "end")


def parse_since(text: str, now: float | None = None) -> float:
    """Unix seconds from `--since`: unix seconds, an ISO time, or an age (90s, 30m, 24h, 7d); "" is 0. A time no
    date can show (nan, inf, 1e20, an age of 99999999999d) is refused here (it was a traceback from the title)."""
    if not text:
        return 0.0
    now = time.time() if now is None else now
    if age := _AGE.match(text):
        return _shown(text, now - float(age.group(1)) * _UNITS[age.group(2)])
    try:
        seconds = float(text)
    except ValueError:
        seconds = None
    if seconds is not None:
        return _shown(text, seconds)
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"bad --since {text!r}: expected unix seconds, an ISO time (2026-12-01T00:00) or an age "
                         "(90s, 30m, 24h, 7d)") from None


def _shown(text: str, t: float) -> float:
    try:
        _iso(t)
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"bad --since {text!r}: out of range (no date falls there)") from None
    return t


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t).isoformat(timespec="seconds")


def _fields(row: Row, by: str) -> dict[str, object]:
    return {by: row.key, **({"tenant": row.tenant} if by == "session" else {}), "sessions": len(row.sessions),
            "devices": row.devices, "device_seconds": round(row.device_seconds, 6),
            "memory_byte_seconds": round(row.memory_byte_seconds, 3), "moved_bytes": row.moved_bytes,
            "instructions": row.instructions, "start": _iso(row.start), "end": _iso(row.end)}


def main(args: argparse.Namespace) -> int:
    if not args.usage_file:
        print("dtorch-controller usage: pass --usage-file PATH or set DTORCH_USAGE_FILE", file=sys.stderr)
        return 2
    try:
        since = parse_since(args.since)
        foreign: list[int] = []
        records = list(read(args.usage_file, foreign))
        rows = summarise(records, args.by, since)
    except ValueError as e:
        print(f"dtorch-controller usage: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"dtorch-controller usage: cannot read {args.usage_file} ({e.strerror or e})", file=sys.stderr)
        return 1
    if foreign and not records:
        print(f"dtorch-controller usage: {args.usage_file} holds no usage records (line {foreign[0]} is not one); "
              "expected the file the controller writes with --usage-file", file=sys.stderr)
        return 2
    if foreign:
        lines, are = ("1 line", "is not a usage record") if len(foreign) == 1 else \
            (f"{len(foreign)} lines", "are not usage records")
        print(f"dtorch-controller usage: skipped {lines} of {args.usage_file} that {are} (first: line {foreign[0]})",
              file=sys.stderr)
    out = [_fields(r, args.by) for r in rows]
    if args.format == "json":
        print(json.dumps(out, indent=1))
    elif args.format == "csv":
        columns = list(out[0]) if out else [args.by, *COLUMNS[1:]]
        writer = csv.DictWriter(sys.stdout, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(out)
    else:
        table = Table(title=f"usage by {args.by}" + (f" since {_iso(since)}" if since else ""), title_justify="left")
        for c in (args.by, *(("tenant",) if args.by == "session" else ()), "sessions", "devices", "device-hours",
                  "memory GiB-hours", "moved", "instructions", "from", "to"):
            table.add_column(c, justify="left" if c in (args.by, "tenant", "from", "to") else "right")
        for r in rows:
            # a record's strings are the file's: plain text (status_view); a hand-edited '[/]' crashed the table
            table.add_row(plain(r.key[:16] if args.by == "session" else r.key or "-"),
                          *((plain(r.tenant or "-"),) if args.by == "session" else ()), str(len(r.sessions)),
                          str(r.devices), f"{r.device_seconds / 3600:.4f}",
                          f"{r.memory_byte_seconds / 3600 / (1 << 30):.4f}", human_bytes(r.moved_bytes),
                          str(r.instructions), _iso(r.start), _iso(r.end))
        Console(width=200).print(table)
    return 0
