"""Admission: the controller places a mesh's logical devices on workers, or queues the request.

`place` asks (`OpenMesh`) until the mesh is placed or DTORCH_QUEUE_TIMEOUT passes, rewriting one stderr line
with the queue position meanwhile, and returns where each logical device went, with the session's capability
for each of those workers.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import IO, Any

from dtorch import _source
from dtorch._progress import Line
from dtorch.errors import ClusterError, env_float
from dtorch_protocol import messages as m

POLL_S = 0.2


def place(call: Callable[[str, Any, float], Any], session: str, mesh: Any, min_devices: int,
          out: IO[str] | None = None) -> tuple[dict[int, str], dict[str, str]]:
    """Place `mesh` (a DeviceMesh) for `session`; `min_devices` > 0 accepts that few physical devices (elastic)."""
    line = Line(out)
    deadline = time.monotonic() + env_float("DTORCH_QUEUE_TIMEOUT", 600.0)
    while True:
        reply = call("OpenMesh", m.OpenMesh(session=session, mesh=mesh.id, devices=list(mesh.devices),
                                            shape=list(mesh.shape), min_devices=min_devices), 30.0)
        if reply.placed:
            break
        if time.monotonic() > deadline:
            raise ClusterError(f"{mesh} could not be placed: {reply.message or 'no free devices'}")
        line.show(f"dtorch: waiting for {mesh.size()} devices ({reply.message or 'queued'}); "
                  f"position {reply.queue_position} in the queue")
        time.sleep(POLL_S)
    line.end("dtorch: devices placed")
    other = sorted({t for t in reply.device_types.values() if t != mesh.device_type})
    if other:  # the controller places logical devices on any worker: the mesh's type is the client's to check
        warnings.warn(f"dtorch: {mesh} was placed on {' and '.join(other)} workers: this cluster gave no "
                      f"{mesh.device_type} device for it, and its shards live and run there", RuntimeWarning,
                      stacklevel=_source.stacklevel())
    return dict(reply.locations), dict(reply.caps)
