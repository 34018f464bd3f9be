"""`fully_shard`'s reshard after forward: autograd keeps no gathered parameter, and backward gathers it again.

A fully sharded submodule's forward gathers its parameters, and the ops that use them save them (or a view of them)
for backward. Saved as they are, every layer's gathered parameters stayed on the workers from its forward to its
backward: a training step held the whole model on every worker, as data parallelism does. torch's FSDP2 frees the
gathered parameters after the forward and gathers them again for the backward (`reshard_after_forward=True`, its
default); DTorch does it with autograd's saved-tensor hooks, in force for the submodule's forward:

Rules:
  1. A saved tensor that is a gathered parameter, its transpose (a linear's weight), or any view of one gathered
     on every mesh dim (replicated: the view's global strides are each device's) is saved as a recipe: the sharded
     parameter, the gather that made it (`_buckets.GatherAgain`: its placements, dtype and bucket), and the view.
  2. Backward unpacks a recipe by gathering the parameter again, with the rest of its gather (`_buckets` rule 5);
     recipes unpacked while that copy is alive share it.
  3. Any other tensor is saved as autograd saves it.
  4. The hooks are installed only while grad is enabled and no other saved-tensor hooks are in force: activation
     checkpointing's own hooks save nothing of the forward (its recomputation gathers again by itself), and hooks
     of the user's keep their meaning.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from dtorch.dtensor import DTensor
from dtorch.nn._buckets import GatherAgain

# id(gathered tensor) -> (the gathered tensor, its sharded parameter, the gather that made it), while a forward holds it
_live: dict[int, tuple[weakref.ref, nn.Parameter, GatherAgain]] = {}


@dataclass(frozen=True)
class _Recipe:
    param: nn.Parameter
    again: GatherAgain
    view: tuple | str | None  # None: the gathered tensor; "t": its transpose; (size, stride, offset): as_strided


def track(gathered: DTensor, param: nn.Parameter, again: GatherAgain) -> None:
    _live[id(gathered)] = (weakref.ref(gathered), param, again)


def untrack(gathered: DTensor) -> None:
    _live.pop(id(gathered), None)


def _made(t: Any) -> tuple[nn.Parameter, GatherAgain] | None:
    entry = _live.get(id(t)) if t is not None else None
    return entry[1:] if entry is not None and entry[0]() is t else None


def _pack(t: Any) -> Any:
    if type(t) is not DTensor:
        return t
    made = _made(t)
    if made is not None:
        return _Recipe(*made, None)
    base = t._base
    made = _made(base)
    if made is None:  # rule 3
        return t
    if t.ndim == base.ndim == 2 and t.shape == base.shape[::-1] and t.stride() == base.stride()[::-1] \
            and t.storage_offset() == base.storage_offset():
        return _Recipe(*made, "t")
    if all(p.is_replicate() for p in base.placements):
        return _Recipe(*made, (tuple(t.shape), t.stride(), t.storage_offset()))
    return t


def _unpack(saved: Any) -> Any:
    if type(saved) is not _Recipe:
        return saved
    whole = saved.again.whole(saved.param)
    if saved.view is None:
        return whole
    return whole.t() if saved.view == "t" else whole.as_strided(*saved.view)


def install() -> Any:
    """The hooks for one forward, entered (rule 4), or None; the caller exits them when the forward ends."""
    if not torch.is_grad_enabled():
        return None
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)  # (pack, unpack) in force, or None
    if top is not None and top[0] is not _pack:
        return None
    hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
    hooks.__enter__()
    return hooks
