"""The rendezvous of process groups is not open to whoever reaches a worker's store (groups.py, rules 1 and 2).

Real workers in this process, real TCPStores and gloo groups: the store listens on the worker's host only, a
CmdGroup without the group's secret or naming the wrong worker or store is refused, and members told different
memberships, or a stranger who took a member's slot, make every member refuse the group (its ops fail with that
line; nothing waits past the group's timeout).
"""

from __future__ import annotations

import datetime
import itertools
import socket

import msgspec
import pytest
import torch

from dtorch_controller.core import collectives as lowering
from dtorch_protocol.messages import CmdGroup, Execute
from dtorch_protocol.placement_types import Replicate, Shard
from dtorch_worker.server import start_worker
from dtorch_worker.store import Poison

_SESSIONS = itertools.count()


@pytest.fixture(scope="module")
def workers():
    ws = [start_worker() for _ in range(2)]
    yield ws
    for w in ws:
        w.stop()
    for w in ws:
        w.executor.groups.stop(reap_s=30.0)


def gather_commands(ws, session: str, timeout_s: float = 10.0) -> dict[str, list]:
    """The controller's commands for a Shard(0) -> Replicate of a (4,) tensor on w0 and w1 (tensor 1 into 2)."""
    for d, w in enumerate(ws):
        w.store.put((session, 1, d), torch.full((2,), float(d + 1)))
    members = {f"w{i}": lowering.Member(w.address, w.executor.groups.rendezvous) for i, w in enumerate(ws)}
    low = lowering.lower((4,), "float32", ((0, 1), (2,)), (Shard(0),), (Replicate(),), ((0, "w0"), (1, "w1")),
                         (("w0", "cpu", True), ("w1", "cpu", True)))
    return lowering.commands(low, lowering.CommGroups(), members, 1, 2, "float32", ({0: [2], 1: [2]},
                             {0: [4], 1: [4]}), timeout_s=timeout_s)


def run(ws, session: str, cmds: dict[str, list]) -> list:
    """Send each worker its batch, wait, and return each worker's output (a tensor or a Poison)."""
    seqs = []
    for i, w in enumerate(ws):
        seq = w.executor._executed + len(w.executor._pending) + 1
        assert w.executor.submit(Execute(seq=seq, session=session, cmds=cmds[f"w{i}"]))
        seqs.append(seq)
    for w, seq in zip(ws, seqs):
        assert w.executor.wait_completed(seq, 30.0)
    return [w.store.get((session, 2, d)) for d, w in enumerate(ws)]


def replace_group(cmds: list, **changes) -> list:
    return [msgspec.structs.replace(c, **changes) if isinstance(c, CmdGroup) else c for c in cmds]


def test_the_store_listens_on_the_workers_host_only(workers):
    host, _, port = workers[0].executor.groups.rendezvous.rpartition(":")
    assert host == "127.0.0.1"
    with socket.create_connection((host, int(port)), timeout=5):
        pass
    # torch's own store would listen on every interface; 127.0.0.2 is this machine too, but not the worker's host
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", int(port)), timeout=5).close()


def test_the_store_alone_closes_its_listening_socket():
    """The store closes the socket it was handed; nothing else closes that descriptor number again later, when the
    number may already be another socket's (a gloo pair in another group's rendezvous: "Bad file descriptor")."""
    import gc
    import os

    from dtorch_worker.device import backend_for
    from dtorch_worker.groups import Groups

    groups = Groups(backend_for(torch.device("cpu")))
    assert groups.rendezvous
    server = groups._server  # the store outlives its owner a while (it closes its socket on its own loop thread)
    del groups
    gc.collect()
    bystander = socket.socket()
    try:
        del server
        gc.collect()
        os.fstat(bystander.fileno())  # EBADF if the listener's number was closed twice, the second time under it
    finally:
        bystander.close()


@pytest.mark.parametrize("keyed", [True, False], ids=["key", "protocol 1.5 (no key)"])
def test_the_group_meets_and_gives_the_values(workers, keyed):
    """With its secret; without one (a controller of protocol 1.5, which newer workers serve) as before."""
    session = f"sess-meet-{next(_SESSIONS)}"
    cmds = gather_commands(workers, session)
    if not keyed:
        cmds = {w: replace_group(batch, key="") for w, batch in cmds.items()}
    out = run(workers, session, cmds)
    for value in out:
        assert torch.equal(value, torch.tensor([1.0, 1.0, 2.0, 2.0])), value


@pytest.mark.parametrize("case,why", [
    ("short key", "carries a key shorter than 16 characters"),
    ("another worker", "names another worker at this worker's rank"),
    ("another store", "puts the rendezvous on another store than this worker's, at rank 0"),
])
def test_a_group_command_failing_a_check_is_refused(workers, case, why):
    session = f"sess-check-{next(_SESSIONS)}"
    cmds = gather_commands(workers, session, timeout_s=3.0)
    group = next(c for c in cmds["w0"] if isinstance(c, CmdGroup))
    change = {"short key": {"key": "0123456789abcde"}, "another store": {"store": "127.0.0.1:1"},
              "another worker": {"members": ["w9 at 10.0.0.9:7000", group.members[1]]}}[case]
    cmds["w0"] = replace_group(cmds["w0"], **change)
    out = run(workers, session, cmds)
    errors = workers[0].executor.take_errors()[session]
    assert errors[0].message.endswith(f"CmdGroup of group g1 (generation 1) refused: it {why}"), errors
    assert all(isinstance(v, Poison) for v in out), out  # w0 never joins: w1 fails within its bound
    workers[1].executor.take_errors()


def test_members_told_different_memberships_refuse_the_group(workers):
    session = f"sess-differ-{next(_SESSIONS)}"
    cmds = gather_commands(workers, session)
    group = next(c for c in cmds["w1"] if isinstance(c, CmdGroup))
    cmds["w1"] = replace_group(cmds["w1"], members=["w0 at 10.0.0.9:7000", group.members[1]])
    out = run(workers, session, cmds)
    lines = [v.report.message for v in out]
    assert all(isinstance(v, Poison) for v in out), out
    assert "rank 1 (" in lines[0] and "joined with a different membership; refused" in lines[0], lines
    assert f"rank 0 (w0 at 10.0.0.9:7000) joined as 'w0 at {workers[0].address}'; refused" in lines[1], lines
    for w in workers:
        w.executor.take_errors()


def test_a_stranger_in_a_members_slot_makes_the_group_refused(workers):
    """Even one who learned the group's secret: rank 1's slot is claimed once, and every member checks it."""
    from torch.distributed import PrefixStore, TCPStore

    session = f"sess-stranger-{next(_SESSIONS)}"
    cmds = gather_commands(workers, session)
    group = next(c for c in cmds["w0"] if isinstance(c, CmdGroup))
    host, _, port = group.store.rpartition(":")
    stranger = PrefixStore(f"dtorch/{group.key}/g1/1", TCPStore(host, int(port), None, is_master=False,
                                                                timeout=datetime.timedelta(seconds=5)))
    stranger.set("joined/1", "0" * 32 + " mallory at 10.6.6.6:1")
    out = run(workers, session, cmds)
    lines = [v.report.message for v in out]
    assert "rank 1 (" in lines[0] and "joined as 'mallory at 10.6.6.6:1'; refused" in lines[0], lines
    assert "rank 1's slot was already taken (by 'mallory at 10.6.6.6:1'); refused" in lines[1], lines
    for w in workers:
        w.executor.take_errors()
