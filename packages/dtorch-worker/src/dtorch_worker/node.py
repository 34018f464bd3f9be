"""One worker per device of a node: `dtorch-worker --device cuda:all` (or a list, `--device cuda:0,cuda:1`).

A worker is one device. A node (a Kubernetes pod given every GPU of its node, a machine started by hand) runs
one `dtorch-worker --device cuda:N` process per GPU, each on its own ports: the i-th device's worker listens on
`--listen`'s port + i (and `--advertise`'s, `--metrics-port` + i). Each child gets the node's command line with
those options appended (argparse keeps the last), so every other option (labels, controller, timeouts) is the
same for all. Signals are passed on; when one child exits the others are stopped and the node exits with the
first failing child's code, so a supervisor (kubelet, systemd) restarts the node as a whole.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Sequence

from dtorch_protocol.process import on_signals

STOP_GRACE_S = 10.0


def expand(device: str, cuda_count: int) -> list[str] | None:
    """The devices `--device` names when it names several (`cuda:all`, `cuda:0,cuda:1`, `cpu,cpu`); else None."""
    if device == "cuda:all":
        if cuda_count == 0:
            raise SystemExit("dtorch-worker: --device cuda:all requested but torch sees no CUDA device")
        return [f"cuda:{i}" for i in range(cuda_count)]
    if "," in device:
        return [d.strip() for d in device.split(",") if d.strip()]
    return None


def _with_port(address: str, offset: int) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"dtorch-worker: several devices need HOST:PORT addresses, got {address!r}")
    if int(port) == 0:
        return address  # any free port, for each child
    return f"{host}:{int(port) + offset}"


def child_argv(argv: Sequence[str], device: str, index: int, listen: str, advertise: str,
               metrics_port: int) -> list[str]:
    """The i-th child's command line: the node's, then its own device and ports (the last occurrence wins)."""
    extra = ["--device", device, "--listen", _with_port(listen, index)]
    if advertise:
        extra += ["--advertise", _with_port(advertise, index)]
    if metrics_port:
        extra += ["--metrics-port", str(metrics_port + index)]
    return [sys.executable, "-m", "dtorch_worker", *argv, *extra]


def run_node(argv: Sequence[str], devices: Sequence[str], listen: str, advertise: str, metrics_port: int) -> int:
    """Start one worker per device and supervise them; returns the exit code of the node."""
    children = [subprocess.Popen(child_argv(argv, d, i, listen, advertise, metrics_port))
                for i, d in enumerate(devices)]
    stop = threading.Event()
    on_signals(stop)
    print(f"dtorch-worker: {len(children)} workers on {', '.join(devices)}", flush=True)
    code = 0
    while not stop.wait(0.5):
        ended = [c for c in children if c.poll() is not None]
        if ended:
            code = next((c.returncode for c in ended if c.returncode), 0)
            print(f"dtorch-worker: the worker on {devices[children.index(ended[0])]} exited with "
                  f"{ended[0].returncode}: stopping the others", file=sys.stderr, flush=True)
            break
    for c in children:
        if c.poll() is None:
            c.terminate()
    for c in children:
        try:
            c.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    return code
