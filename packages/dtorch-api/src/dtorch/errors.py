"""Exceptions a DTorch user sees. Each message is one line naming what went wrong."""

from __future__ import annotations

import linecache


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
