"""An embedding's gradient scaled by frequency (`nn.Embedding(scale_grad_by_freq=True)`) on sharded indices.

`embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq=True)` divides each row's
gradient by how often its index occurs in the batch. With the batch sharded, each device counted the indices of its
own shard, and the summed gradient was wrong wherever an index occurs on more than one device.

Rule (a decomposition, `_registry.register_decomposition`; it declines, NotImplemented, unless the frequency scaling
is on and the indices are sharded): the unscaled backward, divided by the counts of the whole batch, which are the
same backward of ones (`[..., 1]`): a row's sum of its occurrences, at least 1 (a row no index names has no
gradient to scale).
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import is_dtensor
from dtorch._registry import register_decomposition
from dtorch_protocol.placement_types import Shard

aten = torch.ops.aten


@register_decomposition(aten.embedding_dense_backward.default)
def scaled_by_frequency(args: tuple, kwargs: dict) -> Any:
    values = dict(zip(("grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq"), args),
                  **kwargs)
    grad, indices = values["grad_output"], values["indices"]
    if not values["scale_grad_by_freq"] or not (is_dtensor(indices) and
                                                 any(isinstance(p, Shard) for p in indices.placements)):
        return NotImplemented
    num_weights, padding_idx = values["num_weights"], values["padding_idx"]
    summed = aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, False)
    ones = aten.ones_like.default(aten.narrow.default(grad, -1, 0, 1))
    counts = aten.embedding_dense_backward.default(ones, indices, num_weights, padding_idx, False)
    return aten.div.Tensor(summed, aten.clamp_min.default(counts, 1))
