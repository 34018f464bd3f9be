"""Wire templates: an instruction encoded once with holes, filled per op with a few small values.

A plan's `InstrCall` differs between two runs of the same op only in its tensor ids and the user's source
line, so it is encoded once (msgspec, as `wire.encode` does) with sentinels in those places and cut there.
Filling it joins the constant pieces with the msgpack encoding of each value: a fraction of what building
the message and encoding it again costs (a figure in `benchmarks/bench_vs_torch.py` (a)). The result is a
`msgspec.Raw`, which `wire.encode` writes into a `Submit` as it is; the controller decodes and validates it
like any other instruction.

A template is data: the pieces and the order of the holes. Step capture (replaying a recorded sequence of
instructions by program id) can keep the same templates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

_encode = msgspec.msgpack.encode
_MAGIC = 0x7FD7_0C7A_5E00_0000  # sentinel ints: uint64 encodings (0xcf + 8 bytes) that no real value has
SRC_HOLE = "\x00dtorch-src-hole\x00"  # the sentinel of a string hole (the user's source line)


def sentinel(hole: int) -> int:
    """The sentinel of int hole number `hole` (a tensor id)."""
    return _MAGIC | hole


class Template:
    """Encoded bytes of a message cut at its holes; `fill(values)` with one value per hole, in hole order."""

    __slots__ = ("pieces", "order")

    def __init__(self, pieces: list[bytes], order: list[int]) -> None:
        self.pieces, self.order = pieces, order

    @classmethod
    def of(cls, message: Any, holes: Sequence[Any]) -> Template | None:
        """Cut `message`'s encoding at each of `holes` (sentinel ints from `sentinel(i)`, or SRC_HOLE), each of
        which must occur exactly once; None when that cannot be arranged."""
        data = _encode(message)
        marks = []
        for index, hole in enumerate(holes):
            mark = _encode(hole)
            at = data.find(mark)
            if at < 0 or data.find(mark, at + 1) >= 0:
                return None
            marks.append((at, len(mark), index))
        marks.sort()
        pieces, order, start = [], [], 0
        for at, length, index in marks:
            pieces.append(data[start:at])
            order.append(index)
            start = at + length
        pieces.append(data[start:])
        return cls(pieces, order)

    def fill(self, values: Sequence[Any]) -> msgspec.Raw:
        pieces = self.pieces
        out = [pieces[0]]
        for k, index in enumerate(self.order, 1):
            out.append(_encode(values[index]))
            out.append(pieces[k])
        return msgspec.Raw(b"".join(out))
