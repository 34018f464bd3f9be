"""Credentials without a server: the bearer header, API keys, a worker's derived credentials (execute token,
capabilities) and who may call what. Each refusal is asserted by its exact one-line message."""

from __future__ import annotations

import hashlib
import re

import pytest

from dtorch_protocol import auth

SECRET = "ab" * 32  # a worker secret (64 hex digits)
NOW = 1_000_000.0


def test_the_credential_is_the_bearer_value_of_the_authorization_header():
    assert auth.bearer("k1") == (("authorization", "Bearer k1"),)
    assert auth.credential_of([("user-agent", "x"), ("authorization", "Bearer  k1 ")]) == "k1"


@pytest.mark.parametrize("metadata, message", [
    ([], "no credential: set DTORCH_API_KEY to a key from `dtorch-controller keys create`"),
    ([("x-authorization", "Bearer k")], "no credential: set DTORCH_API_KEY to a key from `dtorch-controller keys "
                                        "create`"),
    ([("authorization", "")], "empty credential: expected 'authorization: Bearer <key>'"),
    ([("authorization", "Bearer ")], "empty credential: expected 'authorization: Bearer <key>'"),
    ([("authorization", "Bearer    ")], "empty credential: expected 'authorization: Bearer <key>'"),
    ([("authorization", "Basic k1")], "empty credential: expected 'authorization: Bearer <key>'"),
    ([("authorization", "bearer k1")], "empty credential: expected 'authorization: Bearer <key>'"),
])
def test_a_missing_or_empty_credential_is_refused_by_name(metadata, message):
    with pytest.raises(auth.Unauthenticated) as e:
        auth.credential_of(metadata)
    assert str(e.value) == message


def test_api_keys_are_id_and_secret_and_only_the_secrets_hash_is_kept():
    key_id, key = auth.new_key()
    assert re.fullmatch(r"[0-9a-f]{8}", key_id) and key.startswith(f"dtorch_{key_id}_")
    assert auth.parse_key(key) == (key_id, key[len(f"dtorch_{key_id}_"):])
    assert len(auth.parse_key(key)[1]) == 43
    assert auth.key_hash(key) == hashlib.sha256(key[len(f"dtorch_{key_id}_"):].encode()).hexdigest()
    assert auth.new_key()[1] != key


@pytest.mark.parametrize("key", ["", "let-me-in", "dtorch_0123abcd_short", "dtorch_0123ABCD_" + "a" * 43,
                                 "dtorch_0123abcd_" + "a" * 44, "dtorch_0123abcd_" + "a" * 42 + "!",
                                 "xtorch_0123abcd_" + "a" * 43, "dtorch_0123abcd_" + "a" * 43 + "\n",
                                 " dtorch_0123abcd_" + "a" * 43])
def test_a_malformed_key_is_refused(key):
    with pytest.raises(auth.Unauthenticated) as e:
        auth.parse_key(key)
    assert str(e.value) == "malformed API key (expected dtorch_<id>_<secret>)"
    with pytest.raises(auth.Unauthenticated):
        auth.key_hash(key)


def test_the_key_comes_from_the_environment_stripped(monkeypatch):
    monkeypatch.setenv("DTORCH_API_KEY", "  dtorch_k \n")
    assert auth.key_from_env() == "dtorch_k"
    monkeypatch.delenv("DTORCH_API_KEY")
    assert auth.key_from_env() == ""


def test_worker_secrets_are_fresh_256_bit_hex():
    a, b = auth.new_worker_secret(), auth.new_worker_secret()
    assert re.fullmatch(r"[0-9a-f]{64}", a) and a != b


def test_derived_credentials_are_macs_keyed_by_the_worker_secret():
    other = "cd" * 32
    token = auth.execute_token(SECRET)
    assert token.startswith("ctl1.") and token != auth.execute_token(other)
    assert token == auth.execute_token(SECRET)
    assert re.fullmatch(r"[0-9a-f]{64}", auth.report_proof(SECRET))
    assert auth.report_proof(SECRET) != auth.report_proof(other)
    assert auth.report_proof(SECRET) != token.removeprefix("ctl1.")  # a report proof is not an execute token


