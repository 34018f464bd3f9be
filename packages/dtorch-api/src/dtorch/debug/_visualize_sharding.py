"""`visualize_sharding(dtensor)`: which devices hold which part of a DTensor, printed as torch's is.

A 1-D or 2-D DTensor is a grid of its parts (`Row 0-3` by `Col 0-7`, inclusive, as torch prints them), each cell
naming the devices that hold it (`cpu:0,2`: a replicated mesh dim gives a part several). A tensor of more dims is
one line per part, its box per dim. Partial mesh dims are named in the header: every device there holds a full-size
term of the reduction, not the value. Mesh ids are the session's logical devices.
"""

from __future__ import annotations

from typing import Any

from dtorch._local import boxes
from dtorch._spec import StridedShard


def _parts(dtensor: Any) -> dict[tuple[tuple[int, int], ...], list[int]]:
    """Each part's box ((start, length) per dim) -> the devices that hold it, in mesh order."""
    mesh, placements = dtensor.device_mesh, tuple(dtensor.placements)
    if any(isinstance(p, StridedShard) for p in placements):
        raise ValueError(f"visualize_sharding: a strided shard ({placements}) is not one box per device; "
                         "redistribute to Shard first")
    parts: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for device, box in zip(mesh.devices, boxes(mesh, placements, dtensor.shape)):
        parts.setdefault(box, []).append(device)
    return parts


def _span(start: int, length: int) -> str:
    return f"{start}-{start + length - 1}" if length else f"{start} (empty)"


def _grid(parts: dict, kind: str) -> list[str]:
    boxes = {((0, 1),) * (2 - len(box)) + box: devices for box, devices in parts.items()}  # 0-D and 1-D: one row
    rows, cols = sorted({b[0] for b in boxes}), sorted({b[1] for b in boxes})
    table = [[""] + [f"Col {_span(*c)}" for c in cols]]
    for r in rows:
        table.append([f"Row {_span(*r)}"] + [f"{kind}:" + ",".join(map(str, boxes[(r, c)])) if (r, c) in boxes
                                             else "" for c in cols])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    return [lines[0], "  ".join("-" * w for w in widths), *lines[1:]]


def visualize_sharding(dtensor: Any, header: str = "", use_rich: bool = False) -> None:
    """Print which devices hold which part of `dtensor` (torch's `visualize_sharding`; `use_rich` is accepted and
    the output is plain text either way)."""
    print("\n".join(render(dtensor, header)))


def render(dtensor: Any, header: str = "") -> list[str]:
    """The lines `visualize_sharding` prints."""
    if dtensor.numel() == 0:
        return [header, "(empty)"] if header else ["(empty)"]
    parts, kind = _parts(dtensor), dtensor.device_mesh.device_type
    partial = [f"mesh dim {i}: {p}" for i, p in enumerate(dtensor.placements) if p.is_partial()]
    lines = [header] if header else []
    if partial:
        lines.append(f"partial values (each device holds a full-size term of the reduction) on {', '.join(partial)}")
    if dtensor.dim() <= 2:
        return lines + _grid(parts, kind)
    return lines + [f"{kind}:" + ",".join(map(str, devices)) + ": " + " x ".join(f"[{_span(*b)}]" for b in box)
                    for box, devices in sorted(parts.items())]
