"""Fixtures of the core's tests; the harness and helpers themselves live in `_core_helpers`."""

from __future__ import annotations

from typing import Any

import pytest

from _core_helpers import Harness, is_refusal
from dtorch_controller.core.policies import make_policy
from dtorch_protocol import messages as m
from dtorch_protocol.wire import hello


@pytest.fixture
def h() -> Harness:
    # The scheduling rules' tests were written against the `priority` policy (classes, reservations); the
    # default policy (`dtorch`) has tests of its own (test_core_policy_dtorch.py).
    return Harness(policy=make_policy("priority"))


@pytest.fixture
def make_harness():
    return Harness


@pytest.fixture
def refused():
    return is_refusal


# ---------------------------------------------------------------- keys for the real gRPC server


class Keys:
    """A key file with an admin, a worker and two tenants' keys (alice, bob)."""

    def __init__(self, path: Any) -> None:
        from dtorch_controller.keys import Keyring, new_key_file

        self.path = path
        self.admin, self.worker, self.alice, self.bob = new_key_file(
            path, ("admin", ""), ("worker", ""), ("tenant", "alice"), ("tenant", "bob"))
        self.keyring = Keyring(path)

    def authenticate(self, credential: str) -> Any:
        return self.keyring.authenticate(credential)


@pytest.fixture
def keys(tmp_path) -> Keys:
    return Keys(tmp_path / "keys.json")


@pytest.fixture(scope="module")
def module_keys(tmp_path_factory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys") / "keys.json")


@pytest.fixture(name="register_worker")
def _register_worker_fixture() -> Any:
    return register_worker


def register_worker(stub: Any, address: str, secret: str | None = None, memory: int = 0, **fields: Any) -> Any:
    """Register a (fake) worker at `address` over `stub` (a worker key); returns (Registered, its report proof)."""
    from dtorch_protocol import auth

    secret = secret or auth.new_worker_secret()
    reply = stub.call("Register", m.RegisterWorker(hello=hello("worker"), address=address, device_type="cpu",
                                                   memory_bytes=memory, secret=secret, **fields), timeout=5)
    return reply, auth.report_proof(secret)
