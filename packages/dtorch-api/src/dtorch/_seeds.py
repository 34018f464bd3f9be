"""A session's random stream: seeds for random factories and ops, reproducible from `dtorch.manual_seed`.

Seed n of stream s is splitmix64(s, n): values never depend on the mesh, the placements or the plan.
"""

from __future__ import annotations

_MASK = 2**64 - 1


class Seeds:
    def __init__(self, seed: int = 0) -> None:
        self.reset(seed)

    def reset(self, seed: int) -> None:
        self._seed, self._counter = int(seed), 0

    def next(self) -> int:
        self._counter += 1
        z = (self._seed * 0x9E3779B97F4A7C15 + self._counter * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 30)) * 0x94D049BB133111EB) & _MASK
        return (z ^ (z >> 31)) & (2**63 - 1)
