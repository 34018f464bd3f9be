"""Status: what the controller knows, as one StatusReply (dtorch-controller status, the client's relocation).

Rules: read only; per worker its state, leases and memory (copies kept for recovery apart), per session its
schedule, binding and protection (last snapshot, batches a recovery would replay), the policy and the queue.
"""

from __future__ import annotations

from dtorch_controller.core.eventlog import EventLog
from dtorch_controller.core.model import Cluster
from dtorch_controller.core.recovery import Recovery
from dtorch_controller.core.scheduler import Scheduler
from dtorch_protocol import messages as m


def status(now: float, cluster: Cluster, sched: Scheduler, recovery: Recovery, log: EventLog) -> m.StatusReply:
    bound: dict[str, list[str]] = {}
    for s in cluster.sessions.values():
        for d, worker_id in sorted(s.devices.items()):
            bound.setdefault(worker_id, []).append(f"{s.id}:{d}")
    pool, tenants = sched.pool.slots, sched.tenants
    workers = []
    for w in sorted(cluster.workers.values(), key=lambda w: w.order):
        copies = [v for k, v in w.stats.items() if "#" in k]  # namespaces derived from a session: its copies
        workers.append(m.WorkerStatus(
            worker=w.id, address=w.address, state=w.state, device_type=w.device_type, memory_bytes=w.memory_bytes,
            labels=dict(w.labels), tensors=w.tensors - sum(v.tensors for v in copies),
            bytes=w.bytes - sum(v.bytes for v in copies), devices=bound.get(w.id, []),
            utilization=w.utilization, backup_bytes=sum(v.bytes for v in copies),
            node=pool[w.id].node if w.id in pool else "", leases=dict(pool[w.id].leases) if w.id in pool else {}))
    sessions = [recovery.session_status(m.SessionStatus(
        session=s.id, name=s.name, priority=s.priority, state=s.state, devices=dict(sorted(s.devices.items())),
        tensors=len(s.tensors), queue_position=sched.position(s.id), kind=s.kind, schedule=sched.state(s.id),
        memory_cap=tenants[s.id].cap, attained_s=tenants[s.id].service(now)))
        for s in sorted(cluster.sessions.values(), key=lambda s: s.opened_at)]
    return m.StatusReply(workers=workers, sessions=sessions, events=log.lines(), policy=sched.policy.describe(),
                         queued=sched.queued)
