"""Embedding lookups and gradients on sharded tables and indices.

Rules (decompositions, `_registry.register_decomposition`; each declines, NotImplemented, outside its case):
  1. Vocabulary-parallel lookup (`embedding` of a table whose rows, the vocabulary, are sharded on one mesh dim,
     `RowwiseParallel` on an `nn.Embedding`, with indices replicated on that dim): torch's rule answers with a
     private placement, so the whole table was gathered on every device at every forward. As Megatron's
     vocabulary-parallel embedding does, each device looks up the indices that fall in its rows (the others read
     row 0 and are zeroed) and the output is Partial("sum") on that mesh dim: one reduction of the activations,
     none of the table. The indices shifted into a device's rows differ per device (per-device arguments), and
     live only inside the rule.
  2. A gradient scaled by frequency (`nn.Embedding(scale_grad_by_freq=True)`) on sharded indices:
     `embedding_dense_backward(..., scale_grad_by_freq=True)` divides each row's gradient by how often its index
     occurs in the batch; with the batch sharded, each device counted its own shard, wrong wherever an index occurs
     on more than one device. The unscaled backward is divided by the counts of the whole batch, which are the same
     backward of ones (`[..., 1]`): a row's sum of its occurrences, at least 1 (a row no index names has no
     gradient to scale).
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import emit, is_dtensor, spec
from dtorch._registry import named_args, register_decomposition
from dtorch_protocol.layout import coords, shard_box
from dtorch_protocol.placement_types import Partial, Replicate, Shard

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
    mesh = weight.device_mesh
    rows = [shard_box(tuple(weight.shape), mesh.shape, weight.placements, c)[0] for c in coords(mesh.shape)]
    shifted = emit(aten.sub.Scalar, (indices, 0), indices._spec, per_device=[(indices, start) for start, _ in rows])
    below = emit(aten.lt.Scalar, (shifted, 0), spec(mesh, indices.placements, indices.shape, torch.bool),
                 per_device=[(shifted, length) for _, length in rows])
    mine = aten.logical_and.default(aten.ge.Scalar(shifted, 0), below)
    safe = aten.mul.Tensor(shifted, mine)
    placements = tuple(Partial() if d == vocab[0] else p for d, p in enumerate(indices.placements))
    looked_up = emit(aten.embedding.default, (weight, safe),
                     spec(mesh, placements, (*indices.shape, weight.shape[1]), weight.dtype))
    return aten.mul.Tensor(looked_up, aten.unsqueeze.default(mine, -1))


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
