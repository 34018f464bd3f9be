"""Sequence parallelism across a concatenated sequence: the joint attention of MMDiT models (SD3, FLUX).

A diffusion transformer's joint attention concatenates image and text tokens along the sequence, attends over the
whole and splits the result back (`q = cat([q_img, q_txt], dim=seq)`, ..., `img, txt = out[:, :n], out[:, n:]`).
With the image tokens sharded on the sequence and the text replicated, torch's rule for `cat` would gather the image
tokens and every device would run the whole attention. Instead each device keeps its own query rows and attends
against all keys and values, as xDiT and SGLang-diffusion do.

Layout: the concatenation is a `DisjointPartial` (see `_disjoint`) whose routing is its segment partition,
`("segments", ((length, "S" | "R"), ...))`: device d holds chunk d (torch.chunk) of every segment at its true
position and zeros elsewhere: its own shard of a sharded segment, the d-th chunk of a replicated one (the text
queries are split too). The partition depends only on the lengths, so tensors of equal routing agree exactly.

Rules (decompositions registered in `_registry`), on one mesh dim m:
  cat         Shard(dim) and Replicate inputs on m (at least one of each, nothing else sharding dim): each input
              goes to Shard(dim) (a replicated one is sliced locally), each device pads its chunks into place
              (constant_pad_nd) and adds them: the layout above, no communication
  attention   (CPU flash attention) queries in that layout on the sequence dim, keys and values in it or
              replicated, no mask, dropout or causal flag: keys and values are summed whole (one all-reduce of the
              disjoint terms each), each device gathers its own query rows (index_select), runs the kernel on them
              against all keys, and puts the rows back (index_copy): output and logsumexp in the queries' layout
  slice/split at segment boundaries: a segment leaves laid out as it came, Shard(dim) as each device's chunk
              (slice_copy), Replicate gathered back (one all-gather of the chunks)
Between them, elementwise and view ops keep the layout (`_disjoint`); anything else sees an ordinary Partial.
"""

from __future__ import annotations

from typing import Any

import torch

from dtorch._disjoint import DisjointPartial
from dtorch._local import emit, is_dtensor, on_dim, spec, to
from dtorch._registry import register_decomposition
from dtorch_protocol.layout import chunk_range, coords
from dtorch_protocol.placement_types import Partial, Replicate, Shard

aten = torch.ops.aten
FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_R = Replicate()
_INT64_MAX = (1 << 63) - 1


def _segments(p: Any) -> tuple[tuple[int, str], ...] | None:
    if isinstance(p, DisjointPartial) and isinstance(p.routing, tuple) and p.routing[:1] == ("segments",):
        return p.routing[1]
    return None


def _joint_dim(t: Any) -> tuple[int, tuple[tuple[int, str], ...]] | None:
    """(mesh dim, segments) of a tensor in the joint layout, else None."""
    for i, p in enumerate(t.placements):
        segments = _segments(p)
        if segments is not None:
            return i, segments
    return None


def _chunks(segments: tuple[tuple[int, str], ...], n: int, c: int) -> list[tuple[int, int, int]]:
    """(segment, start in the concatenation, length) of position c's chunk of each segment."""
    out, offset = [], 0
    for s, (length, _kind) in enumerate(segments):
        start, size = chunk_range(0, length, n, c)
        out.append((s, offset + start, size))
        offset += length
    return out


def _dtensors(ts: Any) -> bool:
    return all(is_dtensor(t) for t in ts)


# ------------------------------------------------------------------------------------------------ cat


