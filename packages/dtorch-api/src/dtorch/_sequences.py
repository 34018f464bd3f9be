"""Variable-length batches: nested tensors and packed sequences.

1. Nested tensors: DTensors hold strided tensors only. `nn.TransformerEncoder`'s inference fast path packs a
   padded batch into a nested tensor when `_nested_tensor_from_mask_left_aligned(src, mask)` says that the padding
   mask is left-aligned. With DTensors the check answers False (a decomposition), so the encoder takes its padded
   path, as it does in training: the same values at every position the mask keeps (at padded positions the fast
   path writes zeros, the padded path what it computed there). `_nested_tensor_from_mask` itself (reached with
   `mask_check=False`) raises one line naming `enable_nested_tensor=False`.
2. Packed sequences (`nn.utils.rnn.pack_padded_sequence` of a DTensor batch): the packed data is a DTensor, the
   batch sizes stay a plain tensor, as torch's RNN kernels (`lstm.data`, `_pad_packed_sequence`) read them in the
   user's process. They depend only on the plain lengths, so they are computed there; the data is the input's
   time-major rows where a step is within its sequence's length (one boolean index: lengths are sorted, so the
   rows of a step are the first `batch_sizes[t]` of the batch, torch's packed order).
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._local import is_dtensor
from dtorch._registry import register_decomposition

aten = torch.ops.aten


@register_decomposition(aten._nested_tensor_from_mask_left_aligned.default)
def left_aligned(args: tuple, kwargs: dict) -> Any:
    return False if any(is_dtensor(a) for a in (*args, *kwargs.values())) else NotImplemented


@register_decomposition(aten._nested_tensor_from_mask.default)
def from_mask(args: tuple, kwargs: dict) -> Any:
    if not any(is_dtensor(a) for a in (*args, *kwargs.values())):
        return NotImplemented
    raise NotImplementedError("dtorch: DTensors hold strided tensors, not nested ones; build nn.TransformerEncoder "
                              "with enable_nested_tensor=False (or leave mask_check on) to run it on DTensors")


@register_decomposition(aten._pack_padded_sequence.default)
def pack_padded(args: tuple, kwargs: dict) -> Any:
    values = dict(zip(("input", "lengths", "batch_first"), args), **kwargs)
    data, lengths, batch_first = values["input"], values["lengths"], values["batch_first"]
    if not is_dtensor(data) or is_dtensor(lengths):
        return NotImplemented
    steps = data.transpose(0, 1) if batch_first else data
    _, batch_sizes = aten._pack_padded_sequence.default(torch.empty(steps.shape[:2] + (1,)), lengths, False)
    within = torch.arange(steps.shape[0]).unsqueeze(1) < lengths.unsqueeze(0)
    return steps[within], batch_sizes
