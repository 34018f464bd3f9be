"""Helpers shared by the worker tests: shard boxes from placements, reassembly, torch references."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch

from dtorch_protocol.layout import coords, shard_box
from dtorch_protocol.placement_types import Placement
from dtorch_worker.store import TensorStore


def boxes_for(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
              devices: Sequence[int] | None = None) -> dict[int, list[list[int]]]:
    """Device id (row-major mesh order unless `devices` renames them) -> [[start, length], ...]."""
    out = {}
    for flat, c in enumerate(coords(tuple(mesh_shape))):
        box = shard_box(tuple(shape), tuple(mesh_shape), tuple(placements), c)
        out[devices[flat] if devices else flat] = [list(b) for b in box]
    return out


def assemble(shards: dict[int, torch.Tensor], boxes: dict[int, list[list[int]]], shape: Sequence[int],
             dtype: torch.dtype) -> torch.Tensor:
    """Put every device's shard at its box in a full tensor (boxes must tile it)."""
    full = torch.full(list(shape), float("nan"), dtype=dtype) if dtype.is_floating_point \
        else torch.zeros(list(shape), dtype=dtype)
    for dev, box in boxes.items():
        view = full
        for d, (start, length) in enumerate(box):
            view = view.narrow(d, start, length)
        view.copy_(shards[dev])
    return full


def shards_of(store: TensorStore, session: str, tid: int, devices: Sequence[int]) -> dict[int, torch.Tensor]:
    return {d: store.get((session, tid, d)) for d in devices}  # type: ignore[misc]


@pytest.fixture
def h() -> SimpleNamespace:
    """The helpers above (tests run with --import-mode=importlib, so they cannot import conftest)."""
    return SimpleNamespace(boxes_for=boxes_for, assemble=assemble, shards_of=shards_of)


class WatchedStore(TensorStore):
    """A store that says when a writer starts to wait for peers' planned reads: a barrier for ordering tests
    (the executor first asks without waiting, then waits with a timeout while reads are pending)."""

    def __init__(self) -> None:
        super().__init__()
        self.writer_waits = threading.Event()

    def wait_reads(self, tensors: list[torch.Tensor], timeout: float) -> list:
        if timeout > 0:
            self.writer_waits.set()
        return super().wait_reads(tensors, timeout)


@pytest.fixture
def watched() -> WatchedStore:
    return WatchedStore()


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # the test machine is small and shared
