"""`dtorch-worker`: one worker process for one device, registered with a controller.

It exits cleanly on SIGTERM/SIGINT, when the controller fences it or stays
unreachable, and when --parent-pid dies, so an embedded local cluster never
leaves processes behind.

It registers over a worker API key ($DTORCH_API_KEY, made with `dtorch-controller keys create --role
worker`). With --tls-cert/--tls-key/--tls-ca (or $DTORCH_TLS_*), the controller and peers call --listen
(mutual TLS) and clients --client-listen (server TLS; default: the same host, any free port).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence

import torch

from dtorch_protocol import auth, exposition, options, wire
from dtorch_protocol.process import on_signals, watch_parent
from dtorch_protocol.tls import Tls, TlsError, cleartext_warning
from dtorch_worker import node
from dtorch_worker.agent import Agent, ControllerUnreachable
from dtorch_worker.device import DeviceBackend, backend_for
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
    p.add_argument("--client-listen", default="", help="with TLS: the port clients use (server TLS; default: "
                                                       "--listen's host, any free port)")
    p.add_argument("--client-advertise", default="", help="address clients use (default: --client-listen, with a "
                                                          "wildcard host replaced by this host's name)")
    p.add_argument("--tls-cert", help="this worker's certificate (default $DTORCH_TLS_CERT)")
    p.add_argument("--tls-key", help="its private key (default $DTORCH_TLS_KEY)")
    p.add_argument("--tls-ca", help="the CA that signs the cluster's certificates (default $DTORCH_TLS_CA)")
    p.add_argument("--device", default="cpu",
                   help="cpu | cuda | cuda:N (default cpu); cuda:all or a list (cuda:0,cuda:1): one worker per "
                        "device, the i-th on --listen's port + i (node.py); other device types plug in through "
                        "dtorch_worker.device.register")
    p.add_argument("--label", action="append", default=[], metavar="K=V",
                   help="a label (repeatable); `node` counts only when the worker key was made with --node '*' "
                        "(otherwise the node comes from the key)")
    p.add_argument("--parent-pid", type=options.process_id, metavar="PID", help="exit when this process dies")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (default: 1 on CPU, since workers share cores; torch's own on GPU)")
    p.add_argument("--register-attempts", type=int, default=10,
                   help="tries to reach the controller at start (with backoff up to 2 s) before giving up")
    p.add_argument("--lost-after", type=float, default=10.0, help="exit after the controller is unreachable this long")
    p.add_argument("--metrics-port", type=options.port, default=0, metavar="PORT",
                   help="serve Prometheus metrics on this port (default 0: none; telemetry.py lists the series)")
    p.add_argument("--no-collectives", action="store_true",
                   help="join no process groups (redistributions with this worker use point-to-point pieces)")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def parse_device(text: str) -> DeviceBackend:
    """The backend of `--device`, checked usable here (SystemExit with one line when it is not)."""
    try:
        backend = backend_for(text)
        backend.check()
    except ValueError as e:
        raise SystemExit(f"dtorch-worker: bad --device {text!r}: {e}") from None
    backend.start()
    return backend


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
    backend = parse_device(args.device)
    device = backend.device
    labels = parse_labels(args.label)
    threads = args.threads or (1 if device.type == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)
    api_key = auth.key_from_env()
    if not api_key:
        raise SystemExit("dtorch-worker: no worker key: set DTORCH_API_KEY to a key from `dtorch-controller keys "
                         "create --role worker`")
    try:
        tls = Tls.load(args.tls_cert, args.tls_key, args.tls_ca)
    except TlsError as e:
        raise SystemExit(f"dtorch-worker: {e}") from None
    if tls is not None and (tls.cert is None or tls.ca is None):
        raise SystemExit("dtorch-worker: TLS needs --tls-cert, --tls-key and --tls-ca (mutual TLS with the "
                         "controller and peers)")

    stop = threading.Event()
    exit_code = [0]
    reasons: list[str] = []

    def request_exit(code: int, reason: str) -> None:
        exit_code[0] = code
        reasons.append(reason)
        stop.set()

    on_signals(stop)
    if args.parent_pid:
        watch_parent(args.parent_pid, lambda: request_exit(0, f"parent process {args.parent_pid} exited"))

    if tls is None and (warning := cleartext_warning("dtorch-worker", args.listen)):
        print(warning, file=sys.stderr, flush=True)
    memory = backend.memory_bytes()
    worker = start_worker(listen=args.listen, device=device, tls=tls, client_listen=args.client_listen or None,
                          max_put_bytes=memory, memory_bytes=memory)
    exposition.serve(args.metrics_port, worker.service.telemetry.registry, "dtorch-worker", args.listen)
    address = advertised(worker.address, args.advertise)
    client_address = advertised(worker.client_address, args.client_advertise)
    worker.executor.address = address
    worker.executor.groups.host = address.rpartition(":")[0]  # peers reach its rendezvous store on the same host
    agent = Agent(args.controller, api_key, worker.executor, worker.store, on_exit=request_exit,
                  lost_after_s=args.lost_after, secret=worker.credentials.secret, tls=tls)
    worker.executor.on_complete = agent.poke
    worker.executor.on_deferred = agent.poke_later
    try:
        rendezvous = "" if args.no_collectives else worker.executor.groups.rendezvous
    except ValueError as e:  # the advertised host is not this machine's: the store cannot listen there
        print(f"dtorch-worker: {e}", file=sys.stderr, flush=True)
        worker.stop(0.0)
        return EXIT_USAGE
    try:
        reg = agent.register(address, device.type, memory, labels, attempts=args.register_attempts,
                             client_address=client_address, rendezvous=rendezvous, device_id=backend.identity())
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
