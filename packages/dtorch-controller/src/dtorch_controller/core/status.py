"""Status: what the controller knows, as one StatusReply (dtorch-controller status, the client's relocation).

Rules: read only; per worker its state, leases and memory (copies kept for recovery apart), per session its
schedule, binding and protection (last snapshot, batches a recovery would replay), the policy and the queue.
An admin sees all of it; a tenant sees its own sessions, the workers they use with only its own shards and
leases, no event lines (they name everyone's sessions), and everyone else's work as anonymous counts.
"""

from __future__ import annotations

import msgspec

from dtorch_controller.core import events as ev
from dtorch_controller.core.eventlog import EventLog
from dtorch_controller.core.model import Cluster
from dtorch_controller.core.recovery import Recovery
from dtorch_controller.core.scheduler import Scheduler
from dtorch_controller.core.tenancy import sessions_of
from dtorch_protocol import messages as m


def status(now: float, cluster: Cluster, sched: Scheduler, recovery: Recovery, log: EventLog,
           who: ev.Principal = ev.OPERATOR) -> m.StatusReply:
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
            utilization=w.utilization, backup_bytes=sum(v.bytes for v in copies), received_bytes=w.received_bytes,
            node=pool[w.id].node if w.id in pool else "", leases=dict(pool[w.id].leases) if w.id in pool else {}))
    sessions = [recovery.session_status(m.SessionStatus(
        session=s.id, name=s.name, priority=s.priority, state=s.state, tenant=s.tenant,
        devices=dict(sorted(s.devices.items())), tensors=len(s.tensors), queue_position=sched.position(s.id),
        kind=s.kind, schedule=sched.state(s.id), memory_cap=s.memory_cap, attained_s=tenants[s.id].service(now),
        batches=s.seq))
        for s in sorted(cluster.sessions.values(), key=lambda s: s.opened_at)]
    reply = m.StatusReply(workers=workers, sessions=sessions, events=log.lines(), policy=sched.policy.describe(),
                          queued=sched.queued)
    return reply if who.admin else _tenant_view(cluster, reply, who.tenant)


def _tenant_view(cluster: Cluster, reply: m.StatusReply, tenant: str) -> m.StatusReply:
    """What a tenant may see of `reply` (the rules above)."""
    mine = {s.id: s for s in sessions_of(cluster, tenant)}
    used = {w for s in mine.values() for w in s.devices.values()}
    workers = []
    for ws in reply.workers:
        if ws.worker not in used:
            continue
        own = [x for sid, x in cluster.workers[ws.worker].stats.items() if sid in mine]
        workers.append(msgspec.structs.replace(
            ws, tensors=sum(x.tensors for x in own), bytes=sum(x.bytes for x in own), utilization=-1.0,
            backup_bytes=0, received_bytes=0, devices=[d for d in ws.devices if d.partition(":")[0] in mine],
            leases={sid: cap for sid, cap in ws.leases.items() if sid in mine}))
    others = [s for s in cluster.sessions.values() if s.id not in mine]
    return msgspec.structs.replace(
        reply, workers=workers, sessions=[s for s in reply.sessions if s.session in mine], events=[],
        other_sessions=len(others), other_devices=sum(len(s.devices) for s in others),
        other_workers=len(reply.workers) - len(workers))
