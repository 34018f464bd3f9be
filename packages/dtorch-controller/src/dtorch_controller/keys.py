"""The key file: API keys (stored hashed), their roles, and each tenant's quotas.

Rules:

1. One JSON file, written by `dtorch-controller keys ...` (mode 0600, replaced atomically) and read by the
   controller at start: a missing, unreadable or malformed file is a fatal error there, never "open".
2. A key is shown once, when created; the file keeps the SHA-256 of its secret, its id, role, tenant (tenant
   and admin keys) and node (worker keys: the node label the controller gives every worker registering with
   it, whatever the worker claims; `*`: each worker's own `node` label, for workers whose node an orchestrator
   names, such as Kubernetes' downward API). Revoking marks the key; it never comes back.
3. A tenant's quotas (`keys quota`): devices its sessions may hold at once, device memory it may lease,
   sessions it may have open. 0 = no limit.
4. The running controller re-reads the file when it changes (checked at most once a second), so a
   revocation or a new quota takes effect without a restart; if the new content is unusable it keeps the
   last good one and logs why.
5. Names are labels (`NAMES`): a tenant is 1-63 letters, digits, `.`, `_` or `-`, starting with a letter or digit
   (it is a Prometheus label, a usage record's field, a column of `keys list`); a node as long as a Kubernetes
   node name (253), or `*`. `admin` is the admin keys' tenant and no tenant key's: whatever isolates tenants
   compares their names.
6. `keys list` (`listing`) is one line per key in the columns of `LIST_COLUMNS`, each as wide as its longest value
   and two spaces apart (fixed widths glued a 20-letter tenant to the node column), then one line per quota. It
   never shows a key's hash, and cannot show the key, which is not stored.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from dtorch_controller.core.events import Quota
from dtorch_protocol import auth

log = logging.getLogger("dtorch_controller.keys")

FILE_VERSION = 1
RELOAD_EVERY_S = 1.0


NAMES = {  # what a name is -> (its pattern, the rule said in an error)
    "tenant": (re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"),
               "1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"),
    "node": (re.compile(r"\*|[A-Za-z0-9][A-Za-z0-9._-]{0,252}"),
             "'*' or 1-253 letters, digits, '.', '_' or '-', starting with a letter or digit"),
}


def check_name(what: str, name: str) -> None:
    pattern, rule = NAMES[what]
    if not pattern.fullmatch(name):
        raise ValueError(f"{what} name {name!r} must be {rule}")


class KeyFileError(Exception):
    """The key file cannot be used; str() is one line naming the file and what is wrong."""


@dataclass
class KeyEntry:
    id: str
    role: str
    sha256: str
    tenant: str = ""
    node: str = ""
    created: str = ""
    revoked: str = ""


# `keys list`: column -> what it shows of a key ('-': nothing)
LIST_COLUMNS = {
    "ID": lambda k: k.id,  # what `keys revoke` takes, and what the controller's logs name
    "ROLE": lambda k: k.role,
    "TENANT": lambda k: k.tenant or "-",
    "NODE": lambda k: k.node or "-",  # worker keys: the node label their workers get
    "CREATED": lambda k: k.created.replace("T", " ") or "-",  # UTC
    "STATE": lambda k: f"revoked {k.revoked.replace('T', ' ')}" if k.revoked else "active",
}


def listing(kf: KeyFile) -> list[str]:
    """The lines of `keys list` (rule 6)."""
    rows = [list(LIST_COLUMNS)] + [[str(show(k)) for show in LIST_COLUMNS.values()] for k in kf.keys]
    widths = [max(len(row[i]) for row in rows) for i in range(len(LIST_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if not kf.keys:
        lines.append("(no keys: `dtorch-controller keys create` makes one)")
    for tenant, q in sorted(kf.quotas.items()):
        lines.append(f"quota {tenant}: devices {q.devices or 'any'}, memory {q.memory_bytes or 'any'} bytes, "
                     f"sessions {q.sessions or 'any'}")
    return lines


@dataclass
class _Content:
    """The file's JSON, as msgspec decodes it (each field of its type, or the error names where it is not)."""

    version: int
    keys: list[KeyEntry] = field(default_factory=list)
    quotas: dict[str, Quota] = field(default_factory=dict)


