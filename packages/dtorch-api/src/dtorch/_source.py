"""The user's source line for an op, so an error raised later can point at the code that issued it.

The user thread takes only where the frame is, `(code object, f_lasti)`: a frame's line number is worked out
from its instruction offset on every read of `f_lineno`, and is worked out here instead, by `src_text` on the
sender thread, once per place in the code (`_LINES`, bounded).
"""

from __future__ import annotations

import os
import sys
from types import CodeType

import torch

# frames of these files are not the user's
SKIP = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep,
         "<frozen ")


def caller(depth: int = 1) -> tuple[CodeType | None, int]:
    """(code, instruction offset) of the nearest frame outside dtorch and torch, `depth` frames above the
    caller's; `src_text` makes it a line."""
    f = sys._getframe(depth + 1)
    while f is not None and f.f_code.co_filename.startswith(SKIP):
        f = f.f_back
    return (f.f_code, f.f_lasti) if f is not None else (None, 0)


def stacklevel() -> int:
    """The `stacklevel` that makes a `warnings.warn` of the caller point at the nearest frame outside dtorch and
    torch (the user's line), however deep in dtorch the warning is given."""
    f, level = sys._getframe(1), 1
    while f.f_back is not None and f.f_code.co_filename.startswith(SKIP):
        f, level = f.f_back, level + 1
    return level


_LINES: dict[tuple[int, int], tuple[CodeType, str]] = {}  # (id(code), offset) -> (code, "file:line")
_LINES_MAX = 1 << 14


def src_text(code: CodeType | None, lasti: int) -> str:
    """The wire form, `"path/to/file.py:12"`, of a place in the code (made on the sender thread, off the user's)."""
    if code is None:
        return ""
    hit = _LINES.get((id(code), lasti))
    if hit is not None and hit[0] is code:  # the entry holds its code: an id is not reused while it is there
        return hit[1]
    line = next((n for start, end, n in code.co_lines() if start <= lasti < end), None)
    text = f"{code.co_filename}:{line or code.co_firstlineno}"
    if len(_LINES) >= _LINES_MAX:
        _LINES.clear()
    _LINES[(id(code), lasti)] = (code, text)
    return text


def user_src(depth: int = 2) -> str:
    """`"path/to/file.py:12"` of the nearest frame outside dtorch and torch (a few hundred ns)."""
    return src_text(*caller(depth))
