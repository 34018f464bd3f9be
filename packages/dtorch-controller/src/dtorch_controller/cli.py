"""`dtorch-controller`: run the controller, manage its API keys, or ask a running one.

    dtorch-controller --keys FILE [--listen HOST:PORT] [--worker-listen HOST:PORT]
                      [--tls-cert PEM --tls-key PEM --tls-ca PEM] [--port-file PATH] [--heartbeat-interval S]
                      [--heartbeat-timeout S] [--session-timeout S] [--policy NAME]
                      [--policy-param K=V ...] [--metrics-port PORT] [--usage-file PATH [--usage-interval S]]
                      [--parent-pid PID]
    dtorch-controller keys create --keys FILE --role tenant|admin|worker [--tenant NAME] [--node NODE]
    dtorch-controller keys list|revoke ID --keys FILE
    dtorch-controller keys quota TENANT --keys FILE [--devices N] [--memory BYTES] [--sessions N]
    dtorch-controller status [--controller HOST:PORT] [--json]
    dtorch-controller top [--controller HOST:PORT] [--interval S]
    dtorch-controller usage [--usage-file PATH] [--since T] [--by tenant|session] [--format table|csv|json]
    dtorch-controller drain WORKER [--controller HOST:PORT] [--timeout S]
    dtorch-controller migrate SESSION --device N --to WORKER [--controller HOST:PORT] [--timeout S]

The key file comes from --keys or $DTORCH_KEYS: without a readable one the controller does not start. The
commands that ask a running controller use the API key in $DTORCH_API_KEY (an admin key for drain and
migrate) and $DTORCH_TLS_CA when it runs TLS. The embedded local cluster writes its own key file, starts
the controller on port 0 with --port-file and --parent-pid, reads the address from the file, and relies on
the watchdog to end the controller when the user's process goes away.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from dtorch_protocol import auth, options, wire
from dtorch_protocol.process import on_signals, watch_parent
from dtorch_protocol.tls import Tls, TlsError, cleartext_warning

DEFAULT_LISTEN = "127.0.0.1:50051"
# The core's settings (`core.Config`) each option sets: a setting out of range is refused naming the option
CONFIG_OPTIONS = {
    "heartbeat_interval_s": "--heartbeat-interval",
    "heartbeat_timeout_s": "--heartbeat-timeout",
    "session_timeout_s": "--session-timeout",
    "collective_timeout_s": "--collective-timeout",
    "dispatch_ahead": "--dispatch-ahead",
    "snapshot_every_batches": "--snapshot-batches",
    "snapshot_every_s": "--snapshot-interval",
}
WATCHDOG_INTERVAL_S = 0.5
MIN_USAGE_INTERVAL_S = 0.1


def _normalize_listen(listen: str, option: str = "--listen") -> str:
    """":50051" means every interface, as in `--listen :50051`."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > options.MAX_PORT:
        raise SystemExit(f"dtorch-controller: {option} needs HOST:PORT with a port 0-{options.MAX_PORT}, got "
                         f"{listen!r}")
    return f"{host or '0.0.0.0'}:{port}"


def _seconds(text: str) -> float:
    """An option's time in seconds: a finite number (inf and nan overflowed the timers that wait on them)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds, got {text!r}")
    return value


def _interval(text: str) -> float:
    """`top --interval`: seconds > 0 (0 asked the controller for Status as fast as it could answer, forever)."""
    value = _seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 between refreshes, got {text!r}")
    return value


def _admin_timeout(text: str) -> float:
    """`drain/migrate --timeout`: seconds the request may take, 0 to the protocol's bound (an hour). -1 came back as
    the controller's 'bad DrainRequest message: Expected `float` >= 0.0', and 1e10 as 'timed out' at once."""
    from dtorch_protocol.messages import MAX_TIMEOUT_S

    value = _seconds(text)
    if not 0 <= value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to {MAX_TIMEOUT_S:g} (an hour), got {text!r}")
    return value


