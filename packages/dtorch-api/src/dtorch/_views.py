"""Views of moved copies: writes through them reach their base, and writes to their base reach them.

A view op (`x[1]`, `x[:, 2]`, `x.view(-1)[::5]`, `x.diagonal()`, `x.split(2)`) aliases its input. When the input has
to move first (a row of a row-sharded tensor is read from a replicated copy), the view aliases that moved copy on the
workers, not the input: a write through the view (`x[1] = 5`, which is `x.select(0, 1).fill_(5)`) stayed in the
copy, and later writes to the input did not show in the view (torch 2.13's DTensor loses `x[1].mul_(0)` too).
DTorch keeps torch's aliasing with an `Origin` per such move: the input and its moved copy, which the views keep
alive. The copy is of the whole input, or of the region a view names (`_slices`: `x[3]` moves that row alone).

Rules (`after_view` and `after_write`, called by `_dispatch` inside the op's dispatch, so that their copies are
not the user's: autograd does not see them and no version counter moves):
  1. A view op whose input moved gives outputs with the origin (that input, its moved copy).
  2. A view of a tensor with an origin that needs no move shares the origin (it aliases the same moved copy).
  3. After an op writes a tensor with an origin, the moved copy is copied back into the origin's input (a region's
     copy into that region, each device writing its part: `_regions`). The copy is itself a write to that input,
     so a chain of moved views unwinds, one origin at a time, to the tensor that owns the storage.
  4. After an op writes a tensor without an origin, the moved copies of the live origins whose input shares its
     autograd base (`t._base`, the storage's owner) are refreshed from their inputs, oldest first (a view of a view
     after the view). Origins taking part in the write being carried out are skipped.
Nothing here runs while no origin is alive (`by_root` is empty), which is the common case.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from dtorch import _regions
from dtorch._regions import Region

_copy = torch.ops.aten.copy_.default

# id of the autograd base of an origin's input -> its live origins, oldest first (weak: the views keep them alive)
by_root: dict[int, list[weakref.ref]] = {}
copying: Origin | None = None  # the origin whose copy (rule 3 or 4) is being issued


def _root(t: Any) -> int:
    base = t._base
    return id(t if base is None else base)


class Origin:
    """The input a view was taken of and its moved copy, which the view aliases on the workers: the whole input, or
    only a region of it (`_slices`: `region` says which, and the copy has the region's shape)."""

    __slots__ = ("base", "moved", "region", "busy", "__weakref__")

    def __init__(self, base: Any, moved: Any, region: Region | None = None) -> None:
        self.base, self.moved, self.region, self.busy = base, moved, region, False
        key = _root(base)

        def forget(ref: weakref.ref) -> None:
            refs = by_root.get(key)
            if refs is not None and ref in refs:
                refs.remove(ref)
                if not refs:
                    del by_root[key]

        by_root.setdefault(key, []).append(weakref.ref(self, forget))

    def put_back(self) -> None:
        """Rule 3: the moved copy into the input (its region alone, each device writing its part)."""
        if self.region is None:
            self._copying(_copy, self.base, self.moved)
        else:
            self._copying(_regions.write, self.base, self.region, self.moved)
            self._copying(after_write, self.base)  # (emitted, not dispatched: rule 4 for the input's other views)

    def refresh(self) -> None:
        """Rule 4: the input into the moved copy."""
        if self.region is None:
            self._copying(_copy, self.moved, self.base)
        else:
            self._copying(_copy, self.moved, _regions.read(self.base, self.region))

    def _copying(self, fn: Any, *args: Any) -> None:
        global copying
        self.busy, outer, copying = True, copying, self
        try:
            fn(*args)
        finally:
            self.busy, copying = False, outer


def after_view(source: Any, moved: Any, results: list) -> None:
    """Rules 1 and 2: `results` are views of `source`; `moved` is the copy of `source` they alias, or None."""
    origin = Origin(source, moved) if moved is not None else getattr(source, "_origin", None)
    if origin is not None:
        for r in results:
            if r is not None:
                r._origin = origin


def after_write(t: Any) -> None:
    """Rules 3 and 4, after an op wrote `t`."""
    origin = getattr(t, "_origin", None)
    if origin is not None:
        if not origin.busy:
            origin.put_back()  # rule 3
        return
    refs = by_root.get(_root(t))
    for ref in list(refs or ()):
        o = ref()
        if o is not None and not o.busy:
            o.refresh()  # rule 4
