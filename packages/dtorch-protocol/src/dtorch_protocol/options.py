"""Command-line option types the controller and worker CLIs share (argparse `type=`): each refuses, in one line,
what the option cannot mean."""

from __future__ import annotations

import argparse

MAX_PORT = 65535


def port(text: str) -> int:
    """A TCP port to serve on, 0-65535 (0: none), as `--metrics-port`."""
    if not text.isdigit() or int(text) > MAX_PORT:
        raise argparse.ArgumentTypeError(f"expected a port number 0-{MAX_PORT} (0: none), got {text!r}")
    return int(text)


def process_id(text: str) -> int:
    """A process id, 1 or more, as `--parent-pid` (-1 and 0 named every process, or none: its watchdog never
    fired)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a process id (a whole number >= 1), got {text!r}")
    return int(text)
