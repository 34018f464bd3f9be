"""Who is calling, and what each caller may call: API keys, capabilities and the per-method role tables.

Rules:

1. Every call carries one credential in the `authorization` metadata ("Bearer <credential>"). A call with
   none, an empty one or an unknown one is refused before its request is even decoded. Nothing is ever open.
2. The controller's callers hold **API keys** (`dtorch_<id>_<secret>`), issued by `dtorch-controller keys
   create` and stored hashed (SHA-256 of the secret: keys are 256-bit random, so no slow hash is needed).
   A key has one role: `tenant` (its tenant's sessions), `admin` (everything, incl. drain, migrate, every
   session in Status) or `worker` (Register, Report).
3. A worker's callers hold credentials derived from the worker's own random secret, which it hands to
   the controller when it registers, and which nobody else ever learns:
   * the controller's **execute token** (Execute only);
   * **capabilities** the controller mints per (session, worker):
     `cap2.<role>.<session>.<expiry>.<memory cap>.<mac>`, an HMAC over role, session, expiry and the session's
     memory cap in bytes per device, checked by the worker with no round trip. The cap rides in the
     capability so that a packed session's uploads are held to it before the worker has run any of its
     batches (an Execute carries it too). A session without a cap gets `cap1.<role>.<session>.<expiry>.<mac>`,
     the form of protocol 1.8, which a 1.8 client still reads the expiry of. Role `client`
     (given to the session's owner: Pull, Put, Profile of its own session) or `peer` (put by the controller into the
     session's Execute batches for the workers they name: Pull, PullShards, PutShards of the session and of
     its backup namespaces `{session}#...`). A capability is scoped to one worker, since the MAC is keyed
     with that worker's secret: a compromised worker can mint capabilities for itself only.
4. `ROLES` below says which roles may call which method. `CLUSTER_ROLES` (workers, the controller, peers)
   must also come over mutual TLS when the server runs TLS: their calls are accepted only on the port
   that requires a client certificate signed by the cluster CA.
5. Secrets are compared in constant time (`hmac.compare_digest`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
import time
from dataclasses import dataclass

HEADER = "authorization"
KEY_PREFIX = "dtorch"
CAP_VERSION = "cap2"
CAP_V1 = "cap1"  # without a memory cap (and the only form of protocol 1.8)
EXECUTE_VERSION = "ctl1"
CAP_TTL_S = 3600  # a capability is good for an hour; the controller hands out fresh ones with every location

TENANT, ADMIN, WORKER = "tenant", "admin", "worker"  # API key roles
CONTROLLER, CLIENT, PEER = "controller", "client", "peer"  # roles proven by a worker's derived credentials
KEY_ROLES = (TENANT, ADMIN, WORKER)
USERS = frozenset({TENANT, ADMIN})
ANY_NODE = "*"  # a worker key's node meaning "its workers name their own node" (`keys create --node '*'`)

ROLES: dict[str, dict[str, frozenset[str]]] = {
    "dtorch.Controller": {
        "OpenSession": USERS,
        "OpenMesh": USERS,
        "Submit": USERS,
        "Sync": USERS,
        "CloseSession": USERS,
        "KeepAlive": USERS,
        "Status": USERS,
        "Register": frozenset({WORKER}),
        "Report": frozenset({WORKER}),
        "Drain": frozenset({ADMIN}),
        "Migrate": frozenset({ADMIN}),
    },
    "dtorch.Worker": {
        "Execute": frozenset({CONTROLLER}),
        "Pull": frozenset({CLIENT, PEER}),
        "Put": frozenset({CLIENT}),
        "PullShards": frozenset({PEER}),
        "PutShards": frozenset({PEER}),
        "Profile": frozenset({CLIENT}),  # and only of the capability's own session (worker server.py)
    },
}
CLUSTER_ROLES = frozenset({WORKER, CONTROLLER, PEER})

_KEY_RE = re.compile(rf"{KEY_PREFIX}_([0-9a-f]{{8}})_([A-Za-z0-9_-]{{43}})")  # whole keys only: fullmatch


class Unauthenticated(Exception):
    """No credential, or one nobody issued (or revoked); str() is the one-line reason."""


@dataclass(frozen=True)
class Caller:
    """An authenticated caller. `name`: the tenant (tenant and admin keys), the session (capabilities)."""

    role: str
    name: str = ""
    key_id: str = ""  # API keys: the key's id (workers must Report over the key they registered with)
    node: str = ""  # worker keys: the node the admin assigned to the key ("" = none; ANY_NODE: the worker's own)
    mtls: bool = False  # the call came with a client certificate the server verified
    memory_cap: int = 0  # capabilities: the session's memory cap in bytes per device they carry (0: none)

    def describe(self) -> str:
        if self.role in (TENANT, ADMIN):
            return f"{self.role} {self.name!r} (key {self.key_id})"
        if self.role in (CLIENT, PEER):
            return f"a {self.role} capability for session {self.name[:8]}"
        return f"the {self.role} credential" + (f" (key {self.key_id})" if self.key_id else "")


def bearer(credential: str) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `credential`."""
    return ((HEADER, f"Bearer {credential}"),)


