"""Exceptions a DTorch user sees. Each message is one line naming what went wrong."""

from __future__ import annotations

import linecache
import os


class DTorchError(RuntimeError):
    """Base class for DTorch runtime errors."""


class RemoteOpError(DTorchError):
    """An op failed on a worker; raised at the next sync point with the op and the user's source line."""

    def __init__(self, op: str, src: str, message: str) -> None:
        self.op, self.src, self.remote_message = op, src, message
        super().__init__(f"{op} failed on a worker at {describe_src(src)}: {message}")


class ClusterError(DTorchError):
    """The cluster could not do what was asked (lost worker, no devices, timeout)."""


def describe_src(src: str) -> str:
    """"file.py:12" -> "file.py:12 (`y = x @ w`)" when the line can be read."""
    path, _, line = src.rpartition(":")
    if not path or not line.isdigit():
        return src or "<unknown source line>"
    text = linecache.getline(path, int(line)).strip()
    return f"{src} (`{text}`)" if text else src


def sync_error(reports: list) -> DTorchError:
    """The error a sync point raises for the op errors a Sync reported (`ErrorReport`s, oldest first): the first
    one, naming its op and the user's source line, with up to three more as notes."""
    first = reports[0]
    err: DTorchError = RemoteOpError(first.op, first.src, first.message) if first.src else ClusterError(first.message)
    for more in reports[1:4]:
        err.add_note(f"also: {more.op} at {more.src}: {more.message}")
    if len(reports) > 4:
        err.add_note(f"and {len(reports) - 4} more errors")
    return err


def env_float(name: str, default: float) -> float:
    """A number of seconds from the environment, or a one-line error naming the variable."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {os.environ[name]!r}") from None


def env_int(name: str, default: int) -> int:
    """A whole number (bytes, counts) from the environment, or a one-line error naming the variable."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {os.environ[name]!r}") from None