@dataclass
class KeyFile:
    keys: list[KeyEntry] = field(default_factory=list)
    quotas: dict[str, Quota] = field(default_factory=dict)

    # ------------------------------------------------------------ reading and writing

    @classmethod
    def read(cls, path: str | Path) -> KeyFile:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise KeyFileError(f"no key file at {path}: create keys with `dtorch-controller keys create --keys "
                               f"{path} ...`") from None
        except OSError as e:
            raise KeyFileError(f"cannot read the key file {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise KeyFileError(f"the key file {path} is not valid JSON: {e}") from None
        try:
            if not isinstance(raw, dict) or raw.get("version") != FILE_VERSION:
                raise ValueError(f"version {raw.get('version') if isinstance(raw, dict) else None!r}, expected "
                                 f"{FILE_VERSION}")
            content = msgspec.convert(raw, _Content)  # typed: "Expected `str`, got `int` - at `$.keys[0].id`"
            for k in content.keys:
                if k.role not in auth.KEY_ROLES:
                    raise ValueError(f"key {k.id} has role {k.role!r}, expected one of {auth.KEY_ROLES}")
                # names as `keys create` makes them: a hand-edited escape code reached the terminal of `keys list`
                for what, name in (("tenant", k.tenant), ("node", k.node)):
                    if name:
                        check_name(what, name)
            for tenant in content.quotas:
                check_name("tenant", tenant)
        except (ValueError, msgspec.ValidationError) as e:
            raise KeyFileError(f"the key file {path} is malformed: {e}") from None
        return cls(content.keys, content.quotas)

    def write(self, path: str | Path) -> None:
        target = Path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        data = {"version": FILE_VERSION, "keys": [asdict(k) for k in self.keys],
                "quotas": {t: asdict(q) for t, q in sorted(self.quotas.items())}}
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.write("\n")
            os.replace(tmp, target)
        except OSError as e:  # it named the temporary file ("No such file or directory: '/x/.keys.json.123.tmp'")
            tmp.unlink(missing_ok=True)
            raise KeyFileError(f"cannot write the key file {path}: {e.strerror or e}") from None

    @classmethod
    def read_or_new(cls, path: str | Path) -> KeyFile:
        return cls.read(path) if Path(path).exists() else cls()

    # ------------------------------------------------------------ edits (`dtorch-controller keys ...`)

    def create(self, role: str, tenant: str = "", node: str = "") -> tuple[KeyEntry, str]:
        """A new key; returns its entry and the key itself (shown once, never stored)."""
        if role not in auth.KEY_ROLES:
            raise ValueError(f"unknown role {role!r}: expected one of {', '.join(auth.KEY_ROLES)}")
        if role == auth.TENANT and not tenant:
            raise ValueError("a tenant key needs --tenant NAME")
        if role == auth.WORKER and tenant:
            raise ValueError("a worker key belongs to no tenant (drop --tenant)")
        if node and role != auth.WORKER:
            raise ValueError("--node is for worker keys: it is the node label their workers get")
        if tenant:
            check_name("tenant", tenant)
        if node:
            check_name("node", node)
        if role == auth.TENANT and tenant == auth.ADMIN:
            raise ValueError("tenant name 'admin' is the admin keys' own; give the tenant another name")
        key_id, key = auth.new_key()
        while any(k.id == key_id for k in self.keys):
            key_id, key = auth.new_key()
        entry = KeyEntry(id=key_id, role=role, sha256=auth.key_hash(key), node=node,
                         tenant=tenant or (role if role == auth.ADMIN else ""),
                         created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self.keys.append(entry)
        return entry, key

    def revoke(self, key_id: str) -> KeyEntry:
        for k in self.keys:
            if k.id == key_id:
                if not k.revoked:
                    k.revoked = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                return k
        raise ValueError(f"no key {key_id!r} (see `dtorch-controller keys list`)")

    def set_quota(self, tenant: str, devices: int | None, memory_bytes: int | None, sessions: int | None) -> Quota:
        check_name("tenant", tenant)
        if tenant == auth.ADMIN:
            raise ValueError("tenant name 'admin' is the admin keys' own: admins have no quota")
        tenants = sorted({k.tenant for k in self.keys if k.role == auth.TENANT})
        if tenant not in tenants:  # a typo set a quota on nobody and left the tenant meant without one
            raise ValueError(f"no tenant {tenant!r}: no key names it (tenants: {', '.join(tenants) or 'none'}; "
                             f"`keys create --role tenant --tenant {tenant}` makes one)")
        old = self.quotas.get(tenant, Quota())
        quota = Quota(devices=old.devices if devices is None else devices,
                      memory_bytes=old.memory_bytes if memory_bytes is None else memory_bytes,
                      sessions=old.sessions if sessions is None else sessions)
        if min(quota.devices, quota.memory_bytes, quota.sessions) < 0:
            raise ValueError("quotas are counts >= 0 (0: no limit)")
        self.quotas[tenant] = quota
        return quota


class Keyring:
    """The controller's view of the key file: authenticates API keys and knows each tenant's quota."""

    def __init__(self, path: str | Path, clock=time.monotonic) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._file = KeyFile.read(self.path)  # fatal at start: raises KeyFileError
        self._stamp = self._mtime()
        self._checked = clock()
        self._index = self._build()

    def _mtime(self) -> tuple[int, int]:
        try:
            st = self.path.stat()
            return st.st_mtime_ns, st.st_size
        except OSError:
            return 0, 0

    def _build(self) -> dict[str, KeyEntry]:
        return {k.id: k for k in self._file.keys if not k.revoked}

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked < RELOAD_EVERY_S:
            return
        self._checked = now
        stamp = self._mtime()
        if stamp == self._stamp:
            return
        try:
            new = KeyFile.read(self.path)
        except KeyFileError as e:
            log.error("%s; keeping the keys read before", e)
            return
        self._file, self._stamp = new, stamp
        self._index = self._build()
        log.warning("re-read the key file %s: %d active keys", self.path, len(self._index))

    def authenticate(self, credential: str) -> auth.Caller:
        key_id, _secret = auth.parse_key(credential)
        with self._lock:
            self._refresh()
            entry = self._index.get(key_id)
        digest = auth.key_hash(credential)
        if entry is None or not hmac.compare_digest(digest, entry.sha256):
            raise auth.Unauthenticated(f"unknown or revoked API key {key_id}")
        return auth.Caller(entry.role, name=entry.tenant, key_id=entry.id, node=entry.node)

    def quota(self, tenant: str) -> Quota:
        with self._lock:
            return self._file.quotas.get(tenant, Quota())


def new_key_file(path: str | Path, *specs: tuple[str, str]) -> list[str]:
    """Write a fresh key file with one key per (role, tenant) and return the keys, in order (the embedded local
    cluster makes its own this way; so do tests)."""
    kf = KeyFile()
    keys = [kf.create(role, tenant)[1] for role, tenant in specs]
    kf.write(path)
    return keys


def key_file_from_env() -> str:
    return os.environ.get("DTORCH_KEYS", "")
