"""No session reads bytes another session left behind on this worker.

Sessions share a worker's allocator (packed sessions at once, others one after another), and a freed block
comes back with its old bytes. A kernel writes every element of what it returns, but three kinds of output hand
such bytes to the caller all the same (`as_strided` reaches every byte of an output's storage, covered by an
element or not):

1. The empty family (`UNINITIALIZED`): `empty`, `empty_like`, `new_empty`, `empty_strided`, ... Their outputs'
   whole storages are zeroed before anything can read them.
2. In-place resizes that grow a storage (`GROWING`: `resize_`, `resize_as_`, `set_` with a size, ...). The bytes
   past the storage's size before the op are zeroed; the ones before are the session's own.
3. Outputs on a storage of their own that their elements do not cover (a fresh storage: none of the op's inputs
   is on it). `unique_consecutive` of n values returns its k distinct ones on a storage of n it allocated up front,
   and never writes the other n - k. Whatever bytes of such a storage no output of the op covers are zeroed. The
   check costs a few attribute reads per output (a dense output that starts its storage covers it: no more); the
   zeroing, one pass over the storage, only for those outputs. Views of inputs are on the session's own storages,
   which these rules keep clean from the start.

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


def _covers(t: torch.Tensor) -> bool:
    """Does every byte of `t`'s storage belong to one of its elements?"""
    return t.storage_offset() == 0 and t.nbytes == t.untyped_storage().nbytes() and (t.is_contiguous() or _dense(t))


def _dense(t: torch.Tensor) -> bool:
    """Its elements, in some order of its dims, lie one after another (a permuted or channels-last layout)."""
    step = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != step:
            return False
        step *= size
    return True


def _zero_uncovered(views: list[torch.Tensor]) -> None:
    """Zero the bytes of the views' one storage that no element of any of them covers (rule 3): the gaps between
    them when they are contiguous (`unique_consecutive`'s prefix), else through a mask of the storage's bytes."""
    st = views[0].untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (st.nbytes(),))
    if all(v.is_contiguous() for v in views):
        end = 0
        for start, stop in sorted((v.storage_offset() * v.element_size(),
                                   (v.storage_offset() + v.numel()) * v.element_size()) for v in views):
            if start > end:
                raw[end:start].zero_()
            end = max(end, stop)
        raw[end:].zero_()
        return
    covered = torch.zeros(st.nbytes(), dtype=torch.bool, device=st.device)
    for v in views:
        size = v.element_size()
        if v.numel():
            starts = torch.arange(st.nbytes() // size, device=st.device).as_strided(v.shape, v.stride(),
                                                                                    v.storage_offset())
            covered[(starts.reshape(-1, 1) * size + torch.arange(size, device=st.device)).reshape(-1)] = True
    raw.masked_fill_(~covered, 0)


def scrub(op: str, outputs: list[Any], before: dict[int, int] | None, inputs: Iterable[Any] = ()) -> None:
    """Zero what `op` handed out without writing it (module rules); `outputs`: its flat results, `inputs`: its
    arguments. For most ops, one look at each output (the executor's hot path)."""
    if op in UNINITIALIZED:
        for t in _tensors(outputs):
            _zero(t.untyped_storage(), 0)
        return
    if before is not None:
        for t in _tensors(outputs):
            st = t.untyped_storage()
            _zero(st, before.get(st._cdata, 0))
        return
    partial = [t for t in outputs if isinstance(t, torch.Tensor) and not _covers(t)]
    if not partial:
        return
    skip = {t.untyped_storage()._cdata for t in _tensors(inputs)}  # views of inputs: the session's own bytes
    skip |= {t.untyped_storage()._cdata for t in outputs if isinstance(t, torch.Tensor) and _covers(t)}
    fresh: dict[int, list[torch.Tensor]] = {}
    for t in partial:
        key = t.untyped_storage()._cdata
        if key not in skip:
            fresh.setdefault(key, []).append(t)
    for views in fresh.values():
        _zero_uncovered(views)
