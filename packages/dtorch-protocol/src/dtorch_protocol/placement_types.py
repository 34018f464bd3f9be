"""Placements: how one mesh dimension lays out a tensor (names as in torch.distributed.tensor).

Torch-free, so the controller and the simulator can reason about layouts without
importing torch. Each placement has a compact wire form (`"S0"`, `"R"`, `"Psum"`).
"""

from __future__ import annotations

from dataclasses import dataclass

REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base class: one entry per mesh dimension."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False

    def to_wire(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Shard(Placement):
    """Split tensor dim `dim` across the mesh dimension, `torch.chunk` style (last chunks may be short or empty)."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard(dim) needs an int dim, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def to_wire(self) -> str:
        return f"S{self.dim}"

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every device along the mesh dimension holds the whole (sub)tensor."""

    def is_replicate(self) -> bool:
        return True

    def to_wire(self) -> str:
        return "R"

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Each device holds a partial value; the tensor is their reduction (`reduce_op`)."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"Partial reduce_op must be one of {', '.join(REDUCE_OPS)}, got {self.reduce_op!r}")

    def is_partial(self) -> bool:
        return True

    def to_wire(self) -> str:
        return f"P{self.reduce_op}"

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"


# (kind of the source placement, kind of the destination placement) on one mesh dim -> what changing it takes: the
# collective the controller lowers it to (`dtorch_controller.core.collectives`, which `dtorch.debug.CommDebugMode`
# counts), or a local slice. Kinds: "S" shard, "P" partial, "R" replicate; a change to a Partial is none of these.
MOVES: dict[tuple[str, str], str] = {
    ("S", "R"): "all_gather",
    ("S", "S"): "all_to_all",
    ("R", "S"): "slice",
    ("P", "R"): "all_reduce",
    ("P", "S"): "reduce_scatter",
}


def move(src: Placement, dst: Placement) -> str | None:
    """What `src` -> `dst` on one mesh dim takes (table MOVES), None for a change to a Partial."""
    return MOVES.get((_kind(src), _kind(dst)))


def _kind(p: Placement) -> str:
    return "S" if p.is_shard() else "P" if p.is_partial() else "R"


_REPLICATE = Replicate()


def placement_from_wire(text: str) -> Placement:
    """Inverse of `Placement.to_wire`; raises ValueError naming the bad text."""
    if text == "R":
        return _REPLICATE
    if text.startswith("S") and text[1:].isdigit():
        return Shard(int(text[1:]))
    if text.startswith("P") and text[1:] in REDUCE_OPS:
        return Partial(text[1:])
    raise ValueError(f"bad placement {text!r}: expected 'R', 'S<dim>' or 'P<sum|avg|max|min>'")
