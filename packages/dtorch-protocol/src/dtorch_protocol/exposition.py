"""Serve a Prometheus registry over HTTP (`--metrics-port` of the controller and the workers).

A port that cannot be had (in use, no permission) is one line on stderr, and the program goes on without metrics:
metrics are for watching, never a reason not to run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


def serve(port: int, registry: CollectorRegistry, program: str, listen: str) -> object | None:
    """Start the HTTP server of `registry` on `port` (0: none) of the host the program serves gRPC on (`listen`,
    HOST:PORT: a loopback program is not reachable from the network through its metrics either); returns it, or
    None after one line."""
    if port <= 0:
        return None
    host = listen.rpartition(":")[0].strip("[]")
    try:
        server, _thread = start_http_server(port, host, registry=registry)
    except OSError as e:
        print(f"{program}: cannot serve metrics on {host}:{port} ({e.strerror or e}): running without metrics",
              file=sys.stderr, flush=True)
        return None
    return server


class CallbackCounters(Collector):
    """Counters whose values are read when scraped, from a total its owner keeps anyway (no double bookkeeping)."""

    def __init__(self, counters: dict[str, tuple[str, Callable[[], float]]]) -> None:
        self._counters = counters  # name without _total -> (help, read)

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, (text, read) in self._counters.items():
            yield CounterMetricFamily(name, text, value=read())

    def describe(self) -> Iterator[CounterMetricFamily]:
        for name, (text, _read) in self._counters.items():
            yield CounterMetricFamily(name, text, value=0)
