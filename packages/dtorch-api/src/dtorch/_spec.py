"""The client's metadata for one DTensor: mesh, placements and global shape, stride and dtype; and `StridedShard`,
the one client-side placement whose wire form changes the shape (see `Spec.unflattened`)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from dtorch.device_mesh import DeviceMesh
from dtorch_protocol import messages as m
from dtorch_protocol.placement_types import Partial, Placement, Replicate, Shard
from dtorch_protocol.values import dtype_name


@dataclass(frozen=True)
class StridedShard(Placement):
    """torch's `_StridedShard(dim, split_factor)` with split_factor > 1: tensor dim `dim` seen as
    `(split_factor, n // split_factor)` with the second part sharded (torch.chunk style), each device holding its
    chunk of every group. A linear's `[B, S, H] -> [B*S, H]` with the sequence sharded gives it (split_factor B), its
    matmul keeps it and the view back to `[B, S, N]` makes it Shard(1) again: context parallelism stays sharded.
    Client-side only, and only where no other mesh dim shards `dim`: on the wire the tensor is its unflattened
    layout (`Spec.unflattened`), whose boxes hold exactly each device's shard (reshaped)."""

    dim: int
    split_factor: int

    def __repr__(self) -> str:
        return f"StridedShard(dim={self.dim}, split_factor={self.split_factor})"


QUANTIZED_DTYPES = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})
QUANTIZED_HINT = ("DTensors hold unquantized dtypes only (dequantize the tensor first, or quantize the result of "
                  ".full_tensor())")


def check_dtype(what: str, dtype: torch.dtype) -> None:
    """DTensors hold plain dtypes: a quantized one is refused where it would enter (a factory, an upload; an op that
    makes one: the planner), in one line. Uncaught, a worker failed later (`zero_` has no QuantizedCPU kernel), an
    op's meta kernel gave a float32 DTensor for a qint8 shard, and printing one crashed the client."""
    if dtype in QUANTIZED_DTYPES:
        raise NotImplementedError(f"dtorch: {what} asks for quantized dtype {dtype}; {QUANTIZED_HINT}")


def check_dense(what: str, tensor: torch.Tensor) -> None:
    """An upload is a dense strided tensor of a plain dtype (`check_dtype`): anything else, in one line saying how
    to make one."""
    if tensor.is_nested:
        raise NotImplementedError(f"dtorch: {what} got a nested tensor; DTensors hold strided tensors (pad it first: "
                                  "torch.nested.to_padded_tensor)")
    if tensor.layout != torch.strided:
        raise NotImplementedError(f"dtorch: {what} got a {tensor.layout} tensor; DTensors hold strided tensors "
                                  "(convert it first: .to_dense())")
    check_dtype(what, tensor.dtype)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def from_torch_placement(p: object) -> object:
    """torch's placement values, as a program written for `torch.distributed.tensor` imports them, made DTorch's
    (by exact type: torch's `_StridedShard`, a Shard, is not one of them); anything else as it is."""
    if not type(p).__module__.startswith("torch.distributed.tensor"):
        return p
    from torch.distributed.tensor import placement_types as tp

    convert = {tp.Shard: lambda: Shard(p.dim), tp.Replicate: Replicate, tp.Partial: lambda: Partial(p.reduce_op)}
    return convert.get(type(p), lambda: p)()


def normalize_placements(placements: Sequence[Placement] | None, mesh: DeviceMesh, ndim: int,
                         ) -> tuple[Placement, ...]:
    """Check one placement per mesh dim and make Shard dims non-negative; raise a one-line error otherwise."""
    if placements is None:
        return (Replicate(),) * mesh.ndim
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(f"got {len(placements)} placements for a {mesh.ndim}-d mesh: give one per mesh dim, "
                         f"e.g. {[Replicate()] * mesh.ndim}")
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            p = from_torch_placement(p)
        if not isinstance(p, Placement):
            raise TypeError(f"placements must be Shard(dim), Replicate() or Partial(op) (DTorch's or torch's), got "
                            f"{type(p).__module__}.{p!r}")
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{p} is out of range for a tensor with {ndim} dims")
            p = Shard(p.dim % ndim)
        out.append(p)
    return tuple(out)