def _write_port_file(path: str, addresses: Sequence[str]) -> None:
    """Write atomically, so a reader polling for the file never sees half an address: the clients' address,
    then the workers' when it differs (TLS)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text("\n".join(dict.fromkeys(addresses)))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _parent_gone(pid: int, stop: threading.Event) -> None:
    print(f"dtorch-controller: parent process {pid} exited, stopping", file=sys.stderr, flush=True)
    stop.set()


def _tls(args: argparse.Namespace) -> Tls | None:
    return Tls.load(getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_ca", None))


def serve(args: argparse.Namespace) -> int:
    from dtorch_controller.core import Config
    from dtorch_controller.core.config import ConfigError
    from dtorch_controller.core.policies import make_policy
    from dtorch_controller.keys import KeyFileError, Keyring, key_file_from_env
    from dtorch_controller.server import run_server
    from dtorch_controller.usage import UsageLog
    from dtorch_protocol import exposition

    try:
        config = Config(**{name: getattr(args, option[2:].replace("-", "_"))
                           for name, option in CONFIG_OPTIONS.items()})
    except ConfigError as e:
        print(f"dtorch-controller: {e.render(CONFIG_OPTIONS)}", file=sys.stderr)
        return 2
    try:
        policy = make_policy(args.policy, _policy_params(args.policy_param))
        if args.usage_interval < MIN_USAGE_INTERVAL_S:  # 1e-9 settled every session's usage in a busy loop
            raise ValueError(f"--usage-interval must be at least {MIN_USAGE_INTERVAL_S:g} seconds, got "
                             f"{args.usage_interval:g}")
        tls = _tls(args)
        if tls is not None and not args.worker_listen:
            raise ValueError("with TLS, workers need a port of their own (mutual TLS): add --worker-listen HOST:PORT")
        path = args.keys or key_file_from_env()
        if not path:
            raise ValueError("no key file: pass --keys FILE or set DTORCH_KEYS (create keys with `dtorch-controller "
                             "keys create --keys FILE --role admin`); a controller never runs open")
        keyring = Keyring(path)
    except (ValueError, KeyFileError) as e:
        print(f"dtorch-controller: {e}", file=sys.stderr)
        return 2
    listen = _normalize_listen(args.listen)
    worker_listen = _normalize_listen(args.worker_listen, "--worker-listen") if args.worker_listen else None
    if tls is None and (warning := cleartext_warning("dtorch-controller", listen)):
        print(warning, file=sys.stderr, flush=True)
    usage = UsageLog(args.usage_file) if args.usage_file else None  # unwritable: one line, no records
    try:
        server, address = run_server(listen, keyring.authenticate, config, policy=policy, tls=tls,
                                     worker_listen=worker_listen, quotas=keyring.quota,
                                     usage=usage if usage is not None and usage.enabled else None,
                                     usage_interval_s=args.usage_interval)
    except (OSError, RuntimeError) as e:
        print(f"dtorch-controller: cannot listen on {args.listen}: {e}", file=sys.stderr)
        return 1
    # on the --listen host: a controller on loopback served its tenants' names and usage to every interface
    exposition.serve(args.metrics_port, server.service.metrics.registry, "dtorch-controller", listen)
    stop = threading.Event()
    on_signals(stop)
    if args.parent_pid:
        watch_parent(args.parent_pid, lambda: _parent_gone(args.parent_pid, stop), WATCHDOG_INTERVAL_S)
    try:
        workers = f" (workers: {server.worker_address}, mutual TLS)" if server.worker_address != address else ""
        print(f"dtorch-controller listening on {address}{workers}", flush=True)
        if args.port_file:
            try:
                _write_port_file(args.port_file, [address, server.worker_address])
            except OSError as e:  # was a traceback naming the temporary file; whoever waits for it would wait forever
                print(f"dtorch-controller: cannot write --port-file {args.port_file}: {e.strerror or e}",
                      file=sys.stderr)
                return 1
        while not stop.wait(1.0):
            pass
    finally:
        server.stop(0.5)
    return 0


def _policy_params(items: Sequence[str]) -> dict[str, object]:
    """`--policy-param K=V`: V is read as JSON when it parses (numbers, true/false, lists), else as a string."""
    import json

    params: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad --policy-param {item!r} (expected K=V)")
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value
    return params


def _ask(args: argparse.Namespace, method: str, request: object, timeout: float) -> object | None:
    """One call to the controller named by --controller / $DTORCH_CONTROLLER; None after a one-line error."""
    target = args.controller or os.environ.get("DTORCH_CONTROLLER") or DEFAULT_LISTEN
    if not auth.key_from_env():  # the controller's answer named an HTTP header, not what to set
        print(f"dtorch-controller {args.command}: no API key: set DTORCH_API_KEY to an admin key (`dtorch-controller "
              "keys create --keys FILE --role admin` prints one)", file=sys.stderr)
        return None
    try:
        stub = wire.Stub("dtorch.Controller", target, auth.key_from_env(), tls=_tls(args))
    except TlsError as e:
        print(f"dtorch-controller {args.command}: {e}", file=sys.stderr)
        return None
    try:
        return stub.call(method, request, timeout=timeout)
    except (ConnectionError, TimeoutError, PermissionError, wire.ProtocolError, wire.RemoteError) as e:
        text = str(e).replace(f"{method} on {target} failed: ", "")
        print(f"dtorch-controller {args.command}: {text}".splitlines()[0], file=sys.stderr)
        return None
    finally:
        stub.close()


def status(args: argparse.Namespace) -> int:
    from dtorch_controller import status_view
    from dtorch_protocol import messages as m

    reply = _ask(args, "Status", m.StatusRequest(), args.timeout)
    if reply is None:
        return 1
    if args.json:
        print(status_view.to_json(reply))
    else:
        status_view.render(reply)
    return 0


def _from_env(name: str, default: str, kind: type[float] | type[int]) -> float:
    """An option's default from `$name`; a malformed value is one line naming the variable and what it takes."""
    raw = os.environ.get(name, default)
    try:
        return kind(raw) if kind is int else _seconds(raw)
    except (ValueError, argparse.ArgumentTypeError):
        print(f"dtorch-controller: ${name} must be {'a whole number' if kind is int else 'a finite number'}, not "
              f"{raw!r}", file=sys.stderr)
        raise SystemExit(2) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtorch-controller",
                                     description="Run the DTorch controller (API keys from --keys / $DTORCH_KEYS).")
    parser.add_argument("--keys", metavar="FILE", help="the key file (default $DTORCH_KEYS); required")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help=f"HOST:PORT to serve on (default {DEFAULT_LISTEN})")
    parser.add_argument("--worker-listen", metavar="HOST:PORT",
                        help="a separate port for workers (required with TLS: it requires their certificates)")
    _tls_args(parser)
    parser.add_argument("--port-file", help="write the address actually served on to this file")
    parser.add_argument("--heartbeat-interval", type=_seconds, default=0.2, metavar="S",
                        help="how often workers report (default 0.2)")
    parser.add_argument("--heartbeat-timeout", type=_seconds, metavar="S",
                        default=_from_env("DTORCH_HEARTBEAT_TIMEOUT", "1.0", float),
                        help="a worker silent this long is lost (default 1.0, $DTORCH_HEARTBEAT_TIMEOUT)")
    parser.add_argument("--session-timeout", type=_seconds, metavar="S",
                        default=_from_env("DTORCH_SESSION_TIMEOUT", "5.0", float),
                        help="close a client session silent this long, freeing its shards (default 5.0; 0: never; "
                             "$DTORCH_SESSION_TIMEOUT)")
    parser.add_argument("--collective-timeout", type=_seconds, metavar="S",
                        default=_from_env("DTORCH_COLLECTIVE_TIMEOUT", "60", float),
                        help="bound on a process group's rendezvous and on each collective: past it the op fails "
                             "naming the workers that never arrived (default 60, $DTORCH_COLLECTIVE_TIMEOUT)")
    parser.add_argument("--dispatch-ahead", type=int, default=_from_env("DTORCH_DISPATCH_AHEAD", "1", int),
                        metavar="N",
                        help="at most N batches of a session sent and not yet run on a worker: a preempted session "
                             "frees its devices within N batches (default 1, $DTORCH_DISPATCH_AHEAD; 0: no bound)")
    parser.add_argument("--policy", default="dtorch",
                        help="scheduling policy: dtorch (default: classes, then least remaining or attained work, "
                             "preemption by freezing, relocation, packing), priority, fifo or las")
    parser.add_argument("--policy-param", action="append", default=[], metavar="K=V",
                        help="a policy parameter, e.g. preempt=false or thresholds=[60,600] (repeatable)")
    parser.add_argument("--snapshot-batches", type=int, metavar="N",
                        default=_from_env("DTORCH_SNAPSHOT_BATCHES", "32", int),
                        help="copy each session's live tensors to another worker every N batches, so a lost "
                             "worker's tensors are rebuilt (default 32, $DTORCH_SNAPSHOT_BATCHES; 0: no recovery)")
    parser.add_argument("--snapshot-interval", type=_seconds, metavar="S",
                        default=_from_env("DTORCH_SNAPSHOT_INTERVAL", "30", float),
                        help="... or at the next batch once the last copy is this old (default 30)")
    parser.add_argument("--metrics-port", type=options.port, default=0, metavar="PORT",
                        help="serve Prometheus metrics on this port (default 0: none; metrics.py lists the series)")
    parser.add_argument("--usage-file", metavar="PATH", default=os.environ.get("DTORCH_USAGE_FILE", ""),
                        help="append usage records (JSON lines, one per session and interval) to this file "
                             "(default $DTORCH_USAGE_FILE; none when unset)")
    parser.add_argument("--usage-interval", type=_seconds, default=60.0, metavar="S",
                        help="one usage record per session every S seconds, and one when it closes (default 60, at "
                             "least 0.1)")
    parser.add_argument("--parent-pid", type=options.process_id, metavar="PID", help="exit when this process exits")
    commands = parser.add_subparsers(dest="command", metavar="{keys,status,top,usage,drain,migrate}")
    _keys_parser(commands)
    us = commands.add_parser("usage", help="sum the usage records by tenant or session")
    us.add_argument("--usage-file", metavar="PATH", default=os.environ.get("DTORCH_USAGE_FILE", ""),
                    help="the controller's --usage-file (default $DTORCH_USAGE_FILE)")
    us.add_argument("--since", default="", metavar="T",
                    help="only intervals ending after T: unix seconds, an ISO time (2026-12-01T00:00), or an age "
                         "(90s, 30m, 24h, 7d)")
    us.add_argument("--by", choices=("tenant", "session"), default="tenant")
    us.add_argument("--format", choices=("table", "csv", "json"), default="table")
    tp = commands.add_parser("top", help="a live view of workers, sessions, the queue and throughput")
    tp.add_argument("--controller", help="HOST:PORT (default $DTORCH_CONTROLLER, else 127.0.0.1:50051)")
    tp.add_argument("--interval", type=_interval, default=1.0, metavar="S", help="refresh every S seconds (default 1)")
    tp.add_argument("--iterations", type=int, default=0, help=argparse.SUPPRESS)  # tests: stop after N frames
    tp.add_argument("--timeout", type=_seconds, default=5.0, help=argparse.SUPPRESS)
    st = commands.add_parser("status", help="show workers, sessions and recent events of a running controller")
    st.add_argument("--controller", help="HOST:PORT (default $DTORCH_CONTROLLER, else 127.0.0.1:50051)")
    st.add_argument("--json", action="store_true", help="print the raw StatusReply as JSON")
    st.add_argument("--timeout", type=_seconds, default=5.0, help=argparse.SUPPRESS)
    dr = commands.add_parser("drain", help="move everything off a worker (devices, copies), then release it")
    dr.add_argument("worker", help="worker id, as `status` lists it (w3)")
    mg = commands.add_parser("migrate", help="move one logical device of a running session to another worker")
    mg.add_argument("session", help="session id (or a unique prefix of at least 4 characters)")
    mg.add_argument("--device", type=int, required=True, metavar="N", help="the logical device to move")
    mg.add_argument("--to", required=True, metavar="WORKER", help="the worker to move it to (w2)")
    for sub in (dr, mg):
        sub.add_argument("--controller", help="HOST:PORT (default $DTORCH_CONTROLLER, else 127.0.0.1:50051)")
        sub.add_argument("--json", action="store_true", help="print the raw AdminReply as JSON")
        sub.add_argument("--timeout", type=_admin_timeout, default=300.0, metavar="S",
                         help="answer after this long even if still in progress (default 300)")
    for sub in (st, tp, dr, mg):
        sub.add_argument("--tls-ca", metavar="PEM", help="the CA of a TLS controller (default $DTORCH_TLS_CA)")
    return parser


