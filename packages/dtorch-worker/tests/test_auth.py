"""Every Worker RPC, of every kind (unary Execute, server-streaming Pull and PullShards, client-streaming Put
and PutShards), refuses a call with no credential, an empty one or a wrong one, and takes only its roles.

The calls go out raw (`wire.raw_call`) with a valid request for each method, so a method whose check were
skipped would answer something else. The method list comes from `wire.SERVICES`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from dtorch_protocol import auth, wire
from dtorch_protocol import messages as m
from dtorch_worker.server import WorkerHandle, start_worker
from dtorch_worker.transfer import put_chunks

SERVICE = "dtorch.Worker"
METHODS = sorted(wire.SERVICES[SERVICE])
S = "sess-auth"


def samples(tid: int) -> dict[str, bytes | list[bytes]]:
    """A valid request for every method (Put and PutShards are streams), naming session S."""
    return {
        "Execute": wire.encode(m.Execute(seq=10**6 + tid, session=S, cmds=[])),
        "Pull": wire.encode(m.PullRequest(session=S, tid=1, device=0, timeout_s=0.0)),
        "Put": [wire.encode(c) for c in put_chunks(S, tid, 0, torch.ones(2))],
        "PullShards": wire.encode(m.ShardsRequest(session=S, devices={0: [1]}, timeout_s=0.0)),
        "PutShards": [wire.encode(m.ShardsChunk(namespace=f"{S}#s1"))],
        "Profile": wire.encode(m.ProfileRequest(session=S, start=False)),
    }


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[WorkerHandle, grpc.Channel]]:
    w = start_worker()
    w.store.put((S, 1, 0), torch.ones(2))
    channel = wire.open_channel(w.address)
    yield w, channel
    channel.close()
    w.stop(0)


def test_every_method_has_a_sample():
    assert set(samples(0)) == set(METHODS)
    assert {kind for _, _, kind in wire.SERVICES[SERVICE].values()} == {"unary", "stream_out", "stream_in"}


def _bad_credentials(w: WorkerHandle) -> dict[str, list[tuple[str, str]] | None]:
    other = auth.WorkerAuth()  # another worker's secret: its credentials mean nothing here
    expired = auth.mint(w.credentials.secret, auth.CLIENT, S, ttl_s=-10)
    forged = w.capability(S)[:-8] + "00000000"
    return {
        "none": None,
        "empty header": [(auth.HEADER, "")],
        "empty bearer": [(auth.HEADER, "Bearer ")],
        "malformed": [(auth.HEADER, "Bearer let-me-in")],
        "api key": [(auth.HEADER, f"Bearer {auth.new_key()[1]}")],
        "other worker's execute token": auth.bearer(auth.execute_token(other.secret)),
        "other worker's capability": auth.bearer(auth.mint(other.secret, auth.PEER, S)),
        "expired capability": auth.bearer(expired),
        "forged capability": auth.bearer(forged),
    }


@pytest.mark.parametrize("method", METHODS)
def test_a_call_without_a_valid_credential_is_refused(worker, method):
    w, channel = worker
    for i, (name, metadata) in enumerate(_bad_credentials(w).items()):
        code, details = wire.raw_call(channel, SERVICE, method, samples(100 + i)[method], metadata, timeout=5)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (method, name, code, details)
        assert details and "\n" not in details
    assert (S, 100, 0) not in w.store and w.executor.completed < 10**6  # nothing got in


@pytest.mark.parametrize("method", METHODS)
def test_each_method_takes_exactly_its_roles(worker, method):
    """Execute is the controller's; Put a client's; PullShards and PutShards a peer's; Pull both."""
    w, channel = worker
    credentials = {auth.CONTROLLER: w.execute_token(), auth.CLIENT: w.capability(S),
                   auth.PEER: w.capability(S, auth.PEER)}
    for i, (role, credential) in enumerate(credentials.items()):
        code, details = wire.raw_call(channel, SERVICE, method, samples(200 + i)[method], auth.bearer(credential),
                                      timeout=5)
        if role in auth.ROLES[SERVICE][method]:
            assert code == grpc.StatusCode.OK, (method, role, code, details)
        else:
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, role, code, details)


@pytest.mark.parametrize("method", ["Pull", "Put", "PullShards", "PutShards", "Profile"])
def test_a_capability_reaches_its_own_session_only(worker, method):
    """A tenant holding a capability for its session cannot read, write, copy or profile another session."""
    w, channel = worker
    role = auth.CLIENT if method in ("Pull", "Put", "Profile") else auth.PEER
    cap = auth.bearer(w.capability("someone-else", role))
    code, details = wire.raw_call(channel, SERVICE, method, samples(300)[method], cap, timeout=5)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "refused" in details, (code, details)
    assert (S, 300, 0) not in w.store


