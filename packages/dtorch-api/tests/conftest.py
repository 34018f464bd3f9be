"""Helpers shared by the client's unit tests (no cluster, no processes): meshes, specs, and a recording
controller for the instruction stream."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from dtorch._spec import Spec, contiguous_stride
from dtorch.device_mesh import DeviceMesh
from dtorch_protocol import messages as m
from dtorch_protocol.placement_types import Placement, Replicate


@pytest.fixture
def mesh2() -> DeviceMesh:
    return DeviceMesh("cpu", [0, 1])


@pytest.fixture
def spec() -> Callable[..., Spec]:
    """spec(shape, placements, mesh, dtype=float32): a contiguous Spec."""

    def make(shape: Sequence[int], placements: Sequence[Placement] | None, mesh: DeviceMesh,
             dtype: torch.dtype = torch.float32) -> Spec:
        shape = tuple(shape)
        placements = tuple(placements) if placements is not None else (Replicate(),) * mesh.ndim
        return Spec(mesh, placements, shape, contiguous_stride(shape), dtype)

    return make


class RecordingController:
    """Stands in for the controller's stub (`call(method, request, timeout)`): records every request and
    answers Sync with the scripted replies (the last one repeats); `fail` makes calls of a method raise."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.sync_replies: list[m.SyncReply] = [m.SyncReply(done=True)]
        self.fail: dict[str, Exception] = {}
        self.changed = threading.Condition()

    def __call__(self, method: str, request: Any, timeout: float) -> Any:
        with self.changed:
            self.calls.append((method, request))
            self.changed.notify_all()
        if method in self.fail:
            raise self.fail[method]
        if method == "Submit":
            return m.SubmitReply(accepted=request.seq)
        if method == "Sync":
            return self.sync_replies.pop(0) if len(self.sync_replies) > 1 else self.sync_replies[0]
        if method == "KeepAlive":
            return m.KeepAliveReply()
        return None

    def requests(self, method: str) -> list[Any]:
        with self.changed:
            return [r for name, r in self.calls if name == method]

    def wait_for(self, method: str, n: int = 1, timeout: float = 10.0) -> list[Any]:
        """The first `n` requests of `method`, waiting (bounded) for the sender thread to make them."""
        with self.changed:
            self.changed.wait_for(lambda: sum(name == method for name, _ in self.calls) >= n, timeout)
        got = self.requests(method)
        assert len(got) >= n, f"{len(got)} {method} calls after {timeout} s, expected {n}"
        return got[:n]


@pytest.fixture
def controller() -> RecordingController:
    return RecordingController()
