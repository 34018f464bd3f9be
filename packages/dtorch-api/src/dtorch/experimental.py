"""torch's experimental DTensor surface (`torch.distributed.tensor.experimental`), for programs ported from it.

`context_parallel(mesh, buffers=, buffer_seq_dims=, no_restore_buffers=)`: torch shards each rank's buffers along
their sequence dim in place and swaps attention for ring attention. DTorch programs are global, so only the
DTensor buffers change: each is laid out anew in place, its sequence dim sharded over the context-parallel mesh
dim (`DTensor.data`: the same object, its shards moved), and the attention of a sequence-sharded query keeps the
queries sharded and gathers keys and values (`_sequences`). On leaving, every buffer not in `no_restore_buffers` is
laid out as it was. A plain tensor buffer stays as it is: a DTorch program indexes a rotary table or a mask globally,
so it needs no sharding (torch's ranks do, since each sees only its sequence chunk); if no buffer is a DTensor, the
block warns that nothing in it is sequence-parallel. Values are those of one device, up to float rounding.

`implicit_replication()`: DTorch always treats a plain tensor that meets a DTensor as replicated (the client holds
it whole), so the block changes nothing.

`local_map` and `register_sharding` raise, saying why: a DTorch program runs once on global tensors (no rank runs a
function on its shards), and DTorch's sharding rules are its own (`dtorch._registry`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from dtorch._source import stacklevel
from dtorch.device_mesh import DeviceMesh, on_root
from dtorch.dtensor import DTensor
from dtorch_protocol.placement_types import Placement, Shard


def _mesh_dim(buffer: DTensor, mesh: DeviceMesh, index: int) -> int:
    """The mesh dim of `buffer`'s mesh that `mesh` (the 1-D context-parallel mesh: its own, or a named slice) is."""
    root, (dim,) = on_root(mesh, 0)
    if mesh.ndim != 1 or buffer.device_mesh != root:
        raise ValueError(f"context_parallel: buffer {index} lives on {buffer.device_mesh!r}, which neither is the 1-D "
                         f"mesh {mesh!r} nor has it as a named dim; give the buffer's mesh or a slice: mesh[\"cp\"]")
    return dim


def _sharded(buffer: DTensor, mesh: DeviceMesh, seq_dim: int, index: int) -> tuple[Placement, ...]:
    if not -buffer.dim() <= seq_dim < buffer.dim():
        raise ValueError(f"context_parallel: buffer_seq_dims[{index}] is {seq_dim}, but buffer {index} has "
                         f"{buffer.dim()} dims")
    dim, mesh_dim = seq_dim % buffer.dim(), _mesh_dim(buffer, mesh, index)
    taken = [i for i, p in enumerate(buffer.placements) if i != mesh_dim and p.is_shard(dim)]
    if taken:
        raise ValueError(f"context_parallel: buffer {index}'s sequence dim {dim} is already sharded on mesh dim "
                         f"{taken[0]} ({buffer.placements})")
    return tuple(Shard(dim) if i == mesh_dim else p for i, p in enumerate(buffer.placements))


class context_parallel:  # noqa: N801 (torch's name, a context manager)
    """Shard the DTensor `buffers` along `buffer_seq_dims` over `mesh` for the block (see the module docstring)."""

    def __init__(self, mesh: DeviceMesh, *, buffers: Sequence[torch.Tensor] | None = None,
                 buffer_seq_dims: Sequence[int] | None = None,
                 no_restore_buffers: set[torch.Tensor] | None = None) -> None:
        buffers, seq_dims = list(buffers or ()), list(buffer_seq_dims or ())
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"context_parallel: mesh must be a dtorch.DeviceMesh, got {type(mesh).__name__}")
        if len(buffers) != len(seq_dims):
            raise ValueError(f"context_parallel: {len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims; give "
                             "one sequence dim per buffer")
        self.plain = bool(buffers) and not any(isinstance(b, DTensor) for b in buffers)
        self.moves = [(b, b.placements, _sharded(b, mesh, d, i)) for i, (b, d) in enumerate(zip(buffers, seq_dims))
                      if isinstance(b, DTensor)]
        self.keep = {id(b) for b in no_restore_buffers or ()}

    def __enter__(self) -> None:
        if self.plain:
            warnings.warn("context_parallel: no buffer is a DTensor, so nothing in this block is sequence-parallel; "
                          "DTorch shards DTensors (distribute_tensor(x, mesh, [Replicate()]) before the block)",
                          stacklevel=stacklevel())
        for b, _, sharded in self.moves:
            b.data = b.redistribute(b.device_mesh, sharded)

    def __exit__(self, *exc: object) -> None:
        for b, original, _ in self.moves:
            if id(b) not in self.keep:
                b.data = b.redistribute(b.device_mesh, original)


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """torch's `implicit_replication()`: with DTorch a plain tensor mixed with DTensors is always replicated."""
    yield


def local_map(*args: Any, **kwargs: Any) -> Any:
    """torch's `local_map` runs a function on each rank's local shards; refused with the reason."""
    raise NotImplementedError("dtorch.experimental.local_map: a DTorch program runs once, on global tensors, and the "
                              "client holds no shard; call the function on the DTensors (their ops are sharded as "
                              "their layouts say), redistributing them first where it needs another layout")


def register_sharding(*args: Any, **kwargs: Any) -> Any:
    """torch's `register_sharding` adds an op's sharding strategies; refused with the reason."""
    raise NotImplementedError("dtorch.experimental.register_sharding: DTorch's sharding rules are its own "
                              "(dtorch._registry, read before torch's); an op with no rule runs correctly on "
                              "gathered inputs")


__all__ = ["context_parallel", "implicit_replication", "local_map", "register_sharding"]
