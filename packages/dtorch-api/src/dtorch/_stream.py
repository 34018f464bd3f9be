"""The instruction stream of one session: a queue the user thread appends to, a sender thread that ships it
to the controller in numbered `Submit` batches, `Sync`, and the keep-alive.

It speaks wire instructions and tensor ids only; it knows nothing of DTensors, plans or workers. An item of
the queue is a wire instruction, or a record `(encode, ...)` that the flushing thread (normally the sender)
turns into one with `encode(record)`: the user thread only queues what cannot wait (ids, the source line).

Rules:
  1. `emit` and `release` only append to a queue (they are the deques' own `append`): the user thread never
     waits on the cluster there, and pays for no Python call of ours.
  2. Batches are numbered from 1 and sent in order, at most MAX_BATCH instructions each. A failed Submit
     breaks the stream: the controller's view of it is unknown, so every later flush or sync raises that error.
  3. Released tensor ids go out as one InstrDelete after every instruction queued before the flush that takes
     them (a tensor's uses are all queued before its release).
  4. The sender flushes every POLL_S when instructions or more than DEAD_AT releases wait (a user thread
     issuing an op every few microseconds fills batches of about a thousand), and sends a KeepAlive every
     `keepalive_s` when the controller asks for one (0: never), whatever else it sent.
  5. `sync` flushes, then asks the controller until every worker executed everything sent (bounded); op
     errors of the session are raised there, the first one with the op and the user's source line. Each Sync
     waits at most SYNC_POLL_S, so a long sync point hears how it stands that often (progress). Two bounds: on
     the workers, DTORCH_TIMEOUT; on a preempted session's wait for devices (`SyncReply.frozen`: time the
     scheduler, not the workers, takes), `queue_timeout` (DTORCH_QUEUE_TIMEOUT, as for a mesh waiting in the
     queue), which that time does not count against DTORCH_TIMEOUT (until protocol 1.14 it did: a session frozen
     longer than 300 s failed its sync with a TimeoutError).
  6. A closed stream (`close`, at `dtorch.shutdown()` or the end of a `with dtorch.connect()` block) sends nothing
     more: a flush or sync raises that it was closed (`check_open`; the session's reads and uploads ask it first).
  7. A blocking sync (`carry`, the user thread's) sends its last batch inside its first `Sync` (protocol 1.7:
     one call instead of a Submit and a Sync) and holds the send lock until that call returns, so no later batch
     can reach the controller first (it refuses batches out of order). Meanwhile the sender thread skips its
     flushes (it never waits for the lock, so keep-alives go on); a failed carrying Sync breaks the stream as a
     failed Submit does. An async fetch's sync does not carry: its thread must not stop the stream.
  8. A Submit's or a KeepAlive's answer may name uploads a rebuild needs again (`.reput`) and uploads whose copies
     are complete (`.safe`): they go to `on_uploads` at once, in the thread that asked, so that a program that
     streams for long between sync points, or says nothing, is heard before the workers' wait for them ends, and
     lets go of its uploads without a sync point (a Sync's answer names the first too: `sync` yields it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from dtorch.errors import ClusterError, sync_error
from dtorch_protocol import messages as m

MAX_BATCH = 4096  # instructions per Submit
POLL_S = 0.005
SYNC_POLL_S = 5.0  # the longest one Sync waits (rule 5)
DEAD_AT = 64

Call = Callable[[str, Any, float], Any]  # (method, request, timeout) -> reply: the controller stub's `call`


def _drain(q: deque) -> list:
    out = []
    try:
        while True:
            out.append(q.popleft())
    except IndexError:
        return out


class Stream:
    """One session's ordered instruction stream to the controller at `address` (named in errors)."""

    def __init__(self, call: Call, session: str, address: str, keepalive_s: float = 0.0,
                 on_uploads: Callable[[dict[int, list[int]], list[int]], None] | None = None) -> None:
        self._call, self.session, self.address = call, session, address
        self._on_uploads = on_uploads
        self._keepalive_s, self._keepalive_at = keepalive_s, time.monotonic()
        self._queue: deque = deque()
        self._dead: deque = deque()
        self.emit: Callable[[Any], None] = self._queue.append  # queue an instruction or a record (rule 1)
        self.release: Callable[[int], None] = self._dead.append  # a tensor id to free after its uses (rule 3)
        self._send_lock = threading.Lock()
        self.seq = 0  # the last batch sent
        self._broken: Exception | None = None
        self._wake = threading.Event()
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="dtorch-sender", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------------ sending (rules 2-4)
    def _send_loop(self) -> None:
        while not self._closed:
            self._wake.wait(POLL_S)
            self._wake.clear()
            if (self._queue or len(self._dead) > DEAD_AT) and self._broken is None \
                    and self._send_lock.acquire(blocking=False):  # else a carrying sync sends them (rule 7)
                try:
                    self._flush()
                except Exception:  # noqa: BLE001 - kept in _broken, raised at the next sync point
                    pass
                finally:
                    self._send_lock.release()
            if self._keepalive_s and time.monotonic() - self._keepalive_at >= self._keepalive_s:
                self._keepalive_at = time.monotonic()  # the controller closes sessions that fall silent
                try:
                    reply = self._call("KeepAlive", m.KeepAlive(session=self.session), 5.0)
                except Exception:  # noqa: BLE001 - a missed keep-alive is retried at the next tick
                    continue
                self._heard(reply)

    def flush(self) -> None:
        """Send everything queued so far, in order."""
        with self._send_lock:
            self._flush()

    def _flush(self, keep_last: bool = False) -> list:
        """Submit what is queued (the send lock held); with `keep_last`, the last batch is returned unsent."""
        if self._broken is not None:
            raise self._broken
        self.check_open()
        dead = _drain(self._dead)  # before the queue: every use of a dead tid is already queued
        try:
            instrs = [i if type(i) is not tuple else i[0](i) for i in _drain(self._queue)]
        except Exception as e:  # a bug, but the stream lost instructions: it cannot go on
            self._broken = ClusterError(f"could not encode an instruction for the controller: {e!r}")
            raise self._broken from e
        if dead:
            instrs.append(m.InstrDelete(tids=dead))
        batches = [instrs[start:start + MAX_BATCH] for start in range(0, len(instrs), MAX_BATCH)]
        last = batches.pop() if keep_last and batches else []
        for batch in batches:
            self.seq += 1
            try:
                reply = self._call("Submit", m.Submit(session=self.session, seq=self.seq, instrs=batch), 60.0)
            except Exception as e:
                raise self._lost(e) from None
            self._heard(reply)
        return last

    def _heard(self, reply: m.SubmitReply | m.KeepAliveReply) -> None:
        if (reply.reput or reply.safe) and self._on_uploads is not None:  # rule 8
            self._on_uploads(reply.reput, reply.safe)

    def _lost(self, e: Exception) -> ClusterError:
        self._broken = ClusterError(f"lost the instruction stream to the controller at {self.address}: {e}")
        return self._broken

    # ------------------------------------------------------------------ sync (rule 5)
    def sync(self, timeout: float, carry: bool = True, queue_timeout: float = 600.0) -> Iterator[m.SyncReply]:
        """Flush, then wait until the workers executed it all (at most `timeout` s of waiting for workers, and
        `queue_timeout` s frozen: rule 5); yields each Sync reply (their locations are news for the data plane; one
        not done says how the sync stands), then raises the session's op errors, if any. With `carry`, the last
        batch goes inside the first Sync (rule 7)."""
        asked = time.monotonic()
        deadline, frozen_s = asked + timeout, 0.0
        reply = None
        with self._send_lock:
            last = self._flush(keep_last=carry)
            if last:
                self.seq += 1
                try:
                    reply = self._sync_call(deadline, last)
                except Exception as e:
                    raise self._lost(e) from None
        while True:
            if reply is None:
                reply = self._sync_call(deadline)
            yield reply
            if reply.errors:
                raise sync_error(reply.errors)
            if reply.done:
                return
            now = time.monotonic()
            if reply.frozen:  # waiting for devices, not for workers: the queue's bound
                frozen_s += now - asked
                deadline += now - asked
                if frozen_s >= queue_timeout:
                    raise TimeoutError(f"the session stayed frozen (preempted) for {queue_timeout:.0f} s "
                                       f"(DTORCH_QUEUE_TIMEOUT): {reply.message}")
            elif now >= deadline:
                raise TimeoutError(f"workers did not finish within {timeout:.0f} s (DTORCH_TIMEOUT): {reply.message}")
            asked, reply = now, None

    def _sync_call(self, deadline: float, instrs: list | None = None) -> m.SyncReply:
        wait = max(0.1, min(SYNC_POLL_S, deadline - time.monotonic()))
        return self._call("Sync", m.Sync(session=self.session, upto=self.seq, timeout_s=wait, instrs=instrs or []),
                          wait + 10.0)

    # ------------------------------------------------------------------ shutdown
    @property
    def broken(self) -> bool:
        return self._broken is not None

    def check_open(self) -> None:
        if self._closed:
            raise ClusterError(f"session {self.session[:8]} was closed (dtorch.shutdown(), or the end of its `with "
                               "dtorch.connect()` block): its tensors are gone; make them anew in an open session")

    def close(self) -> None:
        """Stop the sender thread (after the caller's last flush)."""
        self._closed = True
        self._wake.set()