@register_decomposition(aten.cat.default)
def cat(args: tuple, kwargs: dict) -> Any:
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if len(tensors) < 2 or not _dtensors(tensors) or len({t.device_mesh for t in tensors}) != 1 or \
            len({t.ndim for t in tensors}) != 1 or len({t.dtype for t in tensors}) != 1 or \
            not tensors[0].dtype.is_floating_point:  # activations; a sum of boolean terms is no "or"
        return NotImplemented
    ndim, mesh = tensors[0].ndim, tensors[0].device_mesh
    dim %= max(ndim, 1)
    m = _mesh_dim(tensors, dim)
    if m is None:
        return NotImplemented
    segments = tuple((t.shape[dim], "S" if t.placements[m] == Shard(dim) else "R") for t in tensors)
    total = sum(length for length, _ in segments)
    shape = (*tensors[0].shape[:dim], total, *tensors[0].shape[dim + 1:])
    others = tensors[0].placements
    out_spec = spec(mesh, on_dim(mesh.ndim, m, DisjointPartial(routing=("segments", segments), dim=dim), others),
                    shape, tensors[0].dtype)
    n = mesh.shape[m]
    placed = []
    for s, t in enumerate(tensors):
        piece = to(t, on_dim(mesh.ndim, m, Shard(dim), others))  # a replicated segment: each device's chunk
        pads = []
        for c in coords(mesh.shape):
            _, start, size = _chunks(segments, n, c[m])[s]
            pads.append((piece, [0, 0] * (ndim - 1 - dim) + [start, total - start - size], 0.0))
        placed.append(emit(aten.constant_pad_nd.default, pads[0], out_spec, per_device=pads))
    out = placed[0]
    for p in placed[1:]:
        out = out + p  # disjoint terms of one routing: elementwise, stays in the layout
    return out


def _mesh_dim(tensors: list, dim: int) -> int | None:
    """The mesh dim sharding `dim` of some inputs and replicating the others; every other mesh dim alike in all."""
    mesh = tensors[0].device_mesh
    found = None
    for i in range(mesh.ndim):
        ps = [t.placements[i] for t in tensors]
        if any(isinstance(p, Partial) for p in ps):
            return None
        if Shard(dim) in ps:
            if found is not None or any(p not in (Shard(dim), _R) for p in ps) or _R not in ps:
                return None
            found = i
        elif len(set(ps)) != 1:
            return None
    return found


# ------------------------------------------------------------------------------------------------ attention


@register_decomposition(FLASH_CPU)
def attention(args: tuple, kwargs: dict) -> Any:
    q, k, v = args[:3]
    dropout = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if not _dtensors((q, k, v)) or dropout or causal or kwargs.get("attn_mask") is not None or q.ndim != 4:
        return NotImplemented
    joint = _joint_dim(q)
    if joint is None or q.placements[joint[0]].dim != 2:
        return NotImplemented
    m, segments = joint
    mesh = q.device_mesh
    for t in (k, v):
        p = t.placements[m]
        if t.device_mesh != mesh or not (p == _R or (isinstance(p, DisjointPartial) and p == q.placements[m])):
            return NotImplemented
    others = [tuple(p for i, p in enumerate(t.placements) if i != m) for t in (q, k, v)]
    if len(set(others)) != 1 or any(isinstance(p, Partial) or (isinstance(p, Shard) and p.dim >= 2)
                                    for p in others[0]):
        return NotImplemented
    whole = on_dim(mesh.ndim, m, _R, q.placements)
    k, v = to(k, whole), to(v, whole)  # the sum of disjoint terms: whole keys and values everywhere
    n = mesh.shape[m]
    rows = [_rows(segments, n, c[m]) for c in coords(mesh.shape)]
    width = max(len(r) for r in rows)
    index = [torch.tensor(r + r[-1:] * (width - len(r)), dtype=torch.long) for r in rows]  # padded with a repeat
    batch, heads, length, head_dim = q.shape
    own = on_dim(mesh.ndim, m, Shard(2), q.placements)
    mine = emit(aten.index_select.default, (q, 2, index[0]), spec(mesh, own, (batch, heads, n * width, head_dim),
                q.dtype), per_device=[(q, 2, i) for i in index])
    out, lse = emit(FLASH_CPU, (mine, k, v, 0.0, False), [
        spec(mesh, own, (batch, heads, n * width, v.shape[3]), q.dtype),
        spec(mesh, own, (batch, heads, n * width), torch.float32)], kwargs={"scale": kwargs.get("scale")})
    layout = q.placements
    zeros = to(k.new_zeros((batch, heads, length, v.shape[3])), whole)
    zeros_lse = to(k.new_zeros((batch, heads, length), dtype=torch.float32), whole)
    out = emit(aten.index_copy.default, (zeros, 2, index[0], out), spec(mesh, layout, tuple(zeros.shape), q.dtype),
               per_device=[(zeros, 2, i, out) for i in index])
    lse = emit(aten.index_copy.default, (zeros_lse, 2, index[0], lse),
               spec(mesh, layout, tuple(zeros_lse.shape), torch.float32),
               per_device=[(zeros_lse, 2, i, lse) for i in index])
    return out, lse