# Spec keys interned to small ints: the plan cache keys on these (hashing a key tuple of placements per op is
# slow). Ids are never reused; past SID_TABLE_MAX keys the table starts over (older specs keep their ids, which
# then just miss the plan cache), so it stays bounded under ever-changing shapes.
SID_TABLE_MAX = 1 << 18
_sids: dict[tuple, int] = {}
_sid_counter = itertools.count()
_sid_lock = threading.Lock()


def _intern(key: tuple) -> int:
    sid = _sids.get(key)
    if sid is None:
        with _sid_lock:
            if len(_sids) >= SID_TABLE_MAX:
                _sids.clear()
            sid = _sids.setdefault(key, next(_sid_counter))
    return sid


@dataclass(frozen=True, eq=False)
class Spec:
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    key: tuple = field(init=False, repr=False)  # hashable identity
    sid: int = field(init=False, repr=False)  # the key interned: equal sids, equal keys (plan-cache keys)
    contiguous: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # the mesh's dim names too: a cached plan must not give outputs a same-device mesh under other names
        key = (self.mesh.id, self.mesh.mesh_dim_names, self.placements, self.shape, self.stride, self.dtype)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "sid", _intern(key))
        object.__setattr__(self, "contiguous", self.stride == contiguous_stride(self.shape))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def with_placements(self, placements: tuple[Placement, ...], mesh: DeviceMesh | None = None) -> Spec:
        return Spec(mesh or self.mesh, placements, self.shape, self.stride, self.dtype)

    def unflattened(self) -> Spec:
        """This spec, or where a placement is a `StridedShard(d, f)`, the same shards in a layout the controller and
        the workers know: dim d split into (f, n // f), the second part sharded, later tensor dims one further
        (each device's shard reshaped to its box there, no data moved)."""
        found = [(i, p) for i, p in enumerate(self.placements) if isinstance(p, StridedShard)]
        if not found:
            return self
        _, strided = found[0]
        d, f = strided.dim, strided.split_factor
        shape = (*self.shape[:d], f, self.shape[d] // f, *self.shape[d + 1:])
        placements = tuple(Shard(d + 1) if isinstance(p, StridedShard) else
                           Shard(p.dim + 1) if isinstance(p, Shard) and p.dim > d else p for p in self.placements)
        return Spec(self.mesh, placements, shape, contiguous_stride(shape), self.dtype)

    def to_wire(self) -> m.TensorSpec:
        if any(isinstance(p, StridedShard) for p in self.placements):
            return self.unflattened().to_wire()
        return m.TensorSpec(shape=list(self.shape), dtype=dtype_name(self.dtype), mesh=self.mesh.id,
                            placements=[p.to_wire() for p in self.placements])

    @cached_property
    def wire(self) -> m.TensorSpec:
        return self.to_wire()

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def sharded_instead(self, kind: type[Placement]) -> tuple[Placement, ...]:
        """These placements with each mesh dim placed as `kind` (Replicate or Partial) sharding a tensor dim that
        no other mesh dim shards (the largest with a row for each of that dim's devices), or Replicate where none
        is left: the same values, 1/n of them on each device. Data-plane transfers go through this layout, where
        one copy of the tensor passes the client's link instead of n (a replicated upload, a Partial read)."""
        placements = list(self.placements)
        for k, p in enumerate(placements):
            if isinstance(p, kind):
                taken = {q.dim for q in placements if isinstance(q, (Shard, StridedShard))}
                free = [d for d in range(len(self.shape)) if d not in taken and self.shape[d] >= self.mesh.shape[k]]
                placements[k] = Shard(max(free, key=lambda d: (self.shape[d], -d))) if free else Replicate()
        return tuple(placements)