def credential_of(metadata: object) -> str:
    """The credential in a call's metadata; raises Unauthenticated when there is none or it is empty."""
    for key, value in metadata:  # type: ignore[attr-defined]
        if key == HEADER:
            scheme, _, credential = str(value).partition(" ")
            if scheme != "Bearer" or not credential.strip():
                raise Unauthenticated("empty credential: expected 'authorization: Bearer <key>'")
            return credential.strip()
    raise Unauthenticated("no credential: set DTORCH_API_KEY to a key from `dtorch-controller keys create`")


# ---------------------------------------------------------------- API keys


def new_key() -> tuple[str, str]:
    """A fresh API key: (key id, the full key to hand out once)."""
    key_id = secrets.token_hex(4)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    return key_id, f"{KEY_PREFIX}_{key_id}_{secret}"


def parse_key(key: str) -> tuple[str, str]:
    """(key id, secret) of a well-formed API key; raises Unauthenticated otherwise."""
    match = _KEY_RE.fullmatch(key)  # `$` would accept a trailing newline
    if match is None:
        raise Unauthenticated("malformed API key (expected dtorch_<id>_<secret>)")
    return match.group(1), match.group(2)


def key_hash(key: str) -> str:
    """What the key file stores: the SHA-256 of the key's secret part."""
    return hashlib.sha256(parse_key(key)[1].encode()).hexdigest()


def key_from_env() -> str:
    return os.environ.get("DTORCH_API_KEY", "").strip()


# ---------------------------------------------------------------- a worker's derived credentials


def new_worker_secret() -> str:
    return secrets.token_hex(32)


def _mac(secret: str, *parts: str) -> str:
    return hmac.new(bytes.fromhex(secret), "|".join(parts).encode(), hashlib.sha256).hexdigest()


def execute_token(secret: str) -> str:
    """The controller's credential for Execute on the worker holding `secret`."""
    return f"{EXECUTE_VERSION}.{_mac(secret, EXECUTE_VERSION, 'execute')}"


def report_proof(secret: str) -> str:
    """What a worker puts in its reports: proof it is the process that registered with `secret`."""
    return _mac(secret, "report")


def mint(secret: str, role: str, session: str, ttl_s: float = CAP_TTL_S, now: float | None = None,
         memory_cap: int = 0) -> str:
    """A capability for `session` on the worker holding `secret`, for `role` (client | peer), carrying the
    session's memory cap in bytes per device (0: none)."""
    if role not in (CLIENT, PEER) or "." in session or not session or memory_cap < 0:
        raise ValueError(f"cannot mint a {role!r} capability for session {session!r} with cap {memory_cap}")
    expires = str(int((time.time() if now is None else now) + ttl_s))
    fields = (CAP_VERSION, role, session, expires, str(memory_cap)) if memory_cap else (CAP_V1, role, session, expires)
    return ".".join(fields) + "." + _mac(secret, *fields)


def cap_expiry(cap: str) -> int:
    """When a capability expires (unix seconds), without checking it; 0 when it is malformed."""
    parts = cap.split(".")
    return int(parts[3]) if len(parts) in (5, 6) and parts[3].isdigit() else 0


class WorkerAuth:
    """Checks the credentials presented to one worker, against that worker's own secret."""

    def __init__(self, secret: str | None = None) -> None:
        self.secret = secret or new_worker_secret()
        self._execute = execute_token(self.secret)

    def authenticate(self, credential: str, now: float | None = None) -> Caller:
        if credential.startswith(EXECUTE_VERSION + "."):
            if hmac.compare_digest(credential.encode(), self._execute.encode()):
                return Caller(CONTROLLER)
            raise Unauthenticated("wrong execute token: Execute is accepted only from this worker's controller")
        *fields, mac = credential.split(".")
        version = {5: CAP_VERSION, 4: CAP_V1}.get(len(fields))
        if version is None or fields[0] != version or fields[1] not in (CLIENT, PEER) \
                or not all(f.isascii() and f.isdigit() for f in fields[3:]):
            raise Unauthenticated("not a capability for this worker (ask the controller for the session's "
                                  "locations again)")
        if not hmac.compare_digest(mac.encode(), _mac(self.secret, *fields).encode()):
            raise Unauthenticated("capability refused: not issued for this worker")
        role, session, expires = fields[1:4]
        if int(expires) < (time.time() if now is None else now):
            raise Unauthenticated(f"capability for session {session[:8]} expired")
        return Caller(role, name=session, memory_cap=int(fields[4]) if len(fields) == 5 else 0)


def covers(caller: Caller, session: str) -> bool:
    """Whether `caller`'s capability reaches `session`: its own, or (peers) one of its backup namespaces."""
    if session == caller.name:
        return True
    return caller.role == PEER and session.startswith(caller.name + "#")