def test_a_capability_names_role_session_expiry_and_memory_cap():
    cap = auth.mint(SECRET, auth.PEER, "s1", ttl_s=60, now=NOW)
    version, role, session, expires, mac = cap.split(".")  # no cap: the form 1.8 clients read the expiry of
    assert (version, role, session, expires) == ("cap1", "peer", "s1", str(int(NOW + 60)))
    assert re.fullmatch(r"[0-9a-f]{64}", mac)
    assert auth.cap_expiry(cap) == int(NOW + 60)
    assert auth.mint(SECRET, auth.CLIENT, "s1", now=NOW).split(".")[3] == str(int(NOW + 3600))
    assert auth.mint(SECRET, auth.CLIENT, "s1", now=NOW) != auth.mint(SECRET, auth.PEER, "s1", now=NOW)
    assert auth.mint(SECRET, auth.CLIENT, "s1", now=NOW) != auth.mint(SECRET, auth.CLIENT, "s2", now=NOW)


@pytest.mark.parametrize("cap", ["", "cap1.peer.s1.x.mac", "cap1.peer.s1.mac", "a.b.c.d.e.f"])
def test_a_malformed_capability_has_no_expiry(cap):
    assert auth.cap_expiry(cap) == 0


@pytest.mark.parametrize("role, session", [(auth.CONTROLLER, "s1"), (auth.TENANT, "s1"), (auth.CLIENT, ""),
                                           (auth.PEER, "s.1")])
def test_only_client_and_peer_capabilities_of_a_plain_session_are_minted(role, session):
    with pytest.raises(ValueError) as e:
        auth.mint(SECRET, role, session)
    assert str(e.value) == f"cannot mint a {role!r} capability for session {session!r} with cap 0"


def test_a_worker_accepts_its_own_execute_token_and_capabilities():
    worker = auth.WorkerAuth(SECRET)
    assert worker.secret == SECRET
    assert worker.authenticate(auth.execute_token(SECRET)) == auth.Caller(auth.CONTROLLER)
    assert worker.authenticate(auth.mint(SECRET, auth.CLIENT, "s1", now=NOW), now=NOW) == auth.Caller("client", "s1")
    assert worker.authenticate(auth.mint(SECRET, auth.PEER, "s1", ttl_s=5, now=NOW), now=NOW + 5) == \
        auth.Caller("peer", "s1")  # good up to and including its expiry second
    assert auth.WorkerAuth().secret != auth.WorkerAuth().secret


def test_a_capability_carries_its_sessions_memory_cap_and_a_cap1_one_none():
    """The cap reaches a worker that has run none of the session's batches (a packed session's first uploads)."""
    worker = auth.WorkerAuth(SECRET)
    capped = auth.mint(SECRET, auth.CLIENT, "s1", now=NOW, memory_cap=64 << 20)
    assert capped.split(".")[4] == str(64 << 20)
    assert worker.authenticate(capped, now=NOW) == auth.Caller("client", "s1", memory_cap=64 << 20)
    with pytest.raises(auth.Unauthenticated, match="not issued for this worker"):  # a raised cap is a forgery
        worker.authenticate(capped.replace(f".{64 << 20}.", f".{1 << 40}."), now=NOW)
    with pytest.raises(auth.Unauthenticated, match="not issued for this worker"):  # and so is a dropped one
        worker.authenticate(capped.replace(f".{64 << 20}.", ".0."), now=NOW)
    assert auth.cap_expiry(capped) == int(NOW + 3600)
    expires = str(int(NOW + 60))  # what a controller of protocol 1.8 mints
    old = f"cap1.client.s1.{expires}.{auth._mac(SECRET, 'cap1', 'client', 's1', expires)}"
    assert worker.authenticate(old, now=NOW) == auth.Caller("client", "s1")
    assert auth.mint(SECRET, auth.CLIENT, "s1", now=NOW + 60 - 3600) == old  # and what a session without a cap gets
    with pytest.raises(ValueError, match="with cap -1"):
        auth.mint(SECRET, auth.CLIENT, "s1", memory_cap=-1)


