"""The resource pool: which worker is free, which session leases which worker, where free devices sit.

Rules:

1. A worker is one physical device. A *lease* gives a session the use of a worker: cap 0 is the whole device
   (exclusive), cap > 0 is a packed lease of at most `cap` bytes. A worker carries either one exclusive lease,
   or packed leases whose caps sum to at most its memory. A session's logical devices bound to a worker it
   leases are virtual devices of that worker.
2. A worker is *free* when it is placeable (alive) and carries no lease. Exclusive leases go to free workers
   only; packed leases go to placeable workers without an exclusive lease and with room for the cap.
3. A worker's node is its "node" label, else the host of its address. `pick` takes free workers on the
   fewest nodes: the node with the fewest free workers that still has enough (best fit), otherwise the
   nodes with the most free workers first, then best fit for the rest.
4. No query scans every worker: free workers are indexed by node and nodes by their free count, so picking
   costs O(distinct free counts + nodes used), whatever the cluster size (10,000 workers is normal).
5. The pool holds no session logic. The scheduler decides who leases what; the pool keeps the counts right.
6. Fault protection asks two things (snapshots.py, moves.py): `backup_for` (where a worker's remote copies
   go: a placeable worker on *another* node, so that losing a whole node never takes both copies; its own node
   only when no other node has one) and `free_off`/`free_on` (a free worker off or on a given node, for drains).
   Workers are also kept in registration order (`_ring`), so `backup_for` steps over the primary's node in
   O(1) when nodes register one after another (the usual case), O(workers skipped) otherwise.
7. Packed leases are placed fragmentation-aware (after FGD, Weng et al., ATC '23): the pool keeps a decayed
   count of the shares of a device recent requests asked for (`saw`; whole devices count as 1.0). A device's
   *fragmentation* is its free room times the share of requests too big for it; a packed lease goes where it
   grows the fragmentation least (a shared device or a free one), best fit among equals. Whole-device requests
   are always expected (a prior of one), so with no history it is plain best fit: the shared device with the
   least room that fits, then free ones.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice

_BINS = 20  # request shares are counted in 5% steps of a device (of the largest memory)
_WHOLE = _BINS + 1  # ... and whole-device requests apart
_DEMAND_WINDOW = 512  # every this many requested devices, older counts are halved
_WHOLE_PRIOR = 1.0  # whole-device requests are always expected (the default request): a partly leased device
# never counts as fully usable


@dataclass
class Slot:
    worker: str
    node: str
    memory: int  # bytes the worker registered with (0: unknown)
    order: int  # registration order, for deterministic tie-breaks
    placeable: bool = True
    leases: dict[str, int] = field(default_factory=dict)  # session -> cap bytes (0: the whole device)

    @property
    def exclusive(self) -> bool:
        return any(cap == 0 for cap in self.leases.values())

    @property
    def room(self) -> int:
        """Bytes still free for packed leases (0 when leased whole)."""
        return 0 if self.exclusive else self.memory - sum(self.leases.values())


def node_of(address: str, labels: dict[str, str]) -> str:
    node = labels.get("node")
    if node:
        return node
    host, sep, _port = address.rpartition(":")
    return host if sep else address


class Pool:
    def __init__(self) -> None:
        self.slots: dict[str, Slot] = {}  # every worker that is not lost
        self._free: dict[str, dict[str, None]] = {}  # node -> its free workers (insertion order)
        self._buckets: dict[int, dict[str, None]] = {}  # free count -> nodes with that many free workers
        self._shared: dict[str, None] = {}  # placeable workers carrying only packed leases
        self.free_total = 0
        self._ring: list[tuple[int, str]] = []  # (order, worker) of every worker in the pool, sorted
        self._node_size: dict[str, int] = {}  # node -> its workers in the pool
        self._placeable: dict[str, dict[str, None]] = {}  # node -> its placeable workers
        self._demand: dict[int, float] = {}  # recent requests per share of a device (in 1/_BINS), decayed
        self._seen = 0.0
        self._memory = 0  # the largest worker memory: the unit of request shares

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, worker: object) -> bool:
        return worker in self.slots

    # ------------------------------------------------------------ membership

    def add(self, worker: str, node: str, memory: int, order: int, placeable: bool = True) -> None:
        slot = self.slots[worker] = Slot(worker, node, memory, order, placeable)
        self._memory = max(self._memory, memory)
        insort(self._ring, (order, worker))
        self._node_size[node] = self._node_size.get(node, 0) + 1
        self._refresh(slot)

    def remove(self, worker: str) -> dict[str, int]:
        """Forget a lost worker; returns the leases it carried."""
        slot = self.slots.get(worker)
        if slot is None:
            return {}
        slot.placeable = False
        self._refresh(slot)
        del self.slots[worker]
        i = bisect_left(self._ring, (slot.order, worker))
        if i < len(self._ring) and self._ring[i][1] == worker:
            del self._ring[i]
        left = self._node_size[slot.node] - 1
        if left:
            self._node_size[slot.node] = left
        else:
            del self._node_size[slot.node]
        return slot.leases

    def set_placeable(self, worker: str, placeable: bool) -> bool:
        """True when the worker just became placeable (capacity grew)."""
        slot = self.slots.get(worker)
        if slot is None or slot.placeable == placeable:
            return False
        slot.placeable = placeable
        self._refresh(slot)
        return placeable

    # ------------------------------------------------------------ leases

    def lease(self, worker: str, session: str, cap: int) -> None:
        slot = self.slots[worker]
        slot.leases[session] = cap
        self._refresh(slot)

    def release(self, worker: str, session: str) -> None:
        slot = self.slots.get(worker)
        if slot is not None and slot.leases.pop(session, None) is not None:
            self._refresh(slot)

    def holders(self, worker: str) -> dict[str, int]:
        slot = self.slots.get(worker)
        return slot.leases if slot is not None else {}

    def is_free(self, worker: str) -> bool:
        slot = self.slots.get(worker)
        return slot is not None and slot.placeable and not slot.leases

    def fits(self, worker: str, cap: int) -> bool:
        """Could `worker` take a lease with this cap now (placeability aside)?"""
        slot = self.slots.get(worker)
        if slot is None:
            return False
        if cap == 0 or not slot.leases:
            return not slot.leases
        return not slot.exclusive and slot.room >= cap

    def shared_room(self) -> bool:
        return bool(self._shared)

    # ------------------------------------------------------------ picking (pure queries)

    def pick(self, k: int, exclude: Collection[str] = ()) -> list[str]:
        """Up to `k` free workers on the fewest nodes (fewer when fewer are free)."""
        if k <= 0:
            return []
        if exclude:
            return self._pick_slow(k, exclude)
        chosen: list[str] = []
        used: set[str] = set()
        remaining = k
        counts = sorted(self._buckets)
        while remaining > 0:
            node = self._best_fit(counts, remaining, used) or self._largest(counts, used)
            if node is None:
                break
            take = list(islice(self._free[node], remaining))
            chosen += take
            used.add(node)
            remaining -= len(take)
        return chosen

    def _nodes(self, count: int, used: set[str]) -> Iterator[str]:
        return (n for n in self._buckets[count] if n not in used)

    def _best_fit(self, counts: list[int], remaining: int, used: set[str]) -> str | None:
        for c in counts:
            if c >= remaining:
                node = next(self._nodes(c, used), None)
                if node is not None:
                    return node
        return None

    def _largest(self, counts: list[int], used: set[str]) -> str | None:
        for c in reversed(counts):
            node = next(self._nodes(c, used), None)
            if node is not None:
                return node
        return None

    def _pick_slow(self, k: int, exclude: Collection[str]) -> list[str]:
        """`pick` when some free workers are reserved: recount per node (rare: only during a pass with reservations)."""
        free = {node: [w for w in ws if w not in exclude] for node, ws in self._free.items()}
        free = {node: ws for node, ws in free.items() if ws}
        chosen: list[str] = []
        remaining = k
        while remaining > 0 and free:
            fitting = [n for n, ws in free.items() if len(ws) >= remaining]
            node = min(fitting, key=lambda n: len(free[n])) if fitting else max(free, key=lambda n: len(free[n]))
            take = free.pop(node)[:remaining]
            chosen += take
            remaining -= len(take)
        return chosen

    def pick_packed(self, k: int, cap: int, exclude: Collection[str] = (), shared_only: bool = False) -> list[str]:
        """Up to `k` workers for packed leases of `cap` bytes, fragmentation-aware (rule 7): each in turn the
        candidate (a shared worker with room, or a free one) whose lease strands the least capacity for the
        requests seen lately; ties: least room (best fit), registration order. `shared_only`: no free worker."""
        chosen: list[str] = []
        skip = set(exclude)
        rooms: dict[tuple[int, int], list[Slot]] = {}  # (room, memory) -> shared slots, by registration order
        for w in self._shared:
            slot = self.slots[w]
            if w not in skip and slot.room >= cap:
                rooms.setdefault((slot.room, slot.memory), []).append(slot)
        for group in rooms.values():
            group.sort(key=lambda s: s.order, reverse=True)
        while len(chosen) < k:
            best, best_key = None, None
            for (room, memory), group in rooms.items():
                if group:
                    key = (self._stranding(room, cap, memory), room, group[-1].order)
                    if best_key is None or key < best_key:
                        best, best_key = (room, memory), key
            fresh = None if shared_only else self.pick(1, [w for w in skip if self.is_free(w)])
            if fresh:
                slot = self.slots[fresh[0]]
                key = (self._stranding(slot.memory, cap, slot.memory), slot.memory, slot.order)
                if best_key is None or key < best_key:
                    chosen.append(fresh[0])
                    skip.add(fresh[0])
                    continue
            if best is None:
                break
            slot = rooms[best].pop()
            chosen.append(slot.worker)
            skip.add(slot.worker)
        return chosen

    # ------------------------------------------------------------ fragmentation (rule 7)

    def saw(self, cap: int, devices: int = 1) -> None:
        """A request for `devices` devices was made, packed leases of `cap` bytes each (0: whole devices)."""
        b = _WHOLE if not cap or not self._memory else min(_BINS, max(1, round(cap / self._memory * _BINS)))
        self._demand[b] = self._demand.get(b, 0.0) + devices
        self._seen += devices
        if self._seen >= _DEMAND_WINDOW:  # decay: the recent requests count most
            self._seen = 0
            self._demand = {b: n / 2 for b, n in self._demand.items() if n >= 1}

    def _stranding(self, room: int, cap: int, memory: int) -> float:
        """How much capacity a packed lease of `cap` on a device with `room` bytes free (of `memory`) strands: the
        growth of the device's fragmentation (FGD's measure, for one device)."""
        return self._fragment(room - cap, memory) - self._fragment(room, memory)

    def _fragment(self, free: int, memory: int) -> float:
        """Free bytes of a device that the recent requests could not use, weighted by how often each was asked
        for: all of them for a device that is partly leased (a whole-device request cannot use it) and a
        share of them for a request bigger than the room; none for a free device."""
        if free >= memory or free <= 0:
            return 0.0
        total = sum(self._demand.values()) + _WHOLE_PRIOR
        unusable = _WHOLE_PRIOR + sum(n for b, n in self._demand.items()
                                      if b == _WHOLE or b * self._memory > free * _BINS)
        return free * unusable / total


    # ------------------------------------------------------------ fault protection (pure queries)

    def backup_for(self, worker: str) -> str | None:
        """Where `worker`'s remote copies go (rule 6): a placeable worker on another node, else (no other node
        has one: a one-machine cluster) the next placeable one after it in registration order; None when there
        is no other placeable worker. Deterministic. When nodes register one after another, a node's workers
        map onto the next node's at the same offset (worker i of node A -> worker i of node B), so a node's
        copies spread over the next node instead of piling up on its first worker."""
        ring = self._ring
        n = len(ring)
        slot = self.slots.get(worker)
        if slot is None:  # not in the pool (lost): any placeable worker
            return next((w for _o, w in ring if self.slots[w].placeable), None)
        mine = self._placeable.get(slot.node, {})
        elsewhere = len(self._placeable) > (1 if mine else 0)
        i = bisect_left(ring, (slot.order, worker))
        start = i + (self._node_size[slot.node] if elsewhere else 1)
        for k in range(n):
            other = ring[(start + k) % n][1]
            cand = self.slots[other]
            if cand.placeable and other != worker and (cand.node != slot.node or not elsewhere):
                return other
        return None

    def free_off(self, node: str, prefer: Iterable[str] = (), skip: Collection[str] = ()) -> str | None:
        """A free worker on another node than `node`: on the first node of `prefer` that has one, else on the
        node with the fewest free workers (best fit for one device: whole free nodes stay whole). O(distinct
        free counts + len(prefer) + len(skip))."""
        for other in prefer:
            if other != node:
                w = self._first_free(other, skip)
                if w is not None:
                    return w
        for count in sorted(self._buckets):
            for other in self._buckets[count]:
                if other != node:
                    w = self._first_free(other, skip)
                    if w is not None:
                        return w
        return None

    def free_on(self, node: str, skip: Collection[str] = ()) -> str | None:
        """A free worker on `node`."""
        return self._first_free(node, skip)

    def _first_free(self, node: str, skip: Collection[str]) -> str | None:
        """The first registered of `node`'s free workers not in `skip` (O(free workers on the node))."""
        return min((w for w in self._free.get(node, ()) if w not in skip), key=lambda w: self.slots[w].order,
                   default=None)

    def shared(self, cap: int, skip: Collection[str] = ()) -> list[str]:
        """Placeable workers carrying only packed leases with room for `cap` more bytes, least room first."""
        slots = (self.slots[w] for w in self._shared if w not in skip)
        return [s.worker for s in sorted((s for s in slots if s.room >= cap), key=lambda s: (s.room, s.order))]

    # ------------------------------------------------------------ the indexes

    def _refresh(self, slot: Slot) -> None:
        live = slot.worker in self.slots and slot.placeable
        if live:
            self._placeable.setdefault(slot.node, {})[slot.worker] = None
        else:
            on_node = self._placeable.get(slot.node)
            if on_node is not None:
                on_node.pop(slot.worker, None)
                if not on_node:
                    del self._placeable[slot.node]
        self._set_free(slot, live and not slot.leases)
        if live and slot.leases and not slot.exclusive:
            self._shared[slot.worker] = None
        else:
            self._shared.pop(slot.worker, None)

    def _set_free(self, slot: Slot, free: bool) -> None:
        workers = self._free.get(slot.node)
        present = workers is not None and slot.worker in workers
        if present == free:
            return
        before = len(workers) if workers else 0
        if before:
            bucket = self._buckets[before]
            del bucket[slot.node]
            if not bucket:
                del self._buckets[before]
        if free:
            workers = self._free.setdefault(slot.node, {})
            workers[slot.worker] = None
            self.free_total += 1
        else:
            del workers[slot.worker]  # type: ignore[union-attr]
            self.free_total -= 1
        after = len(workers)  # type: ignore[arg-type]
        if after:
            self._buckets.setdefault(after, {})[slot.node] = None
        else:
            self._free.pop(slot.node, None)
