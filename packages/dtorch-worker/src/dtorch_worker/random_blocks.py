"""Random factories in O(shard): the global tensor is cut into fixed blocks, each drawn from its own seed.

A device draws only the blocks that overlap its box, so a factory costs O(shard) per device in time and
memory (up to the blocks' edges), and the values never depend on the mesh or the placements (issue #12 item 4).

Rules:
  1. Blocks tile the global shape. Block sizes are chosen from the last dim to the first, within a budget of
     BLOCK elements: the last two dims (where tensor parallelism cuts weights) take at most EDGE each, earlier
     dims take what the budget leaves, at least 1. A 1-d tensor takes BLOCK elements a block.
  2. Block b (its index in the row-major grid of blocks) is drawn whole (clipped to the tensor) by
     `torch.rand`/`torch.randn` on a CPU generator seeded with splitmix64(splitmix64(seed) + b): the values
     depend on (seed, shape, dtype) only, never on the device type.
  3. A device's box takes, from each block it overlaps, the intersection.
Values differ from `torch.rand(generator=...)` on the whole tensor: they are DTorch's, the same on every layout.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

BLOCK = 1 << 16  # elements per block, at most
EDGE = 256  # block size along each of the last two dims, at most
_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def block_shape(shape: Sequence[int]) -> list[int]:
    """The block size along each dim (rule 1)."""
    out = [1] * len(shape)
    budget = BLOCK
    for d in reversed(range(len(shape))):
        cap = EDGE if len(shape) >= 2 and d >= len(shape) - 2 else budget
        out[d] = max(1, min(shape[d], cap, budget))
        budget = max(1, budget // out[d])
    return out


def draw(init: str, seed: int, shape: Sequence[int], box: Sequence[Sequence[int]], dtype: torch.dtype
         ) -> torch.Tensor:
    """The values of `box` ([[start, length], ...] per dim) of the global tensor of `shape` drawn by `init`
    ("rand" or "randn") with `seed` (rules 2-3), on the CPU."""
    if not dtype.is_floating_point:
        raise NotImplementedError(f"{init} needs a floating point dtype, got {dtype}")
    maker = torch.rand if init == "rand" else torch.randn
    out = torch.empty([b[1] for b in box], dtype=dtype)
    if out.numel() == 0:
        return out
    size = block_shape(shape)
    grid = [math.ceil(n / s) for n, s in zip(shape, size)]
    key = _splitmix64(seed & _M64)
    ranges = [range(start // s, (start + length - 1) // s + 1) for (start, length), s in zip(box, size)]
    for block in itertools.product(*ranges):
        index = 0
        for b, g in zip(block, grid):
            index = index * g + b
        lo = [b * s for b, s in zip(block, size)]
        extent = [min(s, n - low) for s, n, low in zip(size, shape, lo)]
        values = maker(extent, generator=torch.Generator().manual_seed(_splitmix64((key + index) & _M64) >> 1),
                       dtype=dtype)
        src, dst = values, out
        for d, ((start, length), low, ext) in enumerate(zip(box, lo, extent)):
            a, b = max(start, low), min(start + length, low + ext)
            src, dst = src.narrow(d, a - low, b - a), dst.narrow(d, a - start, b - a)
        dst.copy_(src)
    return out