def test_a_client_capability_does_not_reach_backup_namespaces(worker):
    w, channel = worker
    w.store.put((f"{S}#s1", 1, 0), torch.ones(2))
    pull = wire.encode(m.PullRequest(session=f"{S}#s1", tid=1, device=0, timeout_s=0.0))
    code, _ = wire.raw_call(channel, SERVICE, "Pull", pull, auth.bearer(w.capability(S)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = wire.raw_call(channel, SERVICE, "Pull", pull, auth.bearer(w.capability(S, auth.PEER)))
    assert code == grpc.StatusCode.OK
    for role in (auth.CLIENT, auth.PEER):  # nor does any capability profile one (only its session's own client)
        code, _ = wire.raw_call(channel, SERVICE, "Profile", wire.encode(m.ProfileRequest(session=f"{S}#s1",
                                start=True)), auth.bearer(w.capability(S, role)))
        assert code == grpc.StatusCode.PERMISSION_DENIED


def test_a_closed_sessions_capabilities_are_refused(worker):
    """A capability lives an hour; its session may close sooner. Uploads to a closed session were accepted into a
    namespace nobody accounted for or ever freed (eight 16 MiB Puts after the close were all kept)."""
    w, channel = worker
    closed = "sess-closed"
    stub = wire.Stub(SERVICE, w.address, w.execute_token())
    batch = m.Execute(seq=w.executor.completed + 1, session=closed, cmds=[m.CmdCloseSession()])
    assert stub.call("Execute", batch).ok and w.executor.wait_completed(batch.seq, 10)
    stub.close()
    requests = {
        "Pull": wire.encode(m.PullRequest(session=closed, tid=1, device=0, timeout_s=0.0)),
        "Put": [wire.encode(c) for c in put_chunks(closed, 1, 0, torch.ones(2))],
        "PullShards": wire.encode(m.ShardsRequest(session=closed, devices={0: [1]}, timeout_s=0.0)),
        "PutShards": [wire.encode(m.ShardsChunk(namespace=f"{closed}#s1"))],
    }
    for method, request in requests.items():
        role = auth.CLIENT if method in ("Pull", "Put") else auth.PEER
        code, details = wire.raw_call(channel, SERVICE, method, request, auth.bearer(w.capability(closed, role)),
                                      timeout=5)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "the session was closed" in details, (method, details)
    assert (closed, 1, 0) not in w.store


def test_a_duplicate_batch_is_an_error_the_controller_sees(worker):
    """An Execute at a batch number already queued or done used to be answered ok ("duplicate"): the controller
    never knew that the batch it sent was dropped."""
    w, _ = worker
    stub = wire.Stub(SERVICE, w.address, w.execute_token())
    batch = m.Execute(seq=w.executor.completed + 1, session=S, cmds=[])
    assert stub.call("Execute", batch).ok
    assert w.executor.wait_completed(batch.seq, 10)
    again = stub.call("Execute", batch)
    assert not again.ok and "duplicate" in again.message
    stub.close()


def test_out_of_order_batches_are_bounded_per_session(monkeypatch):
    from dtorch_worker import executor

    monkeypatch.setattr(executor, "MAX_AHEAD_PER_SESSION", 3)
    ex = executor.Executor(executor.TensorStore())  # not started: nothing runs, batches wait
    assert ex.submit(m.Execute(seq=1, session="a", cmds=[]))  # in order: never bounded here
    for seq in (3, 4, 5):  # behind the gap at 2
        assert ex.submit(m.Execute(seq=seq, session="a", cmds=[]))
    with pytest.raises(executor.BatchRefused, match=r"3 batches of session a \(3 in all\) already wait behind batch 2"):
        ex.submit(m.Execute(seq=6, session="a", cmds=[]))
    assert ex.submit(m.Execute(seq=6, session="b", cmds=[]))  # per session
    assert ex.submit(m.Execute(seq=2, session="a", cmds=[]))  # the gap fills: what waited is in order now
    assert ex.submit(m.Execute(seq=7, session="a", cmds=[]))


def test_pulls_whose_callers_gave_up_free_their_threads(worker):
    """A Pull waiting (up to its timeout) for a shard that never comes used to keep its thread after the client
    went away; 70 of them took a worker down. Now the wait ends with the call, and the session's slots free up."""
    w, channel = worker
    stub = wire.Stub(SERVICE, w.address, w.capability(S))
    for _ in range(20):  # more than the 16 a session may have in flight: they end when their callers give up
        with pytest.raises((TimeoutError, wire.LimitExceeded)):
            list(stub.stream("Pull", m.PullRequest(session=S, tid=999, device=0, timeout_s=600.0), timeout=0.1))
    deadline = time.monotonic() + 10
    while True:  # the handlers notice within moments, not after 600 s
        try:
            (chunk,) = list(stub.stream("Pull", m.PullRequest(session=S, tid=1, device=0, timeout_s=0.0)))
            break
        except wire.LimitExceeded:
            assert time.monotonic() < deadline, "the abandoned Pulls still hold the session's slots"
            time.sleep(0.05)
    assert chunk.dtype == "float32"
    stub.close()
