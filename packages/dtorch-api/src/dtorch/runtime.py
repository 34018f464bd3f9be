"""The process-wide default session: connect to DTORCH_CONTROLLER, or start an embedded local cluster.

    dtorch.connect("host:50051")     # explicit; otherwise the first DTensor connects lazily
    dtorch.status()                  # workers, sessions, live tensors and bytes per worker
    dtorch.synchronize()             # wait for every op issued so far (raises the first op error)
    dtorch.shutdown()                # also runs at exit
    with dtorch.connect(workers=4) as s: ...   # closed (and its local cluster stopped) when the block ends
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING

from dtorch.errors import ClusterError, env_int
from dtorch.local_cluster import LocalCluster
from dtorch_protocol import messages as m
from dtorch_protocol import wire
from dtorch_protocol.tls import Tls

if TYPE_CHECKING:
    from dtorch.session import Session

_lock = threading.RLock()
_session: Session | None = None


def connect(controller: str | None = None, *, api_key: str | None = None, tls_ca: str | None = None,
            workers: int | None = None, name: str = "", priority: str = "normal", kind: str = "batch",
            memory_cap: int = 0, min_devices: int = 0, expected_steps: int = 0, auto_compile: bool = True) -> Session:
    """Open the default session (closing any previous one).

    `controller` defaults to $DTORCH_CONTROLLER; without either, a local cluster of `workers`
    worker processes (default $DTORCH_LOCAL_WORKERS or 2) is started for this process, with keys of its own.
    `api_key` defaults to $DTORCH_API_KEY; `tls_ca` (default $DTORCH_TLS_CA) is the CA of a cluster that
    runs TLS.
    Scheduling: `priority` "high" | "normal" | "low", `kind` "batch" | "realtime", `memory_cap` bytes per
    device (> 0 lets the controller pack the session onto a device shared with others), `min_devices`
    (> 0: elastic, a mesh starts on as few physical devices as this, as virtual devices), `expected_steps` (> 0:
    how many sync points, values read back such as `loss.item()` once a step, the program will reach: the
    default policy then ranks it by the work it has left rather than the work it has had).
    `auto_compile`: a step that repeats (the ops between two sync points or uploads) is recorded once and then
    replayed (`dtorch.auto_compile`).
    """
    global _session
    with _lock:
        shutdown()
        address = controller or os.environ.get("DTORCH_CONTROLLER")
        tls, cluster = None, None
        if not address:
            n = workers if workers is not None else env_int("DTORCH_LOCAL_WORKERS", 2)
            # its processes start while this one imports the session's modules (torch among them), a few seconds
            cluster = LocalCluster(n, device=os.environ.get("DTORCH_LOCAL_DEVICE", "cpu"), wait=False)
            address, api_key = cluster.address, cluster.api_key
        else:
            tls = Tls.load(ca=tls_ca)
        try:
            from dtorch._capture import AutoSteps
            from dtorch.session import Session

            if cluster is not None:
                cluster.wait()
            _session = Session(address, api_key, tls=tls, name=name, priority=priority, kind=kind,
                               memory_cap=memory_cap, min_devices=min_devices, expected_steps=expected_steps)
        except BaseException:
            if cluster is not None:
                cluster.stop()
            raise
        _session.cluster = cluster
        if auto_compile:
            AutoSteps(_session).arm()
        return _session


def get_session() -> Session:
    with _lock:
        return _session if _session is not None and not _session.closed else connect()


def synchronize() -> None:
    """Wait until the workers have run every op issued so far (ops return at once and run in the background, as on a
    CUDA stream); raises the first op error, naming the op and your source line. Like `torch.cuda.synchronize()`: for
    timing, and to surface errors at a point of your choosing."""
    get_session().sync()


def status() -> m.StatusReply:
    """The controller's view: workers (state, live shards, bytes), sessions and recent events."""
    return get_session().status()


def drain(worker: str, timeout_s: float = 300.0) -> m.AdminReply:
    """Move everything off `worker` (logical devices, copies kept for recovery), then release it.

    Blocks until done (or `timeout_s`); the reply lists each move with its bytes and downtime.
    """
    return _admin("Drain", m.DrainRequest(worker=worker, timeout_s=timeout_s))


def migrate(device: int, to_worker: str, session: str | None = None, timeout_s: float = 300.0) -> m.AdminReply:
    """Move logical `device` of `session` (default: this process's) to `to_worker`, while it runs."""
    s = get_session()
    return _admin("Migrate", m.MigrateRequest(session=session or s.id, device=device, to_worker=to_worker,
                                              timeout_s=timeout_s))


def _admin(method: str, request: m.DrainRequest | m.MigrateRequest) -> m.AdminReply:
    s = get_session()
    try:
        return s.stub.call(method, request, timeout=request.timeout_s + 30.0)
    except wire.RemoteError as e:
        raise ClusterError(str(e).replace(f"{method} on {s.address} failed: ", "")) from None


def shutdown() -> None:
    """Close the default session and stop the local cluster, if this process started one."""
    global _session
    with _lock:
        if _session is not None:
            _session.close()
            _session = None


atexit.register(shutdown)
