"""The worker's only state: shards keyed by (session, tid, logical device).

A shard is a torch.Tensor or a Poison carrying the ErrorReport of the op that
failed to produce it, so that later ops and fetches fail with the original error
instead of a confusing "missing tensor". Readers can wait (bounded) for a shard:
peers may ask for a shard before this worker's executor has produced it.

The store also counts the peers' planned reads of each shard (CmdExpectReads adds
the expected ones, the Pull handler marks them served), so the executor can hold an
in-place write to a shard's storage until the reads announced before it are done.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from dtorch.protocol.messages import ErrorReport, ShardStats

Key = tuple[str, int, int]  # (session, tid, logical device)


@dataclass(frozen=True)
class Poison:
    """Stands in for a shard whose producing op failed; carries the original report."""

    report: ErrorReport


Shard = torch.Tensor | Poison


class ShardMissing(KeyError):
    """No shard under the key, even after waiting; str() is a readable one-line reason."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "shard missing"


def describe(key: Key) -> str:
    session, tid, device = key
    return f"tensor {tid} on logical device {device} (session {session[:8]})"


class TensorStore:
    """Thread-safe map of shards with a condition variable for bounded waits."""

    def __init__(self) -> None:
        self._data: dict[Key, Shard] = {}
        self._reads: dict[Key, int] = {}  # expected - served planned reads; only keys where that is not 0
        self._cond = threading.Condition()

    def put(self, key: Key, value: Shard) -> None:
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def peek(self, key: Key) -> Shard | None:
        """The shard now, or None; never waits."""
        with self._cond:
            return self._data.get(key)

    def get(self, key: Key, timeout: float = 0.0) -> Shard:
        """The shard, waiting up to `timeout` seconds for it to appear; raises ShardMissing."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while True:
                value = self._data.get(key)
                if value is not None:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    waited = f" after waiting {timeout:g}s" if timeout > 0 else ""
                    raise ShardMissing(f"no shard for {describe(key)} on this worker{waited}")
                self._cond.wait(left)

    def __contains__(self, key: Key) -> bool:
        with self._cond:
            return key in self._data

    def delete(self, key: Key) -> bool:
        with self._cond:
            self._reads.pop(key, None)  # reads of a lost reader: nothing may wait for them any more
            self._cond.notify_all()
            return self._data.pop(key, None) is not None

    def drop_session(self, session: str) -> int:
        """Forget every shard of a session; returns how many were dropped."""
        with self._cond:
            for k in [k for k in self._reads if k[0] == session]:
                del self._reads[k]
            keys = [k for k in self._data if k[0] == session]
            for k in keys:
                del self._data[k]
            self._cond.notify_all()
            return len(keys)

    # ------------------------------------------------------------ planned reads by peers

    def expect_reads(self, key: Key, n: int) -> None:
        """`n` more planned peer reads of `key` are coming (CmdExpectReads)."""
        self._add_reads(key, n)

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

    def keys(self, session: str | None = None) -> list[Key]:
        with self._cond:
            return [k for k in self._data if session is None or k[0] == session]

    def stats(self) -> dict[str, ShardStats]:
        """Live shards and bytes per session; views sharing storage count its bytes once."""
        with self._cond:
            items = list(self._data.items())
        counts: dict[str, int] = {}
        storages: dict[str, dict[tuple[str, int], int]] = {}
        for (session, _tid, _dev), value in items:
            counts[session] = counts.get(session, 0) + 1
            seen = storages.setdefault(session, {})
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                ptr = storage.data_ptr()
                ident = (str(value.device), ptr if ptr else id(storage))
                seen[ident] = storage.nbytes()
        return {s: ShardStats(tensors=n, bytes=sum(storages[s].values())) for s, n in counts.items()}
