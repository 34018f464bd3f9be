"""The user's source line for an op, so an error raised later can point at the code that issued it."""

from __future__ import annotations

import os
import sys

import torch

_SKIP = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep,
         "<frozen ")


def user_src(depth: int = 2) -> str:
    """`"path/to/file.py:12"` of the nearest frame outside dtorch and torch (a few hundred ns)."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_SKIP):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else ""
