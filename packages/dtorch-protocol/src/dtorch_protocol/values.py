"""Torch values inside op arguments, as plain msgpack values (see the `messages` docstring).

The client encodes, the worker decodes; torch is imported only when a function here runs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Any

from dtorch_protocol.messages import TENSOR_SLOT


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def tensor_to_bytes(t: Any) -> bytes:
    """Raw little-endian bytes of a CPU tensor (bool and bfloat16 included)."""
    import torch

    t = t.detach().contiguous().cpu()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""  # (a 0-d one cannot view)
    return t.numpy().tobytes()


def host_bytes(t: Any) -> memoryview:
    """A writable byte view of a contiguous host tensor's memory (no copy, no numpy); the view keeps `t` alive.
    What both sides of the wire send and receive tensor payloads through."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"host_bytes needs a contiguous host tensor, got one on {t.device}")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    array._tensor = t  # type: ignore[attr-defined]  # the memory lives as long as the view
    return memoryview(array).cast("B")


def copy_pieces(pieces: Sequence[bytes | memoryview], into: memoryview) -> None:
    """`pieces` one after another into `into` (a payload that came in chunks, joined once)."""
    pos = 0
    for piece in pieces:
        into[pos:pos + len(piece)] = piece
        pos += len(piece)


def segment_tensor(fd: int, nbytes: int, dtype: str, shape: Sequence[int], shared: bool) -> Any:
    """The payload of a checked segment descriptor (dtorch_protocol.segments) as a tensor: a mapping of it,
    copy-on-write unless `shared`, that keeps no descriptor (segments.py rule 6)."""
    import torch

    from dtorch_protocol import segments

    dt = dtype_from_name(dtype)
    storage = torch.UntypedStorage.from_file(segments.path(fd), shared, segments.HEADER + nbytes)
    flat = torch.empty(0, dtype=dt).set_(storage, segments.HEADER // dt.itemsize, (nbytes // dt.itemsize,))
    return flat.view(list(shape))


def tensor_from_bytes(data: bytes | bytearray | memoryview, dtype: str, shape: list[int]) -> Any:
    import torch

    dt = dtype_from_name(dtype)
    if len(data) == 0:
        return torch.empty(shape, dtype=dt)
    flat = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=dt)
    return flat.reshape(shape)


def encode_value(v: Any, tensor_ref: Callable[[Any], Any]) -> Any:
    """Encode an op argument. `tensor_ref(t)` returns the wire form of a DTensor, or None for a plain tensor."""
    import torch

    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [encode_value(x, tensor_ref) for x in v]
    if isinstance(v, torch.Tensor):
        ref = tensor_ref(v)
        if ref is not None:
            return ref
        return {"$lit": [dtype_name(v.dtype), list(v.shape), tensor_to_bytes(v)]}
    if isinstance(v, torch.dtype):
        return {"$dtype": dtype_name(v)}
    if isinstance(v, torch.device):
        return {"$device": v.type}
    if isinstance(v, torch.layout):
        return {"$layout": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"$mf": str(v).removeprefix("torch.")}
    if isinstance(v, complex):
        return {"$c": [v.real, v.imag]}
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise TypeError(f"symbolic value {v!r} cannot be sent to a worker")
    raise TypeError(f"cannot send a {type(v).__name__} argument to a worker")


_ENUMS = {"$layout", "$mf"}


def decode_value(v: Any, resolve: Callable[[int], Any], device: Any) -> Any:
    """Decode an op argument on a worker: `resolve(tid)` gives the local shard, devices become `device`."""
    if isinstance(v, list):
        return [decode_value(x, resolve, device) for x in v]
    if not isinstance(v, dict):
        return v
    if len(v) != 1:
        raise ValueError(f"bad argument map with keys {sorted(v)}")
    (key, val), = v.items()
    if key == TENSOR_SLOT:
        return resolve(int(val))
    if key == "$dtype":
        return dtype_from_name(val)
    if key == "$device":
        return device
    if key == "$lit":
        dtype, shape, data = val
        return tensor_from_bytes(data, dtype, shape).to(device)
    if key == "$c":
        return complex(val[0], val[1])
    if key in _ENUMS:
        import torch

        obj = getattr(torch, str(val), None)
        if not isinstance(obj, (torch.layout, torch.memory_format)):
            raise ValueError(f"unknown {key[1:]} {val!r}")
        return obj
    raise ValueError(f"unknown argument tag {key!r}")


REDUCE_OPS = frozenset({"sum", "avg", "max", "min"})  # the reduce ops of Partial placements


def reduce_in_order(bufs: list[Any], op: str, out: Any = None) -> Any:
    """Combine partial values in the given (mesh) order: sum, avg, max or min, into `out` (default: into the
    first buffer; into `out`, the first two are combined in one pass, with no copy of the first before). Every
    path that combines Partial values uses it (the workers' collectives and point-to-point plans, the client's
    read of a small Partial tensor), so all of them round alike."""
    import torch

    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}")
    fn = torch.add if op in ("sum", "avg") else torch.maximum if op == "max" else torch.minimum
    if out is None:
        acc, rest = bufs[0], bufs[1:]
    elif len(bufs) > 1:
        acc, rest = fn(bufs[0], bufs[1], out=out), bufs[2:]  # a + b written once: the bits of a.clone().add_(b)
    else:
        acc, rest = out.copy_(bufs[0]), []
    for b in rest:
        fn(acc, b, out=acc)
    if op == "avg" and len(bufs) > 1:
        divide(acc, len(bufs))
    return acc


def divide(acc: Any, n: int) -> Any:
    """avg after the sum, as `reduce_in_order` does it."""
    if acc.is_floating_point() or acc.is_complex():
        return acc.div_(n)
    return acc.div_(n, rounding_mode="trunc")