def _tls_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", metavar="PEM", help="this server's certificate (default $DTORCH_TLS_CERT)")
    parser.add_argument("--tls-key", metavar="PEM", help="its private key (default $DTORCH_TLS_KEY)")
    parser.add_argument("--tls-ca", metavar="PEM", help="the CA that signs the cluster's certificates "
                                                        "(default $DTORCH_TLS_CA)")


def _keys_parser(commands: argparse._SubParsersAction) -> None:
    keys = commands.add_parser("keys", help="create, list and revoke API keys; set tenants' quotas")
    sub = keys.add_subparsers(dest="keys_command", metavar="{create,list,revoke,quota}", required=True)
    create = sub.add_parser("create", help="make a key and print it (once: only its hash is stored)")
    create.add_argument("--role", required=True, choices=auth.KEY_ROLES)
    create.add_argument("--tenant", default="", help="the tenant a tenant key belongs to")
    create.add_argument("--node", default="", help="worker keys: the node label their workers get ('*': the "
                                                    "node each worker names with --label node=NAME)")
    sub.add_parser("list", help="every key: id, role, tenant, node, created, state (never its hash)")
    revoke = sub.add_parser("revoke", help="revoke a key (a running controller notices within a second)")
    revoke.add_argument("id")
    quota = sub.add_parser("quota", help="a tenant's limits (0: none); without limits, shows them")
    quota.add_argument("tenant")
    quota.add_argument("--devices", type=int, help="logical devices its sessions may hold at once")
    quota.add_argument("--memory", type=int, metavar="BYTES", help="device memory its sessions may lease")
    quota.add_argument("--sessions", type=int, help="sessions it may have open at once")
    for p in sub.choices.values():
        p.add_argument("--keys", metavar="FILE", help="the key file (default $DTORCH_KEYS)")


