"""Counter-based random values: element i of a tensor drawn with seed s is a pure function of (s, i).

A device draws only the elements of its own box, so random factories cost O(shard) per device in time
and memory, and the values never depend on the mesh or the placements (issue #12 item 4).

Rules:
  1. The counter of an element is its flat index in the global tensor (row-major, the contiguous order).
  2. `word(key, counter)` is 32 random bits: murmur3's finalizer `fmix32` applied to the counter's low word
     plus the key, then again after xoring in the mixed high word. Stateless, any element drawn alone, in
     32-bit arithmetic (torch multiplies int32 vectors an order of magnitude faster than int64). Each lane
     (a uniform's second word, Box-Muller's second uniform) has its own key from splitmix64(seed, lane).
  3. `rand` takes the top `mantissa + 1` bits of the dtype (24 for float32, 53 for float64 from two lanes,
     11 for float16, 8 for bfloat16) as a multiple of 2**-bits: every value is exact in the dtype, in [0, 1).
  4. `randn` is Box-Muller on two uniforms of the element (float64 for float64, float32 otherwise), then cast.
Values differ from `torch.rand(generator=...)`: they are DTorch's, the same on every layout and device type.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1


def _i32(c: int) -> int:
    """A uint32 constant as the int32 with the same bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _key(seed: int, lane: int) -> int:
    return _i32(_splitmix64((_splitmix64(seed & _M64) + lane) & _M64) & _M32)


def _shr(h: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int32 bits (torch's >> is arithmetic)."""
    return (h >> k) & ((1 << (32 - k)) - 1)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ _shr(h, 16)
    h = h * _i32(0x85EBCA6B)
    h = h ^ _shr(h, 13)
    h = h * _i32(0xC2B2AE35)
    return h ^ _shr(h, 16)


class Counters:
    """The flat global indices of a box as int32 words: `lo` per element, `hi` per element or one int."""

    def __init__(self, shape: Sequence[int], box: Sequence[Sequence[int]], device: torch.device | str = "cpu"):
        small = math.prod(shape) <= 1 << 31  # int32 indices all the way (the common case, twice as fast)
        dtype = torch.int32 if small else torch.int64
        index = torch.zeros([b[1] for b in box], dtype=dtype, device=device)
        stride = 1
        for d in reversed(range(len(shape))):
            start, length = box[d]
            view = [1] * len(shape)
            view[d] = length
            index += (torch.arange(start, start + length, dtype=torch.int64, device=device) * stride).to(dtype).view(view)
            stride *= shape[d]
        self.hi: torch.Tensor | int = 0
        if small:
            self.lo = index
        else:
            self.lo = (index & _M32).to(torch.int32)  # wraps: the bits are what count
            self.hi = (index >> 32).to(torch.int32)


def word(seed: int, lane: int, c: Counters) -> torch.Tensor:
    """32 random bits (int32) per element (rule 2)."""
    h = _fmix32(c.lo + _key(seed, lane))
    hi = c.hi
    if isinstance(hi, int):
        return _fmix32(h ^ _key(seed, lane + (1 << 20)))
    return _fmix32(h ^ _fmix32(hi + _key(seed, lane + (1 << 20))))


def _uniform(seed: int, lane: int, c: Counters, bits: int, open_zero: bool = False) -> torch.Tensor:
    """Uniform values k * 2**-bits (k + 1 when `open_zero`: in (0, 1]), float64 when bits > 24 else float32."""
    if bits <= 24:
        k = _shr(word(seed, lane, c), 32 - bits)
        return ((k + 1) if open_zero else k).to(torch.float32) * 2.0 ** -bits
    hi = _shr(word(seed, lane, c), 5).to(torch.float64) * 2.0 ** 26  # 27 + 26 = 53 bits
    k = hi + _shr(word(seed, lane + 1, c), 6).to(torch.float64)
    return ((k + 1) if open_zero else k) * 2.0 ** -53


def _bits(dtype: torch.dtype) -> int:
    return round(-math.log2(torch.finfo(dtype).eps)) + 1  # mantissa bits, the implicit one included


def rand(seed: int, c: Counters, dtype: torch.dtype) -> torch.Tensor:
    """Uniform values in [0, 1), exact in `dtype` (rule 3)."""
    return _uniform(seed, 0, c, min(_bits(dtype), 53)).to(dtype)


def randn(seed: int, c: Counters, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values (rule 4)."""
    bits = 53 if dtype == torch.float64 else 24
    u1 = _uniform(seed, 0, c, bits, open_zero=True)  # (0, 1]: the log is finite
    u2 = _uniform(seed, 2, c, bits)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)).to(dtype)


def draw(init: str, seed: int, shape: Sequence[int], box: Sequence[Sequence[int]], dtype: torch.dtype,
         device: torch.device | str = "cpu") -> torch.Tensor:
    """The values of `box` of the global tensor of `shape` drawn by `init` ("rand" or "randn") with `seed`."""
    if not dtype.is_floating_point:
        raise NotImplementedError(f"{init} needs a floating point dtype, got {dtype}")
    return (rand if init == "rand" else randn)(seed, Counters(shape, box, device), dtype)
