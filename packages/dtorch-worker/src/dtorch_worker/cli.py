"""`dtorch-worker`: one worker process for one device, registered with a controller.

It exits cleanly on SIGTERM/SIGINT, when the controller fences it or stays
unreachable, and when --parent-pid dies, so an embedded local cluster never
leaves processes behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence

import torch

from dtorch_protocol import exposition, wire
from dtorch_protocol.process import watch_parent
from dtorch_worker import node
from dtorch_worker.agent import Agent, ControllerUnreachable, device_memory_bytes
from dtorch_worker.server import start_worker

log = logging.getLogger("dtorch_worker")

EXIT_USAGE = 2
EXIT_UNREACHABLE = 5


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dtorch-worker", description="DTorch worker: executes torch ops for a controller")
    p.add_argument("--controller", required=True, help="controller address HOST:PORT")
    p.add_argument("--listen", default="127.0.0.1:0", help="address to serve on (default 127.0.0.1:0)")
    p.add_argument("--advertise", default="", help="address peers use to reach this worker (default: --listen, "
                                                   "with a wildcard host replaced by this host's name)")
    p.add_argument("--device", default="cpu",
                   help="cpu | cuda | cuda:N (default cpu); cuda:all or a list (cuda:0,cuda:1): one worker per "
                        "device, the i-th on --listen's port + i (node.py)")
    p.add_argument("--label", action="append", default=[], metavar="K=V", help="scheduling label (repeatable)")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default: 1 on CPU, since workers share cores; torch's own on GPU)")
    p.add_argument("--register-attempts", type=int, default=10,
                   help="tries to reach the controller at start (with backoff up to 2 s) before giving up")
    p.add_argument("--lost-after", type=float, default=10.0, help="exit after the controller is unreachable this long")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve Prometheus metrics on this port (default 0: none; telemetry.py lists the series)")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def parse_device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise SystemExit(f"dtorch-worker: bad --device {text!r} (expected cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"dtorch-worker: bad --device {text!r} (expected cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("dtorch-worker: --device cuda requested but torch sees no CUDA device")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise SystemExit(f"dtorch-worker: --device {text}: only {torch.cuda.device_count()} CUDA devices")
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    return device


def parse_labels(items: Sequence[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"dtorch-worker: bad --label {item!r} (expected K=V)")
        labels[key] = value
    return labels


def advertised(bound: str, advertise: str) -> str:
    """The address peers should dial: a wildcard listen host becomes this host's name."""
    if advertise:
        return advertise
    host, _, port = bound.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = socket.gethostname()
    return f"{host}:{port}"


def run(argv: Sequence[str] | None = None) -> int:
    """Start a worker and serve until a signal, parent death, fencing or controller loss; returns the exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="dtorch-worker %(levelname)s %(message)s")
    devices = node.expand(args.device, torch.cuda.device_count() if args.device.startswith("cuda") else 0)
    if devices is not None:
        return node.run_node(sys.argv[1:] if argv is None else argv, devices, args.listen, args.advertise,
                             args.metrics_port)
    device = parse_device(args.device)
    labels = parse_labels(args.label)
    threads = args.threads or (1 if device.type == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)
    token = wire.token_from_env()

    stop = threading.Event()
    exit_code = [0]
    reasons: list[str] = []

    def request_exit(code: int, reason: str) -> None:
        exit_code[0] = code
        reasons.append(reason)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.parent_pid:
        watch_parent(args.parent_pid, lambda: request_exit(0, f"parent process {args.parent_pid} exited"))

    memory = device_memory_bytes(device)
    worker = start_worker(token=token, listen=args.listen, device=device, memory_bytes=memory)
    exposition.serve(args.metrics_port, worker.service.telemetry.registry, "dtorch-worker")
    address = advertised(worker.address, args.advertise)
    worker.executor.address = address
    agent = Agent(args.controller, token, worker.executor, worker.store, on_exit=request_exit,
                  lost_after_s=args.lost_after)
    worker.executor.on_complete = agent.poke
    try:
        reg = agent.register(address, device.type, memory, labels,
                             attempts=args.register_attempts)
    except ControllerUnreachable as e:
        print(f"dtorch-worker: {e}", file=sys.stderr, flush=True)
        worker.stop(0.0)
        return EXIT_UNREACHABLE
    except (PermissionError, wire.ProtocolError, wire.RemoteError) as e:  # refused: token, version
        print(f"dtorch-worker: registration refused by {args.controller}: {e}", file=sys.stderr, flush=True)
        worker.stop(0.0)
        return EXIT_USAGE
    print(f"dtorch-worker {reg.worker} on {device} listening on {address}", flush=True)
    worker.health.set_ready(True)
    agent.start()
    while not stop.wait(0.5):  # wake regularly so the main thread can run signal handlers
        pass
    worker.health.set_ready(False)
    for reason in reasons:
        print(f"dtorch-worker {reg.worker}: exiting: {reason}", file=sys.stderr, flush=True)
    agent.stop(timeout=1.0)
    worker.stop(grace=0.5)
    return exit_code[0]


def main(argv: Sequence[str] | None = None) -> None:
    code = run(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait on a command still running in a daemon thread