def keys_command(args: argparse.Namespace) -> int:
    """`keys create|list|revoke|quota`: edit the key file (created on the first `create`, mode 0600)."""
    from dtorch_controller.keys import KeyFile, KeyFileError, key_file_from_env, listing

    path = args.keys or key_file_from_env()
    if not path:
        print("dtorch-controller keys: pass --keys FILE or set DTORCH_KEYS", file=sys.stderr)
        return 2
    try:
        if args.keys_command == "create":
            kf = KeyFile.read_or_new(path)
            entry, key = kf.create(args.role, args.tenant, args.node)
            kf.write(path)
            print(key)
            owner = f" for tenant {entry.tenant}" if entry.role == auth.TENANT else ""
            print(f"created {entry.role} key {entry.id}{owner}: it is shown only now", file=sys.stderr)
        elif args.keys_command == "list":
            print("\n".join(listing(KeyFile.read(path))))
        elif args.keys_command == "revoke":
            kf = KeyFile.read(path)
            entry = kf.revoke(args.id)
            kf.write(path)
            print(f"revoked {entry.role} key {entry.id} ({entry.revoked})")
        else:
            kf = KeyFile.read(path)
            q = kf.set_quota(args.tenant, args.devices, args.memory, args.sessions)
            kf.write(path)
            print(f"quota {args.tenant}: devices {q.devices or 'any'}, memory {q.memory_bytes or 'any'} bytes, "
                  f"sessions {q.sessions or 'any'}")
    except (KeyFileError, ValueError, OSError) as e:
        print(f"dtorch-controller keys {args.keys_command}: {e}", file=sys.stderr)
        return 1
    return 0


