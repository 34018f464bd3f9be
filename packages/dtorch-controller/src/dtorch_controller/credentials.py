"""The controller's half of the workers' credentials (see `dtorch_protocol.auth`): what it learned from each
registration, and what it hands out from it.

Rules:

1. A worker registers with its own random secret. The controller keeps it per worker address (the latest
   successful registration there) with the key the worker registered over, and never shows it to anyone.
2. From it come: the execute token (the controller's credential for Execute on that worker), the proof the
   worker puts in its reports (only that process, over that key, may report for that worker id), and the
   capabilities: `client` ones for a session's owner, next to every location the controller tells it, and
   `peer` ones inside the session's Execute batches for each worker address a command names.
3. Clients reach a worker at its client address (its server-TLS port under TLS, else its only address):
   every location a client is told is translated to it.
"""

from __future__ import annotations

import hmac
import re
import threading
from dataclasses import dataclass

import msgspec

from dtorch_protocol import auth
from dtorch_protocol import messages as m
from dtorch_protocol.wire import PermissionDenied, ProtocolError

_SECRET = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class WorkerCredentials:
    worker: str
    address: str
    client_address: str
    secret: str
    key_id: str


def check_secret(secret: str) -> None:
    if not _SECRET.match(secret):
        raise ProtocolError("a worker registers with its secret: 64 hex characters (dtorch-worker 1.4 or newer)")


def peer_addresses(execute: m.Execute) -> set[str]:
    """Every other worker a batch's commands read from or copy to."""
    out: set[str] = set()
    for cmd in execute.cmds:
        if isinstance(cmd, m.CmdRedistribute):
            out.update(p.address for plan in cmd.plans.values() for group in plan.groups for p in group)
        elif isinstance(cmd, m.CmdSendShards):
            out.add(cmd.to)
        elif isinstance(cmd, m.CmdFetchShards):
            out.add(cmd.address)
    out.discard("")
    return out


class Credentials:
    """Thread-safe: handler threads register and read, the effect loop mints."""

    def __init__(self, cap_ttl_s: float = auth.CAP_TTL_S) -> None:
        self.cap_ttl_s = cap_ttl_s
        self._lock = threading.Lock()
        self._by_address: dict[str, WorkerCredentials] = {}
        self._by_worker: dict[str, WorkerCredentials] = {}

    def registered(self, worker: str, request: m.RegisterWorker, key_id: str) -> None:
        creds = WorkerCredentials(worker, request.address, request.client_address or request.address,
                                  request.secret, key_id)
        with self._lock:
            old = self._by_address.get(request.address)
            if old is not None:
                self._by_worker.pop(old.worker, None)
            self._by_address[request.address] = creds
            self._by_worker[worker] = creds

    def execute_token(self, address: str) -> str | None:
        with self._lock:
            creds = self._by_address.get(address)
        return None if creds is None else auth.execute_token(creds.secret)

    def check_report(self, caller: auth.Caller, report: m.WorkerReport) -> None:
        """Refuse a report for a worker that did not come over that worker's key with its proof."""
        with self._lock:
            creds = self._by_worker.get(report.worker)
        if creds is None:
            return  # not registered (any more): the core answers "fenced"
        if caller.key_id != creds.key_id or not hmac.compare_digest(report.proof.encode(),
                                                                    auth.report_proof(creds.secret).encode()):
            raise PermissionDenied(f"Report for worker {report.worker} refused: only the process that registered "
                                   f"it may report for it")

    def client_address(self, address: str) -> str:
        with self._lock:
            creds = self._by_address.get(address)
        return address if creds is None else creds.client_address

    def for_client(self, session: str, locations: dict[int, str], memory_cap: int
                   ) -> tuple[dict[int, str], dict[str, str]]:
        """Locations as the client dials them, and its capability for each of those workers (carrying the
        session's memory cap: the workers hold its uploads to it)."""
        with self._lock:
            known = {a: self._by_address.get(a) for a in set(locations.values())}
        caps: dict[str, str] = {}
        out: dict[int, str] = {}
        for device, address in locations.items():
            creds = known[address]
            if creds is None:
                out[device] = address
                continue
            out[device] = creds.client_address
            if creds.client_address not in caps:
                caps[creds.client_address] = auth.mint(creds.secret, auth.CLIENT, session, self.cap_ttl_s,
                                                       memory_cap=memory_cap)
        return out, caps

    def with_peer_caps(self, execute: m.Execute, own_address: str) -> m.Execute:
        """The batch with a peer capability for its session on every other worker its commands name."""
        peers = peer_addresses(execute) - {own_address}
        if not peers:
            return execute
        session = execute.session
        with self._lock:
            secrets = {a: c.secret for a in peers if (c := self._by_address.get(a)) is not None}
        caps = {a: auth.mint(s, auth.PEER, session, self.cap_ttl_s) for a, s in secrets.items()}
        return msgspec.structs.replace(execute, caps=caps)
