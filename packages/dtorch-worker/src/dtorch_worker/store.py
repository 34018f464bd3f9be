"""The worker's only state: shards keyed by (session, tid, logical device).

A shard is a torch.Tensor or a Poison carrying the ErrorReport of the op that
failed to produce it, so that later ops and fetches fail with the original error
instead of a confusing "missing tensor". Readers can wait (bounded) for a shard:
peers may ask for a shard before this worker's executor has produced it.

The store also counts the peers' planned reads of each shard (CmdExpectReads adds
the expected ones, the Pull handler marks them served), so the executor can hold an
in-place write to a shard's storage until the reads announced before it are done.

A client's read may come before the batch it follows (it goes out with the Sync, `PullRequest.after`): the store
keeps each session's highest read mark the executor released (a CmdReadable whose batch completed and is being
reported: executor.py), and the Pull handler waits for the mark before it reads.

A shard a collective is still writing (the last step of a CmdCollective, in flight on a group's lane) is a
`Pending`: `get` waits for it (its first use), bounded, then returns the tensor or its Poison; `peek` sees
nothing there yet.

Memory caps: the store keeps each session's cap on this worker (the latest Execute's `memory_cap`, set for
packed leases only; before the session's first Execute here, the cap its client's capability carries) and counts
the bytes a session's shards hold here, a storage shared by views once (as `stats` does), so the executor can fail
commands, and the Put handler refuse uploads, that would take a capped session over its cap. Keys are indexed by
session: that count never scans other sessions' shards.

Uploads used and deleted: a client may Put an upload again that this worker already adopted, used and deleted (a
rebuild asks for the uploads going out on a device it rebound until the client learns where its devices are, and
the request can cross the delete: the controller's recovery.py rule 7). The store remembers the keys of the last
`GONE_MAX` uploads each session's program deleted here (CmdDelete, not a move's or a rebuild's drop: a bounded
record, since a request crosses a delete within about a keep-alive period) and refuses a Put of one (REFUSED: what
the client's Put again leaves alone); stored, it would hold memory until the session closed, read and freed by
nothing. A session starting over here (CmdAbandon) forgets them: a rebuild's replay may need the same upload again.

Closed sessions: a session closed here (CmdCloseSession of the session itself, not of one of its `#` namespaces) is
remembered for as long as a capability for it may live (`auth.CAP_TTL_S`), and the worker refuses its capabilities:
an upload to a closed session would hold memory nobody accounts for or ever frees.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import torch

from dtorch_protocol.auth import CAP_TTL_S
from dtorch_protocol.messages import ErrorKind, ErrorReport, ShardStats
from dtorch_protocol.wire import call_ended

Key = tuple[str, int, int]  # (session, tid, logical device)
GONE_MAX = 4096  # uploads used and deleted whose keys a session's Puts are checked against (module docstring)
Storage = tuple[tuple[bool, int], int]  # (identity: on the host or not, and address; byte size) of a shard's storage


@dataclass(frozen=True)
class Poison:
    """Stands in for a shard whose producing op failed; carries the original report."""

    report: ErrorReport


@dataclass(eq=False)
class Pending:
    """A shard a collective still writes; `done` is set once the entry holds the tensor or its Poison."""

    nbytes: int  # what it will hold (memory caps count it from the start)
    deadline: float  # monotonic time after which readers stop waiting (the op is bounded well before)
    what: str  # the op, for messages
    done: threading.Event = field(default_factory=threading.Event)


Shard = torch.Tensor | Poison


class ShardMissing(KeyError):
    """No shard under the key, even after waiting; str() is a readable one-line reason, `kind` what happened
    (MOVED: the device left this worker, the client asks the controller where it went)."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.MISSING) -> None:
        super().__init__(message)
        self.kind = kind

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "shard missing"


def describe(key: Key) -> str:
    session, tid, device = key
    return f"tensor {tid} on logical device {device} (session {session[:8]})"


