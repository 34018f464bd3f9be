"""Random ops on sharded tensors (issue #12 item 4): drawn shard by shard, never on a replicated copy.

`dropout` (CPU: `bernoulli_`, fused devices: `native_dropout`), `uniform_` and `normal_` (`nn.init`) are
decompositions (`_registry.register_decomposition`): a random factory laid out like the tensor (the workers draw
only the blocks of their shards, `dtorch_worker.random_blocks`, seeded by a draw from torch's generator), then
elementwise ops on the same layout. Values depend on the seed and the global shape only, never on the mesh or the
placements; each device draws and moves nothing but its shard.

Rules:
  1. The tensor's layout is kept: no Partial (its shards are not values), a floating point dtype and no explicit
     `generator=`; anything else declines (NotImplemented) and takes the replicate route under a shared seed.
  2. `bernoulli_(p)` is `self.copy_(rand < p)`; `uniform_(a, b)` is `self.copy_(rand * (b - a) + a)`;
     `normal_(mean, std)` is `self.copy_(randn * std + mean)`; `native_dropout(x, p, train=True)` is
     `(x * mask * 1/(1 - p), mask)` with `mask = rand < 1 - p` (0 for p = 1). Draws are float64 for float64
     tensors, float32 otherwise.
  3. The arguments are torch's to check: the op first runs on an empty tensor of the dtype here, so a bad one
     (`uniform_(3, -1)`, `normal_(std=-1)`, `bernoulli_(2.0)`) raises torch's own error at once, as in torch (the
     decompositions drew values from it: a range upside down, a mean minus a negative spread, all ones).
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import is_dtensor, spec
from dtorch._registry import register_decomposition
from dtorch._source import user_src
from dtorch_protocol import messages as m
from dtorch_protocol.placement_types import Partial

aten = torch.ops.aten


def _layout_kept(t: Any, kwargs: dict) -> bool:
    """Rule 1."""
    return (is_dtensor(t) and t.dtype.is_floating_point and kwargs.get("generator") is None
            and not any(isinstance(p, Partial) for p in t.placements))


def _checked(op: Any, args: tuple, kwargs: dict) -> None:
    """Rule 3: torch's checks of the arguments, on an empty tensor (no values drawn)."""
    op(torch.empty(0, dtype=args[0].dtype), *args[1:], **kwargs)


def _draw(like: Any, init: str) -> Any:
    """A random factory laid out like `like` (rule 2's draws)."""
    session = like._session
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    s = spec(like.device_mesh, tuple(like.placements), tuple(like.shape), dtype)
    tid = session.new_tid()
    session.emit(m.InstrCreate(tid=tid, spec=s.wire, init=init, seed=session.next_seed(), src=user_src(4)))
    return type(like)(s, tid, session)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


@register_decomposition(aten.bernoulli_.float)
def bernoulli_(args: tuple, kwargs: dict) -> Any:
    self = args[0]
    if not _layout_kept(self, kwargs):
        return NotImplemented
    _checked(aten.bernoulli_.float, args, kwargs)
    p = _arg(args, kwargs, 1, "p", 0.5)
    return aten.copy_.default(self, aten.lt.Scalar(_draw(self, "rand"), p))


@register_decomposition(aten.uniform_.default)
def uniform_(args: tuple, kwargs: dict) -> Any:
    self = args[0]
    if not _layout_kept(self, kwargs):
        return NotImplemented
    _checked(aten.uniform_.default, args, kwargs)
    low, high = _arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0)
    r = aten.add.Scalar(aten.mul.Scalar(_draw(self, "rand"), high - low), low)
    return aten.copy_.default(self, r)


@register_decomposition(aten.normal_.default)
def normal_(args: tuple, kwargs: dict) -> Any:
    self = args[0]
    if not _layout_kept(self, kwargs):
        return NotImplemented
    _checked(aten.normal_.default, args, kwargs)
    mean, std = _arg(args, kwargs, 1, "mean", 0.0), _arg(args, kwargs, 2, "std", 1.0)
    r = aten.add.Scalar(aten.mul.Scalar(_draw(self, "randn"), std), mean)
    return aten.copy_.default(self, r)


@register_decomposition(aten.native_dropout.default)
def native_dropout(args: tuple, kwargs: dict) -> Any:
    x = args[0]
    p, train = _arg(args, kwargs, 1, "p", 0.5), _arg(args, kwargs, 2, "train", None)
    if not train or not _layout_kept(x, kwargs):  # (its p is checked by F.dropout, as for torch's kernel)
        return NotImplemented
    mask = aten.lt.Scalar(_draw(x, "rand"), 1.0 - p)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return aten.mul.Scalar(aten.mul.Tensor(x, mask), scale), mask
