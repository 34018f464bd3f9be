"""Tenants: who may name a session, and the quotas checked when a session or a mesh is asked for. Read only.

Rules:

1. A session belongs to the tenant that opened it (`Session.tenant`, from `event.who`). Only that tenant may name
   it; in-process callers the adapter is not between (`events.OPERATOR`: the simulator, tests) own every session.
2. Quotas (`events.Quota`, 0 = no limit) count a tenant's open sessions, the logical devices they hold and the
   device memory their leases take (a session's declared memory cap per device). They are checked when a session
   or a mesh is asked for, never later: what was granted stays granted. A refusal names the quota.
"""

from __future__ import annotations

from dtorch_controller.core import events as ev
from dtorch_controller.core.model import Cluster, Session
from dtorch_controller.core.scheduler import Scheduler


def owns(who: ev.Principal, s: Session) -> bool:
    """Whether `who` may name session `s` (rule 1)."""
    return who is ev.OPERATOR or s.tenant == who.tenant


def sessions_of(cluster: Cluster, tenant: str) -> list[Session]:
    return [s for s in cluster.sessions.values() if s.tenant == tenant]


def session_quota(cluster: Cluster, who: ev.Principal, memory_cap: int) -> str | None:
    """Why `who` may not open one more session with `memory_cap`, or None (rule 2)."""
    q = who.quota
    if q.memory_bytes and not memory_cap:
        return (f"quota: tenant {who.tenant!r} may lease {q.memory_bytes} bytes of device memory (quota "
                "memory_bytes): open sessions with memory_cap (bytes per device), not whole devices")
    if q.sessions and (n := len(sessions_of(cluster, who.tenant))) >= q.sessions:
        return f"quota: tenant {who.tenant!r} has {n} sessions open, its quota (sessions) is {q.sessions}"
    return None


def device_quota(cluster: Cluster, sched: Scheduler, who: ev.Principal, s: Session, new: int) -> str | None:
    """Why `who`'s session `s` may not ask for `new` more logical devices, or None (rule 2)."""
    q = who.quota
    if not (q.devices or q.memory_bytes):
        return None
    mine = sessions_of(cluster, who.tenant)
    held = sum(len(t.devices) for t in mine)
    if q.devices and held + new > q.devices:
        return (f"quota: tenant {who.tenant!r} may hold {q.devices} logical devices (quota devices); it holds "
                f"{held} and this mesh asks for {new} more")
    caps = {t.id: sched.tenants[t.id].cap for t in mine}
    leased = sum(caps[t.id] * len(t.devices) for t in mine)
    if q.memory_bytes and leased + caps[s.id] * new > q.memory_bytes:
        return (f"quota: tenant {who.tenant!r} may lease {q.memory_bytes} bytes of device memory (quota "
                f"memory_bytes); it leases {leased} and this mesh asks for {caps[s.id] * new} more")
    return None
