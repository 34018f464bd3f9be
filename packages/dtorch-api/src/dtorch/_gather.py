"""`gather`: an index smaller than the input on another dim; an input sharded along the gathered dim.

`input.gather(dim, index)` reads `input[i][index[i][j]]` (dim 1): on every other dim `d`, index row `i` pairs with
input row `i`, and `index.size(d)` may be smaller than `input.size(d)` (the rows beyond are not read). torch's
DTensor rule shards input and index alike on such a dim, which pairs the shards' rows only when both have as many:
`x.gather(1, idx)` of a [10, 5] input and a [5, 5] index, sharded on dim 0, gave wrong values, and so did
`scatter_add`'s gradient, which is this gather. And along a sharded dim (the log-probabilities of the labels from
vocabulary-parallel logits, `logp.gather(-1, labels[..., None])`, as every RL and DPO loss reads them) torch's rule
gathered the whole input, tokens x vocabulary, on every device.

Rules (decompositions, `_registry.register_decomposition`; each declines, NotImplemented, outside its case):
  1. Where a dim the index is shorter on is sharded in the input or the index, the input is first narrowed to the
     index's size on it (`input.narrow(d, 0, index.size(d))`, which is what gather reads; its gradient pads with
     zeros), and then gathered.
  2. `gather` along a dim the input is sharded on (every device holding some, nothing Partial, a dtype of
     `_local.REDUCIBLE`), the index as large as the input on every other dim: the index is replicated on the mesh dims
     sharding that dim and laid out as the input elsewhere; each device reads the indices in its rows (shifted into
     them, `_local.own_rows`; zero elsewhere) and the output is Partial("sum") there: one reduction of the output,
     none of the input. An index outside the dim fails the op, as torch's kernel does (`_local.check_indices`),
     instead of reading zeros; so does rule 3's, instead of adding nothing.
  3. `scatter_add` into a tensor sharded along the scattered dim, index and source as large as it on every other
     dim: index and source are replicated on the mesh dims sharding that dim (laid out as the tensor elsewhere), and
     each device adds the sources whose indices fall in its rows (`own_rows`, the others zero) into its own part; the
     result is laid out as the tensor. torch's rule gathered the tensor. This is rule 2's gradient.
  4. Rule 2's gradient starts from zeros the input's size (`gather_backward`: `grad.new_zeros(input.shape)`, then
     rule 3), which torch's rule makes replicated: tokens x vocabulary on every device, twice the whole logits at
     the backward's peak. A `new_zeros` in a backward pass with the shape, dtype and mesh of an input rule 2 read
     (`GATHERED`, the most recent MAX_GATHERED) is made laid out as that input, each device allocating its part.
     Zeros are zeros whatever their layout, so a look-alike `new_zeros` only gets another layout.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import (
    REDUCIBLE,
    boxes,
    check_indices,
    emit,
    is_dtensor,
    on_dims,
    only_mine,
    own_rows,
    rows,
    sharded_dim,
    sharding,
    spec,
    to,
)
from dtorch._registry import named_args, register_decomposition
from dtorch._sharding import in_backward
from dtorch_protocol.layout import box_shape
from dtorch_protocol.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
MAX_GATHERED = 64
# (mesh id, shape, dtype) of an input rule 2 gathered along its shards -> its placements, oldest first (rule 4)
GATHERED: dict[tuple[int, tuple[int, ...], torch.dtype], tuple[Placement, ...]] = {}


def _sharded_dims(t: Any) -> set[int]:
    return {p.dim for p in t.placements if isinstance(p, Shard)} if is_dtensor(t) else set()


@register_decomposition(aten.gather.default)
def gather(args: tuple, kwargs: dict) -> Any:  # rule 1
    values = dict(zip(("self", "dim", "index", "sparse_grad"), args), **kwargs)
    x, index = values["self"], values["index"]
    sharded = _sharded_dims(x) | _sharded_dims(index)
    if not sharded:  # the common case, answered first
        return NotImplemented
    dim = values["dim"] % max(x.dim(), 1)
    shorter = [d for d in range(index.dim()) if d != dim and index.shape[d] < x.shape[d]]
    if not any(d in sharded for d in shorter):
        return NotImplemented
    for d in shorter:
        x = aten.narrow.default(x, d, 0, index.shape[d])
    return aten.gather.default(x, values["dim"], index, sparse_grad=values.get("sparse_grad", False))


@register_decomposition(aten.gather.default)
def gather_along_shards(args: tuple, kwargs: dict) -> Any:  # rule 2
    values = dict(zip(("self", "dim", "index", "sparse_grad"), args), **kwargs)
    x, index = values["self"], values["index"]
    split = _split(x, values["dim"], index)
    if split is None or values.get("sparse_grad"):
        return NotImplemented
    dim, spread, rows = split
    index = to(index, on_dims(x.placements, spread, Replicate()))
    check_indices(index, x.shape[dim], _out_of_bounds("gather", dim, x.shape[dim]))
    mine, safe = own_rows(index, rows)
    out = spec(x.device_mesh, on_dims(x.placements, spread, Partial()), tuple(index.shape), x.dtype)
    key = (x.device_mesh.id, tuple(x.shape), x.dtype)
    GATHERED.pop(key, None)
    GATHERED[key] = x.placements  # (its gradient's zeros: rule 4)
    while len(GATHERED) > MAX_GATHERED:
        del GATHERED[next(iter(GATHERED))]
    return only_mine(mine, emit(aten.gather.default, (x, dim, safe), out), out)


@register_decomposition(aten.scatter_add.default)
def scatter_add_along_shards(args: tuple, kwargs: dict) -> Any:  # rule 3
    values = named_args(aten.scatter_add.default, args, kwargs)
    x, index, src = values["self"], values["index"], values["src"]
    split = _split(x, values["dim"], index)
    if split is None or not is_dtensor(src) or src.device_mesh != x.device_mesh or tuple(src.shape) != \
            tuple(index.shape) or src.dtype != x.dtype:
        return NotImplemented
    dim, spread, rows = split
    beside = on_dims(x.placements, spread, Replicate())
    index = to(index, beside)
    check_indices(index, x.shape[dim], _out_of_bounds("scatter_add", dim, x.shape[dim]))
    mine, safe = own_rows(index, rows)
    src = to(src, beside)
    return emit(aten.scatter_add.default, (x, dim, safe, only_mine(mine, src, src._spec)), x._spec)


@register_decomposition(aten.new_zeros.default)
def gradient_zeros(args: tuple, kwargs: dict) -> Any:  # rule 4
    if not GATHERED or in_backward() is None:  # (every new_zeros asks: the common answer first)
        return NotImplemented
    values = named_args(aten.new_zeros.default, args, kwargs)
    ref, size = values["self"], values["size"]
    if not is_dtensor(ref) or values["layout"] not in (None, torch.strided):
        return NotImplemented
    dtype = values["dtype"] or ref.dtype
    placements = GATHERED.get((ref.device_mesh.id, tuple(size), dtype))
    if placements is None:
        return NotImplemented
    mesh = ref.device_mesh
    parts = [list(box_shape(box)) for box in boxes(mesh, placements, size)]
    return emit(aten.new_zeros.default, (ref, list(size)), spec(mesh, placements, tuple(size), dtype),
                per_device=[(ref, part) for part in parts], kwargs={"dtype": dtype})


def _out_of_bounds(op: str, dim: int, size: int) -> str:
    return (f"an index of {op} is out of bounds for dimension {dim} with size {size}, expected each in "
            f"[0, {size})")


def _split(x: Any, dim: Any, index: Any) -> tuple[int, list[int], list[tuple[int, int]]] | None:
    """(dim, the mesh dims sharding it, each device's rows of it) where rule 2 applies, else None."""
    if not (is_dtensor(x) and is_dtensor(index) and type(dim) is int and x.ndim and x.device_mesh == index.device_mesh
            and sharded_dim(x, dim=dim)) or index.ndim != x.ndim or index._spec.has_partial() or \
            x._spec.unflattened() is not x._spec or x.dtype not in REDUCIBLE:
        return None
    dim %= x.ndim
    if any(index.shape[d] != x.shape[d] for d in range(x.ndim) if d != dim):
        return None
    return dim, sharding(x, dim), rows(x, dim)