def test_a_worker_refuses_what_it_did_not_issue():
    worker, other = auth.WorkerAuth(SECRET), "cd" * 32

    def refusal(credential: str, now: float = NOW) -> str:
        with pytest.raises(auth.Unauthenticated) as e:
            worker.authenticate(credential, now=now)
        return str(e.value)

    assert refusal(auth.execute_token(other)) == \
        "wrong execute token: Execute is accepted only from this worker's controller"
    assert refusal("ctl1.") == "wrong execute token: Execute is accepted only from this worker's controller"
    not_cap = "not a capability for this worker (ask the controller for the session's locations again)"
    good = auth.mint(SECRET, auth.PEER, "s1", now=NOW)
    for bad in ("", "let-me-in", good + ".x", "cap3" + good[4:], "cap2" + good[4:],
                good.replace(".peer.", ".controller."), good.replace(".peer.", ".tenant."),
                good.replace(f".{int(NOW + 3600)}.", ".soon."),
                ".".join(good.split(".")[:4])):
        assert refusal(bad) == not_cap, bad
    assert refusal(auth.mint(other, auth.PEER, "s1", now=NOW)) == "capability refused: not issued for this worker"
    assert refusal(good.replace(".peer.", ".client.")) == "capability refused: not issued for this worker"
    assert refusal(good.replace(".s1.", ".s2.")) == "capability refused: not issued for this worker"
    longer = good.replace(f".{int(NOW + 3600)}.", f".{int(NOW + 7200)}.")
    assert refusal(longer) == "capability refused: not issued for this worker"
    session = "0123456789abcdef"
    expired = auth.mint(SECRET, auth.CLIENT, session, ttl_s=5, now=NOW)
    assert refusal(expired, now=NOW + 6) == "capability for session 01234567 expired"


def test_a_peer_capability_reaches_its_sessions_backups_a_client_capability_only_its_session():
    peer, client = auth.Caller(auth.PEER, "s1"), auth.Caller(auth.CLIENT, "s1")
    assert auth.covers(peer, "s1") and auth.covers(client, "s1")
    assert auth.covers(peer, "s1#snap3")
    assert not auth.covers(client, "s1#snap3")
    assert not auth.covers(peer, "s10") and not auth.covers(peer, "s2") and not auth.covers(peer, "#s1")
    assert not auth.covers(auth.Caller(auth.TENANT, "s1"), "s1#snap3")


def test_callers_describe_themselves_in_refusals():
    assert auth.Caller(auth.TENANT, "alice", key_id="0a1b2c3d").describe() == "tenant 'alice' (key 0a1b2c3d)"
    assert auth.Caller(auth.ADMIN, "ops", key_id="k").describe() == "admin 'ops' (key k)"
    assert auth.Caller(auth.CLIENT, "0123456789").describe() == "a client capability for session 01234567"
    assert auth.Caller(auth.PEER, "s1").describe() == "a peer capability for session s1"
    assert auth.Caller(auth.WORKER, key_id="k9").describe() == "the worker credential (key k9)"
    assert auth.Caller(auth.CONTROLLER).describe() == "the controller credential"


# The access policy, written out once more as the operator reads it (docs/architecture.md, "Tenancy"): a
# wrong entry in auth.ROLES would let someone in (or lock a role out), and the servers' tests read ROLES.
POLICY = {
    "tenant": {"OpenSession", "OpenMesh", "Submit", "Sync", "CloseSession", "KeepAlive", "Status"},
    "admin": {"OpenSession", "OpenMesh", "Submit", "Sync", "CloseSession", "KeepAlive", "Status", "Drain",
              "Migrate"},
    "worker": {"Register", "Report"},
    "controller": {"Execute"},
    "client": {"Profile", "Pull", "Put"},
    "peer": {"Pull", "PullShards", "PutShards"},
}


def test_each_role_may_call_exactly_its_methods():
    allowed = {role: {method for methods in auth.ROLES.values() for method, roles in methods.items() if role in roles}
               for role in POLICY}
    assert allowed == POLICY
    assert auth.CLUSTER_ROLES == {"worker", "controller", "peer"}
    assert auth.USERS == {"tenant", "admin"} and auth.KEY_ROLES == ("tenant", "admin", "worker")