def _rows(segments: tuple[tuple[int, str], ...], n: int, c: int) -> list[int]:
    return [r for _, start, size in _chunks(segments, n, c) for r in range(start, start + size)]


# ------------------------------------------------------------------------------------------------ slice, split


def _joint_input(args: tuple) -> tuple[Any, tuple[int, tuple[tuple[int, str], ...]]] | None:
    x = args[0]
    joint = _joint_dim(x) if _dtensors((x,)) else None
    return None if joint is None else (x, joint)


@register_decomposition(aten.slice.Tensor)
def slice_(args: tuple, kwargs: dict) -> Any:
    found = _joint_input(args)
    if found is None:
        return NotImplemented
    x, joint = found
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % x.ndim
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    length = x.shape[dim]
    start, end = _clamp(start, length, 0), _clamp(end, length, length)
    segment = _segment_at(joint[1], start, end)
    if step != 1 or dim != x.placements[joint[0]].dim or segment is None:
        return NotImplemented
    return _leave(x, joint[0], joint[1], segment)


@register_decomposition(aten.split_with_sizes.default, aten.split.Tensor)
def split(args: tuple, kwargs: dict) -> Any:
    found = _joint_input(args)
    if found is None:
        return NotImplemented
    x, joint = found
    sizes = args[1] if len(args) > 1 else kwargs.get("split_sizes", kwargs.get("split_size"))
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.ndim
    length = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, length - i) for i in range(0, length, sizes)] if sizes > 0 else []
    if dim != x.placements[joint[0]].dim or list(sizes) != [size for size, _ in joint[1]]:
        return NotImplemented
    return [_leave(x, joint[0], joint[1], s) for s in range(len(sizes))]


def _clamp(v: Any, length: int, default: int) -> int:
    if v is None:
        return default
    v = v + length if v < 0 else v
    return max(0, min(v, length))


def _segment_at(segments: tuple[tuple[int, str], ...], start: int, end: int) -> int | None:
    offset = 0
    for s, (length, _) in enumerate(segments):
        if (start, end) == (offset, offset + length):
            return s
        offset += length
    return None


def _leave(x: Any, m: int, segments: tuple[tuple[int, str], ...], s: int) -> Any:
    """Segment s of a joint tensor, laid out as it entered: each device's chunk, gathered when it came replicated."""
    mesh, dim = x.device_mesh, x.placements[m].dim
    n = mesh.shape[m]
    length, kind = segments[s]
    shape = (*x.shape[:dim], length, *x.shape[dim + 1:])
    sharded = on_dim(mesh.ndim, m, Shard(dim), x.placements)
    per_device = []
    for c in coords(mesh.shape):
        _, start, size = _chunks(segments, n, c[m])[s]
        per_device.append((x, dim, start, start + size))
    out = emit(aten.slice_copy.Tensor, per_device[0], spec(mesh, sharded, shape, x.dtype), per_device=per_device)
    return to(out, on_dim(mesh.ndim, m, _R, x.placements)) if kind == "R" else out

