"""The user's source line for an op, so an error raised later can point at the code that issued it."""

from __future__ import annotations

import os
import sys

import torch

# frames of these files are not the user's
SKIP = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep,
         "<frozen ")


def caller(depth: int = 1) -> tuple[str, int]:
    """(file, line) of the nearest frame outside dtorch and torch, `depth` frames above the caller's."""
    f = sys._getframe(depth + 1)
    while f is not None and f.f_code.co_filename.startswith(SKIP):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno) if f is not None else ("", 0)


def src_text(filename: str, lineno: int) -> str:
    """The wire form of a source line (made on the sender thread, off the user's)."""
    return f"{filename}:{lineno}" if filename else ""


def user_src(depth: int = 2) -> str:
    """`"path/to/file.py:12"` of the nearest frame outside dtorch and torch (a few hundred ns)."""
    return src_text(*caller(depth))