def moved_message(key: Key) -> str:
    return f"moved: logical device {key[2]} of session {key[0][:8]} moved to another worker"


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; below 1 KiB, '512 bytes'."""
    if abs(n) < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def cap_message(held: int, cap: int) -> str:
    """The one-line reason a capped session is refused memory: held bytes against its cap."""
    a, b = format_bytes(held), format_bytes(cap)
    if a == b:  # rounding hid the difference
        a, b = f"{held} bytes", f"{cap} bytes"
    return f"memory cap exceeded: session holds {a} on this worker, over its cap of {b} per device"


def _storage(value: Shard | Pending) -> Storage | None:
    """(identity, byte size) of a shard's storage, or None for a poisoned one; views of one storage share it."""
    if isinstance(value, Pending):
        return ("pending", id(value)), value.nbytes
    if not isinstance(value, torch.Tensor):
        return None
    storage = value.untyped_storage()
    ptr = storage.data_ptr()
    return (value.is_cpu, ptr if ptr else id(storage)), storage.nbytes()  # a worker has one device besides the host


class TensorStore:
    """Thread-safe map of shards with a condition variable for bounded waits."""

    def __init__(self) -> None:
        self._data: dict[Key, Shard] = {}
        self._by_session: dict[str, dict[Key, None]] = {}  # session -> its keys in `_data` (per-session bytes)
        self._caps: dict[str, int] = {}  # session -> memory cap on this worker in bytes (absent: none)
        self._closed: dict[str, float] = {}  # session closed here -> when (monotonic), oldest first
        self._reads: dict[Key, int] = {}  # expected - served planned reads; only keys where that is not 0
        self._announced: dict[Key, set[int]] = {}  # redistributions (dst tids) whose reads of a key were announced
        self._readable: dict[str, int] = {}  # session -> the highest client read mark its stream reached
        # early reads wait on a condition of their own: the store's is notified at every put, and a read waiting for
        # its mark through a backward pass would take the GIL from the executor hundreds of times
        self._marks = threading.Condition()  # guards `_readable` only
        self._cond = threading.Condition()
        # Recovery and migration (CmdAbandon, CmdSendShards(move=...), CmdRebuilt):
        self._gen: dict[str, int] = {}  # session -> bumped when it is abandoned: waits on its shards end
        self._moved: set[tuple[str, int]] = set()  # (session, device) that moved away from this worker
        self._rebuilding: set[str] = set()  # sessions whose shards are being rebuilt: client reads wait
        self._traffic: dict[str, int] = {}  # session -> tensor bytes moved for it here (usage records)
        self._uploaded: set[Key] = set()  # stored by `put_upload` and not deleted since
        self._gone: dict[str, dict[Key, None]] = {}  # session -> its last GONE_MAX uploads deleted here, oldest first
        # `stats` of the namespaces of copies ("{session}#..."): nothing writes a copy in place, so their counts
        # hold until a shard is put or dropped there (`_changes`: the tick of its last change, never reused);
        # each report walks only the sessions' own shards
        self._tick = itertools.count()
        self._changes: dict[str, int] = {}
        self._copies_stats: dict[str, tuple[int, ShardStats]] = {}  # namespace -> (its `_changes` then, stats)

    def _set(self, key: Key, value: Shard) -> None:
        self._data[key] = value
        self._by_session.setdefault(key[0], {})[key] = None
        self._changes[key[0]] = next(self._tick)

    def _pop(self, key: Key) -> Shard | None:
        value = self._data.pop(key, None)
        if value is not None:
            self._uploaded.discard(key)
            self._changes[key[0]] = next(self._tick)
            keys = self._by_session.get(key[0])
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._by_session[key[0]]
                    self._changes.pop(key[0], None)
                    self._copies_stats.pop(key[0], None)
        return value

    def wake(self) -> None:
        """Wake every wait on this store to look again (a call it serves ended: `wire.on_call_end`)."""
        with self._cond:
            self._cond.notify_all()
        with self._marks:
            self._marks.notify_all()

    def put(self, key: Key, value: Shard) -> None:
        with self._cond:
            self._set(key, value)
            self._cond.notify_all()

    def peek(self, key: Key) -> Shard | None:
        """The shard now, or None (also while a collective still writes it); never waits."""
        with self._cond:
            value = self._data.get(key)
            return None if isinstance(value, Pending) else value

    def resolve(self, key: Key, pending: Pending, value: Shard) -> None:
        """A collective finished `key`: store its tensor or Poison, unless the entry was deleted or replaced."""
        with self._cond:
            if self._data.get(key) is pending:
                self._set(key, value)
                self._cond.notify_all()

    def get(self, key: Key, timeout: float = 0.0) -> Shard:
        """The shard, waiting up to `timeout` seconds for it to appear, and for a collective still writing it
        (bounded by the op's own deadline); raises ShardMissing."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            value = self._get(key, deadline, timeout)
            if not isinstance(value, Pending):
                return value
            if not value.done.wait(max(value.deadline - time.monotonic(), 0.0)):
                raise ShardMissing(f"{describe(key)} is still being written by {value.what} past its deadline")

    def _get(self, key: Key, deadline: float, timeout: float) -> Shard | Pending:
        with self._cond:
            gen = self._gen.get(key[0], 0)
            while True:
                value = self._data.get(key)
                if value is not None:
                    return value
                if (key[0], key[2]) in self._moved:
                    raise ShardMissing(moved_message(key), ErrorKind.MOVED)
                if self._gen.get(key[0], 0) != gen:
                    raise ShardMissing(f"no shard for {describe(key)}: the session is being rebuilt after a "
                                       "worker loss")
                left = deadline - time.monotonic()
                if left <= 0 or call_ended():
                    waited = f" after waiting {timeout:g}s" if timeout > 0 else ""
                    raise ShardMissing(f"no shard for {describe(key)} on this worker{waited}")
                self._cond.wait(left)

    def __contains__(self, key: Key) -> bool:
        with self._cond:
            return key in self._data

    def delete(self, key: Key, by_program: bool = False) -> bool:
        """`by_program`: the session's own delete (CmdDelete), not a move's or a rebuild's: an upload's key is
        remembered (module docstring)."""
        with self._cond:
            self._reads.pop(key, None)  # reads of a lost reader: nothing may wait for them any more
            self._announced.pop(key, None)
            self._cond.notify_all()
            if by_program and key in self._uploaded:
                gone = self._gone.setdefault(key[0], {})
                gone[key] = None
                if len(gone) > GONE_MAX:
                    del gone[next(iter(gone))]
            return self._pop(key) is not None

    def drop_session(self, session: str) -> int:
        """Forget every shard of a session; returns how many were dropped."""
        with self._cond:
            for k in [k for k in self._reads if k[0] == session]:
                del self._reads[k]
            for k in [k for k in self._announced if k[0] == session]:
                del self._announced[k]
            with self._marks:
                self._readable.pop(session, None)
            keys = list(self._by_session.pop(session, {}))
            for k in keys:
                del self._data[k]
            self._uploaded.difference_update(keys)
            self._gone.pop(session, None)
            self._changes.pop(session, None)
            self._copies_stats.pop(session, None)
            self._moved = {m for m in self._moved if m[0] != session}
            self._rebuilding.discard(session)
            self._caps.pop(session, None)
            self._traffic.pop(session, None)
            if "#" not in session:
                self._remember_closed(session)
            self._cond.notify_all()
            return len(keys)

    def _remember_closed(self, session: str) -> None:
        now = time.monotonic()
        while self._closed:
            oldest, when = next(iter(self._closed.items()))
            if now - when <= CAP_TTL_S:
                break
            del self._closed[oldest]
        self._closed[session] = now

    def closed(self, session: str) -> bool:
        """Was `session` (or the session a `#` namespace belongs to) closed here?"""
        return session.partition("#")[0] in self._closed

    def drop_derived(self, session: str) -> int:
        """Forget the shards of every namespace derived from `session` (`{session}#...`: its backups)."""
        prefix = session + "#"
        with self._cond:
            keys = [k for k in self._data if k[0].startswith(prefix)]
            for k in keys:
                self._pop(k)
            self._cond.notify_all()
            return len(keys)

    def drop_tids(self, session: str, tids: list[int]) -> int:
        """Forget the shards of `tids` on every logical device of `session`."""
        wanted = set(tids)
        with self._cond:
            keys = [k for k in self._by_session.get(session, ()) if k[1] in wanted]
        for k in keys:
            self.delete(k)
        return len(keys)

    def device_keys(self, session: str, devices: list[int]) -> list[Key]:
        wanted = set(devices)
        with self._cond:
            return [k for k in self._by_session.get(session, ()) if k[2] in wanted]

    # ------------------------------------------------------------ recovery and migration

    def abandon(self, session: str) -> None:
        """The session starts over here: end every wait on its shards, forget peers' planned reads of them,
        and make client reads wait until `rebuilt`."""
        with self._cond:
            self._gen[session] = self._gen.get(session, 0) + 1
            for k in [k for k in self._reads if k[0] == session]:
                del self._reads[k]
            self._gone.pop(session, None)  # the replay may need an upload it deleted before
            self._rebuilding.add(session)
            self._cond.notify_all()

    def rebuilt(self, session: str) -> None:
        with self._cond:
            self._rebuilding.discard(session)
            self._cond.notify_all()

    def rebuilding(self, session: str) -> bool:
        with self._cond:
            return session in self._rebuilding

    def wait_rebuilt(self, session: str, timeout: float) -> bool:
        """Wait up to `timeout` s while the session is being rebuilt; True when it is not (any more)."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while session in self._rebuilding:
                left = deadline - time.monotonic()
                if left <= 0 or call_ended():
                    return False
                self._cond.wait(left)
            return True

    def mark_moved(self, session: str, devices: list[int]) -> None:
        with self._cond:
            self._moved.update((session, d) for d in devices)
            self._cond.notify_all()
        with self._marks:  # an early read of a device that left stops waiting for its mark here
            self._marks.notify_all()

    def clear_moved(self, session: str, devices: list[int] | None = None) -> None:
        with self._cond:
            self._moved = {m for m in self._moved if m[0] != session or (devices is not None and m[1] not in devices)}

    def is_moved(self, session: str, device: int) -> bool:
        with self._cond:
            return (session, device) in self._moved

    def admit_upload(self, session: str, declared: int) -> str:
        """Whether an upload declaring `declared` bytes may even start: "" or why not (over the memory cap)."""
        with self._cond:
            cap = self._caps.get(session, 0)
            if cap > 0 and (held := self._session_bytes(session) + declared) > cap:
                return cap_message(held, cap)
            return ""

    def refused_upload(self, key: Key) -> str:
        """Why an upload of `key` is refused whatever its size (kind REFUSED), or ""."""
        with self._cond:
            return self._refused_upload(key)

    def _refused_upload(self, key: Key) -> str:
        if key in self._data:
            return f"tensor {key[1]} on logical device {key[2]} already exists here (uploads never replace it)"
        if key in self._gone.get(key[0], ()):
            return f"tensor {key[1]} on logical device {key[2]} was uploaded, used and deleted here: not stored again"
        return ""

    def put_upload(self, key: Key, value: Shard) -> tuple[ErrorKind, str] | None:
        """A client upload: stored (None) unless its device moved away (MOVED), the key holds a shard already
        (REFUSED: uploads never replace one) or held one that was used and deleted (REFUSED: module docstring), or it
        would take the session over its memory cap here (MEMORY_CAP); then (kind, one-line reason)."""
        with self._cond:
            if (key[0], key[2]) in self._moved:
                return ErrorKind.MOVED, moved_message(key)
            if refused := self._refused_upload(key):
                return ErrorKind.REFUSED, refused
            cap = self._caps.get(key[0], 0)
            if cap > 0 and "#" not in key[0]:
                held = self._session_bytes(key[0], {key: _storage(value)})
                if held > cap:
                    return ErrorKind.MEMORY_CAP, cap_message(held, cap)
            self._set(key, value)
            self._uploaded.add(key)
            self._cond.notify_all()
            return None

    # ------------------------------------------------------------ memory caps

    def set_cap(self, session: str, cap: int) -> None:
        """The session's memory cap on this worker (0: none); the latest Execute's value holds."""
        with self._cond:
            if cap > 0:
                self._caps[session] = cap
            else:
                self._caps.pop(session, None)

    def learn_cap(self, session: str, cap: int) -> None:
        """The cap a client's capability carries, for a session no Execute has told this worker about yet (its
        first uploads come before its first batch): the same value as the Execute's, which holds from then on."""
        if cap > 0:
            with self._cond:
                self._caps.setdefault(session, cap)

    def cap(self, session: str) -> int:
        with self._cond:
            return self._caps.get(session, 0)

    def storages(self, keys: list[Key]) -> dict[Key, Storage | None]:
        """The storage each key's shard holds now (None: none, or poisoned), for `session_bytes(instead=...)`."""
        with self._cond:
            return {k: _storage(v) if (v := self._data.get(k)) is not None else None for k in keys}

    def session_bytes(self, session: str, instead: dict[Key, Storage | None] | None = None) -> int:
        """Bytes the session's live shards hold here; storage shared by views counts once (as in `stats`).

        `instead` counts those keys as holding the given storages (None: nothing) whatever they hold now:
        what the session held before a command that wrote them, or would hold after an upload.
        """
        with self._cond:
            return self._session_bytes(session, instead)

    def _session_bytes(self, session: str, instead: dict[Key, Storage | None] | None = None) -> int:
        seen: dict[tuple[str, int], int] = {}
        for k in self._by_session.get(session, ()):
            if (instead is None or k not in instead) and (st := _storage(self._data[k])) is not None:
                seen[st[0]] = st[1]
        for st in (instead or {}).values():
            if st is not None:
                seen[st[0]] = st[1]
        return sum(seen.values())

    # ------------------------------------------------------------ planned reads by peers

    def expect_reads(self, key: Key, n: int, dst: int = -1) -> None:
        """`n` more planned peer reads of `key` are coming (CmdExpectReads) for redistribution `dst`.

        From now on pulls of `key` for `dst` may be served: the shard holds exactly the value that
        redistribution must read, every earlier write of this stream having run. Pulls that came first are
        waiting for this (`wait_announced`): wake them, since nothing else may (the next command can be an
        in-place write that waits for exactly those pulls; they would both sit out their timeouts).
        """
        with self._cond:
            if dst >= 0:
                self._announced.setdefault(key, set()).add(dst)
                self._cond.notify_all()
            self._add_reads(key, n)

    def wait_announced(self, key: Key, dst: int, timeout: float) -> bool:
        """Wait up to `timeout` s until this worker ran the CmdExpectReads of redistribution `dst` for `key`.

        A peer reaches its redistribution in its own stream, maybe before this worker ran the writes that
        precede it here; serving the pull only after the announcement keeps it from reading too early.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while dst not in self._announced.get(key, ()):
                left = deadline - time.monotonic()
                if left <= 0 or call_ended():
                    return False
                self._cond.wait(left)
            return True

    # ------------------------------------------------------------ the client's reads (CmdReadable)

    def readable(self, session: str, mark: int) -> None:
        """Read mark `mark` of the session is released (executor.py): its client's pulls up to it may be served."""
        with self._marks:
            if mark > self._readable.get(session, -1):
                self._readable[session] = mark
                self._marks.notify_all()

    def wait_readable(self, session: str, device: int, mark: int, timeout: float) -> bool:
        """Wait up to `timeout` s until read mark `mark` of the session is released (False at once when `device`
        moved away: its new worker's stream has the mark)."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._marks:
            while self._readable.get(session, -1) < mark:
                left = deadline - time.monotonic()
                if left <= 0 or call_ended() or (session, device) in self._moved:
                    return False
                self._marks.wait(left)
            return True

    def read_served(self, key: Key) -> None:
        """One planned read of `key` was served (or failed); it may come before the expectation."""
        self._add_reads(key, -1)

    def _add_reads(self, key: Key, delta: int) -> None:
        with self._cond:
            left = self._reads.get(key, 0) + delta
            if left:
                self._reads[key] = left
            else:
                self._reads.pop(key, None)
                self._announced.pop(key, None)  # every announced read was served: no pull can still come
                self._cond.notify_all()

    def forget_reads(self, keys: list[Key]) -> None:
        """Stop waiting for the planned reads of `keys` still pending (the readers may be gone)."""
        with self._cond:
            for k in keys:
                if self._reads.get(k, 0) > 0:
                    del self._reads[k]
            self._cond.notify_all()

    def pending_reads(self, key: Key) -> int:
        """Planned reads of `key` not served yet (negative: served before they were announced)."""
        with self._cond:
            return self._reads.get(key, 0)

    def wait_reads(self, tensors: list[torch.Tensor], timeout: float) -> list[Key]:
        """Wait up to `timeout` s until no shard sharing storage with `tensors` has planned reads pending.

        Storage, not key: an in-place op on a view stored under another tid writes the same memory.
        Returns the keys still pending when the time ran out (empty: safe to write).
        """
        ptrs = {p for t in tensors if (p := t.untyped_storage().data_ptr())}
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while True:
                pending = [k for k, left in self._reads.items() if left > 0 and isinstance(
                    v := self._data.get(k), torch.Tensor) and v.untyped_storage().data_ptr() in ptrs]
                left_s = deadline - time.monotonic()
                if not pending or left_s <= 0:
                    return pending
                self._cond.wait(left_s)

    def count_traffic(self, session: str, n: int) -> None:
        """`n` tensor bytes moved for `session` here: received from peers or clients, or sent to its client."""
        if n and "#" not in session:  # backups' namespaces are the controller's business, not the tenant's
            with self._cond:
                self._traffic[session] = self._traffic.get(session, 0) + n

    def output_bytes(self, session: str, outputs: list[tuple[int, int]]) -> int:
        """Bytes of the shards at (tid, device) of `session` (a profile's output sizes; views count their own)."""
        with self._cond:
            values = [self._data.get((session, tid, device)) for tid, device in outputs]
        return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))

    def memory(self) -> tuple[int, int]:
        """(bytes held by every shard and copy here, the sum of the memory caps of capped sessions)."""
        with self._cond:
            items = list(self._data.values())
            capped = sum(self._caps.values())
        storages = {st[0]: st[1] for v in items if (st := _storage(v)) is not None}
        return sum(storages.values()), capped

    def keys(self, session: str | None = None) -> list[Key]:
        with self._cond:
            return list(self._data) if session is None else list(self._by_session.get(session, ()))

    def stats(self) -> dict[str, ShardStats]:
        """Live shards and bytes per session; views sharing storage count its bytes once. A namespace of copies
        is walked again only once a shard was put or dropped there."""
        with self._cond:
            stats, walk = {}, {}
            for namespace, keys in self._by_session.items():
                cached = self._copies_stats.get(namespace)
                if cached is not None and cached[0] == self._changes.get(namespace):
                    stats[namespace] = cached[1]
                else:
                    walk[namespace] = (self._changes.get(namespace), [self._data[k] for k in keys])
            traffic = dict(self._traffic)
        for namespace, (changes, values) in walk.items():
            seen = {st[0]: st[1] for v in values if (st := _storage(v)) is not None}
            stats[namespace] = ShardStats(tensors=len(values), bytes=sum(seen.values()),
                                          moved_bytes=traffic.get(namespace, 0))
            if "#" in namespace:
                with self._cond:
                    if self._changes.get(namespace) == changes:
                        self._copies_stats[namespace] = (changes, stats[namespace])
        for s, moved in traffic.items():  # a session with nothing left here still moved bytes
            stats.setdefault(s, ShardStats(tensors=0, bytes=0, moved_bytes=moved))
        return stats
