"""No session reads bytes another session left behind on this worker.

Sessions share a worker's allocator (packed sessions at once, others one after another), and a freed block
comes back with its old bytes. Only two kinds of op hand such bytes to the caller; everything else writes
every element of what it returns (ATen kernels allocate dense outputs and fill them):

1. The empty family (`UNINITIALIZED`): `empty`, `empty_like`, `new_empty`, `empty_strided`, ... Their outputs'
   whole storages are zeroed before anything can read them (a whole storage: `as_strided` reaches bytes that
   no element of the output covers).
2. In-place resizes that grow a storage (`GROWING`: `resize_`, `resize_as_`, `set_` with a size, ...). The bytes
   past the storage's size before the op are zeroed; the ones before are the session's own.

Approach chosen over one caching allocator per session: zeroing costs one memset of the new bytes, only for
these ops (an `empty_like` costs what a `zeros_like` costs), while a per-session allocator would keep each
session's freed blocks out of everyone else's reach (memory no other session can use). Factories DTorch
creates (`CmdCreate`, "empty" included) are zeros already; uploads and copies between workers are filled
completely before they are stored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

UNINITIALIZED = frozenset({
    "aten.empty.memory_format", "aten.empty.out", "aten.empty_like.default", "aten.empty_like.out",
    "aten.empty_permuted.default", "aten.empty_permuted.out", "aten.empty_strided.default",
    "aten.empty_strided.out", "aten.new_empty.default", "aten.new_empty.out", "aten.new_empty_strided.default",
    "aten.new_empty_strided.out", "aten.empty_quantized.default", "aten.empty_quantized.out",
    "aten._empty_affine_quantized.default", "aten._empty_affine_quantized.out",
    "aten._empty_per_channel_affine_quantized.default", "aten._empty_per_channel_affine_quantized.out",
    "prims.empty.default", "prims.empty_strided.default", "prims.empty_permuted.default",
})
GROWING = frozenset({
    "aten.resize_.default", "aten.resize.default", "aten.resize.out", "aten.resize_as_.default",
    "aten.resize_as.default", "aten.resize_as.out", "aten._resize_output_.default", "aten._resize_output.default",
    "aten._resize_output.out", "aten._copy_from_and_resize.default", "aten._copy_from_and_resize.out",
    "aten.set_.source_Tensor_storage_offset", "aten.set_.source_Storage_storage_offset", "aten.set_.default",
    "aten.set_.source_Tensor", "aten.set_.source_Storage", "prims.resize.default",
})


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)
        elif isinstance(v, dict):
            yield from _tensors(v.values())


def sizes_before(op: str, args: Iterable[Any]) -> dict[int, int] | None:
    """For a GROWING op: the byte size of every input's storage now (None for other ops: nothing to record)."""
    if op not in GROWING:
        return None
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in _tensors(args)}


def _zero(storage: torch.UntypedStorage, start: int) -> None:
    if storage.nbytes() > start:
        torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
            storage, start, (storage.nbytes() - start,)).zero_()


def scrub(op: str, outputs: Iterable[Any], before: dict[int, int] | None) -> None:
    """Zero what `op` handed out without writing it (module rules); a no-op for every other op."""
    if op in UNINITIALIZED:
        for t in _tensors(outputs):
            _zero(t.untyped_storage(), 0)
    elif before is not None:
        for t in _tensors(outputs):
            st = t.untyped_storage()
            _zero(st, before.get(st._cdata, 0))
