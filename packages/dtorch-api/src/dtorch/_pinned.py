"""Pinned memory: a DTensor counts as pinned.

torch pins a host tensor's pages so that its copies to an accelerator can run asynchronously. A DTensor's shards live
on the workers, never in the client's memory, so there is nothing to pin (on CPU workers pinning is a no-op anyway).
Rules (decompositions, `_registry.register_decomposition`; each declines, NotImplemented, for a plain tensor):

1. `is_pinned()` answers True for a DTensor on CPU devices, from no values (as the sync route's op it fetched the
   whole tensor to answer False); on accelerator devices False, as torch answers for a device tensor.
2. `pin_memory()` (torch's composite: `self if self.is_pinned() else _pin_memory(self)`) therefore returns the
   DTensor itself, as torch returns a tensor already pinned; a ported DataLoader-style `batch.pin_memory()` runs.
3. `_pin_memory`, called directly, returns a copy (the same values and layout), as torch's always copies. It was
   refused with torch's "NYI". On accelerator devices it is refused in one line, as torch refuses to pin a device
   tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import is_dtensor
from dtorch._registry import register_decomposition

aten = torch.ops.aten


@register_decomposition(aten.is_pinned.default)
def is_pinned(args: tuple, kwargs: dict) -> Any:
    return args[0].device.type == "cpu" if is_dtensor(args[0]) else NotImplemented


@register_decomposition(aten._pin_memory.default)
def pin_memory(args: tuple, kwargs: dict) -> Any:
    if not is_dtensor(args[0]):
        return NotImplemented
    if args[0].device.type != "cpu":
        raise RuntimeError(f"cannot pin a DTensor on {args[0].device.type} devices: only CPU tensors can be pinned")
    return args[0].clone()