def top(args: argparse.Namespace) -> int:
    from dtorch_controller import top as view
    from dtorch_protocol import messages as m

    target = args.controller or os.environ.get("DTORCH_CONTROLLER") or DEFAULT_LISTEN
    return view.run(lambda: _ask(args, "Status", m.StatusRequest(), args.timeout), target, args.interval,
                    args.iterations)


def admin(args: argparse.Namespace) -> int:
    """`drain` and `migrate`: one request, answered when the move is done; one line on refusal."""
    from dtorch_controller import status_view
    from dtorch_protocol import messages as m

    if args.command == "drain":
        method, request = "Drain", m.DrainRequest(worker=args.worker, timeout_s=args.timeout)
    else:
        method, request = "Migrate", m.MigrateRequest(session=args.session, device=args.device, to_worker=args.to,
                                                      timeout_s=args.timeout)
    reply = _ask(args, method, request, args.timeout + 30.0)
    if reply is None:
        return 1
    if args.json:
        print(status_view.to_json(reply))
        return 0 if reply.ok else 1
    print(reply.message if reply.ok else f"dtorch-controller {args.command}: {reply.message}",
          file=sys.stdout if reply.ok else sys.stderr)
    for mv in reply.moves:
        print(f"  session {mv.session[:8]} logical device{'s' if len(mv.devices) > 1 else ''} "
              f"{', '.join(map(str, mv.devices))}: {mv.from_worker} -> {mv.to_worker}, {mv.tensors} shards, "
              f"{status_view.human_bytes(mv.bytes)}, downtime {mv.downtime_s * 1000:.1f} ms")
    return 0 if reply.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "keys":
        return keys_command(args)
    if args.command == "status":
        return status(args)
    if args.command == "top":
        return top(args)
    if args.command == "usage":
        from dtorch_controller import usage_view

        return usage_view.main(args)
    if args.command in ("drain", "migrate"):
        return admin(args)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
