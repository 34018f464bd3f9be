"""An embedded local cluster: a controller and N worker processes on this machine, owned by this process.

Started when no DTORCH_CONTROLLER is set. The processes watch this process and exit with
it, and `stop()` (run at exit) ends them and removes the cluster's temporary directory (its keys and logs), so
nothing is left behind. Where a process of it failed (it did not start, or exited with an error before `stop()`),
the logs stay there for the user to read, and the error or a line on stderr names the directory. Needs the
dtorch-controller and dtorch-worker packages (`pip install dtorch-api[local]`).

It makes its own keys, with no set-up: a key file in its private temporary directory with an admin key
(this process's: `dtorch.drain` and `dtorch.migrate` work locally) and a worker key for its workers.
Traffic stays on loopback, in cleartext.

The controller and the workers start at once (each worker's start is mostly importing torch): the controller's port
is picked and held here first (`_hold_port`), so the workers are told its address before it listens, and register
once it does (they retry while it is not up). `connect` starts them before it imports the rest of DTorch (torch
among it), and waits for them after (`wait=False`, then `wait()`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dtorch_protocol import messages as m
from dtorch_protocol import wire
from dtorch_protocol.tls import ENV as TLS_ENV

# a cluster of this process's own: none of the settings meant for a shared one
_NOT_INHERITED = {"DTORCH_API_KEY", "DTORCH_KEYS", "DTORCH_TOKEN", *TLS_ENV.values()}
REGISTER_ATTEMPTS = 60  # a worker's tries while the controller starts (backoff up to 2 s: about 2 minutes)


def _hold_port() -> tuple[int, socket.socket | None]:
    """A free loopback port, and the socket holding it: bound (never listening) with SO_REUSEPORT, as gRPC binds its
    servers, so the controller can listen on it while it is held and no other program can take it first. Where the
    option does not exist (Windows) it is let go at once (None), and another program could take it before the
    controller does."""
    reuse = getattr(socket, "SO_REUSEPORT", None)
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuse is not None:
        held.setsockopt(socket.SOL_SOCKET, reuse, 1)
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    if reuse is None:
        held.close()
        return port, None
    return port, held


class LocalCluster:
    def __init__(self, workers: int = 2, *, device: str = "cpu", start_timeout: float = 120.0,
                 wait: bool = True) -> None:
        """Start the processes; with `wait`, return once the controller listens and every worker has registered
        (otherwise call `wait()` before using it: the processes start meanwhile)."""
        if workers < 1:
            raise ValueError(f"a local cluster needs at least 1 worker, got {workers}")
        missing = [p for p in ("dtorch_controller", "dtorch_worker") if importlib.util.find_spec(p) is None]
        if missing:
            raise RuntimeError(f"no DTORCH_CONTROLLER is set and {', '.join(missing)} is not installed to start a "
                               "local cluster: pip install 'dtorch-api[local]', or set DTORCH_CONTROLLER=host:port")
        self.dir = Path(tempfile.mkdtemp(prefix="dtorch-local-"))  # mode 0700: the key file stays ours
        from dtorch_controller.keys import new_key_file

        self.api_key, worker_key = new_key_file(self.dir / "keys.json", ("admin", ""), ("worker", ""))
        self.procs: list[subprocess.Popen] = []
        self._failed = False  # a process did not start or exited with an error: its logs are kept
        self.env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        self._workers, self._deadline = workers, time.monotonic() + start_timeout
        self._port_file = self.dir / "controller.addr"
        port, self._held = _hold_port()
        self.address = f"127.0.0.1:{port}"
        parent = str(os.getpid())
        with self._stopped_on_failure():
            self._spawn("controller", [sys.executable, "-m", "dtorch_controller", "--listen", self.address,
                                       "--keys", str(self.dir / "keys.json"), "--port-file", str(self._port_file),
                                       "--parent-pid", parent])
            for i in range(workers):
                dev = f"cuda:{i}" if device == "cuda" else device
                self._spawn(f"worker{i}", [sys.executable, "-m", "dtorch_worker", "--controller", self.address,
                                           "--device", dev, "--parent-pid", parent,
                                           "--register-attempts", str(REGISTER_ATTEMPTS)],
                            env={**self.env, "DTORCH_API_KEY": worker_key})
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until the controller listens on its port and every worker has registered (bounded by the start
        timeout); raises, with the cluster stopped, if a process exits or the time runs out."""
        with self._stopped_on_failure():
            self._wait_for_file(self._port_file, self._deadline)
            self._let_go_of_port()
            self._wait_for_workers(self._workers, self._deadline)

    @contextmanager
    def _stopped_on_failure(self) -> Iterator[None]:
        """A start that raises stops the cluster; its logs stay unless it was interrupted (Ctrl-C: nothing failed)."""
        try:
            yield
        except BaseException as e:
            self._failed = isinstance(e, Exception)
            self.stop()
            raise

    def _let_go_of_port(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.dir / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=env or self.env, start_new_session=True))
        log.close()

    def _check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"local cluster process {self._name(p)} exited with code {p.returncode}: "
                                   f"{self._log_tail(p)} (logs in {self.dir})")

    def _name(self, p: subprocess.Popen) -> str:
        index = self.procs.index(p)
        return "controller" if index == 0 else f"worker{index - 1}"

    def _log_tail(self, p: subprocess.Popen) -> str:
        try:
            lines = (self.dir / f"{self._name(p)}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return lines[-1] if lines else "(empty log)"

    def _wait_for_file(self, path: Path, deadline: float) -> str:
        while time.monotonic() < deadline:
            self._check_alive()
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            time.sleep(0.02)
        raise TimeoutError(f"the local controller did not start in time (logs in {self.dir})")

    def _wait_for_workers(self, n: int, deadline: float) -> None:
        stub = wire.Stub("dtorch.Controller", self.address, self.api_key)
        try:
            while time.monotonic() < deadline:
                self._check_alive()
                status = stub.call("Status", m.StatusRequest(), timeout=5.0)
                if sum(w.state == "alive" for w in status.workers) >= n:
                    return
                time.sleep(0.05)
            raise TimeoutError(f"{n} local workers did not register in time (logs in {self.dir})")
        finally:
            stub.close()

    def stop(self) -> None:
        """End every process of the cluster (bounded: terminate, then kill) and remove its directory; where a process
        failed (exited with an error), only its key file, and the logs stay."""
        self._let_go_of_port()
        exited = [f"{self._name(p)} (code {p.returncode})" for p in self.procs if p.poll() not in (None, 0)]
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)
        self.procs.clear()
        self._tidy(exited)

    def _tidy(self, exited: list[str]) -> None:
        if exited and not self._failed:  # a start failure's error names the directory already
            print(f"dtorch: local cluster process(es) exited before the cluster was stopped: {', '.join(exited)}; "
                  f"logs kept in {self.dir}", file=sys.stderr)
        self._failed = self._failed or bool(exited)
        if self._failed:
            (self.dir / "keys.json").unlink(missing_ok=True)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
