"""Shared assertions for the integration tests, and starting/stopping a controller and workers with their CLIs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

# The CLIs, found through the running interpreter (its environment has the packages), never through PATH
CONTROLLER = (sys.executable, "-m", "dtorch_controller")
WORKER = (sys.executable, "-m", "dtorch_worker")


def assert_same(dt, expected, exact=True):
    got = dt.to_torch()
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    if exact:
        assert torch.equal(got, expected), (got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@dataclass
class Keys:
    """A key file for a cluster started with the CLIs: an admin, a worker key, two tenants (alice, bob)."""

    path: Path
    admin: str
    worker: str
    alice: str
    bob: str

    @classmethod
    def make(cls, directory: Path) -> Keys:
        from dtorch_controller.keys import new_key_file  # here: compat.py imports this module without the packages

        path = directory / "keys.json"
        keys = new_key_file(path, ("admin", ""), ("worker", ""), ("tenant", "alice"), ("tenant", "bob"))
        return cls(path, *keys)

    def env(self, key: str, **extra: str) -> dict[str, str]:
        """This process's environment without DTORCH_* settings, plus the key file and `key` as the API key."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DTORCH_")}
        return {**env, "DTORCH_KEYS": str(self.path), "DTORCH_API_KEY": key, **extra}


@contextmanager
def tap(session: Any, sent: list | None = None, released: list | None = None) -> Iterator[None]:
    """Record what `session` emits (into `sent`) and releases (into `released`) meanwhile.

    Automatic capture swaps the session's `emit` and `release` for its own while a step runs and puts back what
    it found when the step ends: a tap wraps what is installed now and, at its end, puts back what it replaced
    only where its wrapper is still installed. Putting back a swapped-in method after its step ended would send
    every later instruction or release of the shared session to a finished step, where it stays."""
    wrapped = {}
    for name, into in (("emit", sent), ("release", released)):
        if into is not None:
            inner = getattr(session, name)
            wrapped[name] = (inner, lambda item, inner=inner, into=into: (into.append(item), inner(item))[1])
            setattr(session, name, wrapped[name][1])
    try:
        yield
    finally:
        for name, (inner, wrapper) in wrapped.items():
            if getattr(session, name) is wrapper:
                setattr(session, name, inner)


def worker_bytes(cluster: Any) -> dict[str, int]:
    """Bytes of shards on each worker, once they stop changing: deletes go out with later batches."""
    import gc

    import dtorch

    gc.collect()
    last = None
    for _ in range(40):
        cluster.sync()
        now = {w.worker: w.bytes for w in dtorch.status().workers}
        if now == last:
            return now
        last = now
        time.sleep(0.05)
    return last


def run_scenario(script: str, *args: str, env: dict | None = None, timeout: float = 600) -> dict:
    """Run integration/`script` in a process (and embedded cluster) of its own; the JSON line it ends with.

    A run still going after `timeout` is aborted with faulthandler on: the failure shows where each of its threads
    waited."""
    full_env = {k: v for k, v in os.environ.items() if k != "DTORCH_CONTROLLER"} | (env or {})
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env | {"PYTHONFAULTHANDLER": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to stderr, then it dies
        _, stderr = proc.communicate(timeout=60)
        pytest.fail(f"{script} {' '.join(args)} was still running after {timeout:.0f}s; its stderr ends:\n"
                    f"{stderr[-8000:]}", pytrace=False)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def small_mlp():
    """The capture tests' MLP (8 -> 16 -> 8, GELU), seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def small_batches(n, rows=8):
    """n seeded (input, target) pairs for `small_mlp`."""
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(rows, 8, generator=gen), torch.randn(rows, 8, generator=gen)) for _ in range(n)]


def mlp_train_step(model, opt, x, y, dropout=0.0):
    """One training step of the integration tests' small MLPs (MSE, clipped gradients): the loss."""
    import torch.nn.functional as F

    loss = ((F.dropout(model(x), dropout, training=dropout > 0) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def _popen(argv: Sequence[str], env: dict[str, str], log: Path | None, popen: dict[str, Any]) -> subprocess.Popen:
    """Output to `log` (stderr too), or to a pipe when there is none; the file is closed here, the child keeps it."""
    if log is None:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, **popen)


def start_controller(port_file: Path, env: dict[str, str], *args: str, log: Path | None = None,
                     limit: float = 60.0, command: Sequence[str] = CONTROLLER,
                     **popen: Any) -> tuple[subprocess.Popen, str]:
    """Start a controller on a free port and return it with its address, read from `port_file`.

    The wait is bounded: a controller that exits or does not write the file within `limit` seconds is killed
    and the error carries the end of its output, so that a failed start says why instead of hanging a test.
    """
    argv = [*command, "--listen", "127.0.0.1:0", "--port-file", str(port_file), *args]
    proc = _popen(argv, env, log, popen)
    deadline = time.monotonic() + limit
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() >= deadline:
            why = f"exited with {proc.returncode}" if proc.poll() is not None else f"no address within {limit:g}s"
            if proc.poll() is None:
                proc.kill()
            try:
                out, _ = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                out = ""
            if log is not None:
                out = log.read_bytes().decode(errors="replace")
            raise RuntimeError(f"the controller did not start ({why}): {' '.join(argv)}\n{(out or '')[-3000:]}")
        time.sleep(0.05)
    return proc, port_file.read_text().strip()


def start_worker(address: str, env: dict[str, str], *args: str, log: Path | None = None,
                 command: Sequence[str] = WORKER, **popen: Any) -> subprocess.Popen:
    """Start a worker that registers with the controller at `address`."""
    return _popen([*command, "--controller", address, *args], env, log, popen)


def stop_all(procs: Iterable[subprocess.Popen], grace: float = 10.0) -> None:
    """Terminate the processes still running, in the order given, then kill those not gone after `grace` seconds:
    a teardown that neither hangs nor leaves processes behind."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
