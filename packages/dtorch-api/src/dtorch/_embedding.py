"""Embedding lookups and gradients on sharded tables and indices.

Rules (decompositions, `_registry.register_decomposition`; each declines, NotImplemented, outside its case):
  1. Vocabulary-parallel lookup (`embedding` of a table whose rows, the vocabulary, are sharded on one mesh dim,
     `RowwiseParallel` on an `nn.Embedding`, with indices replicated on that dim): torch's rule answers with a
     private placement, so the whole table was gathered on every device at every forward. As Megatron's
     vocabulary-parallel embedding does, each device looks up the indices that fall in its rows (the others read
     row 0 and are zeroed with `where`, so that an inf or NaN in that row cannot leak, as it did through a product)
     and the output is Partial("sum") on that mesh dim: one reduction of the activations, none of the table. The
     indices shifted into a device's rows differ per device (per-device arguments), and live only inside the rule.
     An index outside the table fails the op as torch's lookup does (`_local.check_indices`), instead of reading
     zeros.
  2. A gradient scaled by frequency (`nn.Embedding(scale_grad_by_freq=True)`) on sharded indices:
     `embedding_dense_backward(..., scale_grad_by_freq=True)` divides each row's gradient by how often its index
     occurs in the batch; with the batch sharded, each device counted its own shard, wrong wherever an index occurs
     on more than one device. The unscaled backward is divided by the counts of the whole batch, which are the same
     backward of ones (`[..., 1]`): a row's sum of its occurrences, at least 1 (a row no index names has no
     gradient to scale).
  3. The table's gradient of a vocabulary-parallel lookup (rule 1 marks its indices, which autograd saves): torch's
     rule computed the whole [rows, dim] gradient on every device, then each kept its rows (a whole table's worth
     of memory and work per device at every backward). Each device now computes its own rows (the indices shifted
     as in rule 1, the others' gradients zeroed): the gradient comes out as the table is laid out on that mesh dim;
     on the others, Partial where the batch was sharded (a replicated gradient is sliced as the indices are) or the
     gradient Partial, sharded on the table's columns where the gradient's last dim was, Replicate where all was.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import boxes, check_indices, emit, is_dtensor, only_mine, own_rows, rows, spec, to
from dtorch._registry import named_args, register_decomposition
from dtorch_protocol.placement_types import Partial, Placement, Replicate, Shard

aten = torch.ops.aten


@register_decomposition(aten.embedding.default)
def vocabulary_parallel(args: tuple, kwargs: dict) -> Any:  # rule 1
    values = named_args(aten.embedding.default, args, kwargs)
    weight, indices = values["weight"], values["indices"]
    if values["sparse"] or not (is_dtensor(weight) and is_dtensor(indices)) or weight.device_mesh != \
            indices.device_mesh or weight.dim() != 2 or any(p.is_partial() for p in indices.placements):
        return NotImplemented
    vocab = [d for d, p in enumerate(weight.placements) if p == Shard(0)]
    if len(vocab) != 1 or indices.placements[vocab[0]] != Replicate() or \
            any(p != Replicate() for d, p in enumerate(weight.placements) if d != vocab[0]):
        return NotImplemented
    mesh, held = weight.device_mesh, rows(weight, 0)
    if any(length == 0 for _, length in held):
        return NotImplemented  # (a device without rows has none to read a masked index from)
    check_indices(indices, weight.shape[0], f"index out of range in self: an index of embedding is outside the "
                  f"table's {weight.shape[0]} rows, expected each in [0, {weight.shape[0]})")
    mine, safe = own_rows(indices, held)
    placements = tuple(Partial() if d == vocab[0] else p for d, p in enumerate(indices.placements))
    out = spec(mesh, placements, (*indices.shape, weight.shape[1]), weight.dtype)
    looked_up = emit(aten.embedding.default, (weight, safe), out)
    indices._dtorch_vocabulary = vocab[0], weight.shape[0]  # (rule 3: the indices autograd saves)
    return only_mine(aten.unsqueeze.default(mine, -1), looked_up, out)


@register_decomposition(aten.embedding_dense_backward.default)
def scaled_by_frequency(args: tuple, kwargs: dict) -> Any:  # rule 2
    values = named_args(aten.embedding_dense_backward.default, args, kwargs)
    grad, indices = values["grad_output"], values["indices"]
    if not values["scale_grad_by_freq"] or not (is_dtensor(indices) and
                                                 any(isinstance(p, Shard) for p in indices.placements)):
        return NotImplemented
    num_weights, padding_idx = values["num_weights"], values["padding_idx"]
    summed = aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, False)
    ones = aten.ones_like.default(aten.narrow.default(grad, -1, 0, 1))
    counts = aten.embedding_dense_backward.default(ones, indices, num_weights, padding_idx, False)
    return aten.div.Tensor(summed, aten.clamp_min.default(counts, 1))


@register_decomposition(aten.embedding_dense_backward.default)
def vocabulary_parallel_gradient(args: tuple, kwargs: dict) -> Any:  # rule 3
    values = named_args(aten.embedding_dense_backward.default, args, kwargs)
    grad, indices, num_weights = values["grad_output"], values["indices"], values["num_weights"]
    lookup = getattr(indices, "_dtorch_vocabulary", None)  # (the vocabulary's mesh dim, the table's rows)
    if lookup is None or lookup[1] != num_weights or values["scale_grad_by_freq"] or not is_dtensor(grad) or \
            grad.device_mesh != indices.device_mesh:
        return NotImplemented
    layouts = _gradient_layout(grad, indices, lookup[0])
    if layouts is None:
        return NotImplemented
    mesh, shape, placements = indices.device_mesh, (num_weights, grad.shape[-1]), layouts[1]
    held = [box[0] for box in boxes(mesh, placements, shape)]
    if any(length == 0 for _, length in held):
        return NotImplemented
    mine, safe = own_rows(indices, held)
    grad = to(grad, layouts[0])
    grad = only_mine(aten.unsqueeze.default(mine, -1), grad, grad._spec)
    pad = values["padding_idx"]
    return emit(aten.embedding_dense_backward.default, (grad, safe, num_weights, pad, False),
                spec(mesh, placements, shape, grad.dtype),
                per_device=[(grad, safe, length, pad - start if start <= pad < start + length else -1, False)
                            for start, length in held])


def _gradient_layout(grad: Any, indices: Any, vocab: int) -> tuple[tuple[Placement, ...], tuple[Placement, ...]] | None:
    """Rule 3: (the placements the gradient is used in, the table gradient's), per mesh dim, from the gradient's and
    the indices'; None where they are not among the rule's cases. A replicated gradient of sharded indices is
    sliced as they are (a local slice)."""
    use: list[Placement] = []
    out: list[Placement] = []
    last = grad.ndim - 1
    for i, (g, x) in enumerate(zip(grad.placements, indices.placements)):
        if i == vocab:
            if g != Replicate() or x != Replicate():
                return None
            use.append(g)
            out.append(Shard(0))
        elif x.is_partial():
            return None
        elif x == Replicate() and (g == Replicate() or g.is_partial()):
            use.append(g)
            out.append(g)
        elif x == Replicate() and g.is_shard() and g.dim % grad.ndim == last:
            use.append(g)
            out.append(Shard(1))
        elif x.is_shard() and (g == Replicate() or g.is_shard() and g.dim % grad.ndim == x.dim % indices.ndim):
            use.append(Shard(x.dim % indices.ndim))
            out.append(Partial())
        else:
            return None
    return tuple(use), tuple(out)
