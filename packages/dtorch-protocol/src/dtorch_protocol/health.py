"""The standard gRPC health service (grpc.health.v1, `grpcio-health-checking`) on DTorch's servers.

Load balancers, `grpc_health_probe` and Kubernetes' `grpc:` probes ask it without credentials: it says only
whether the process serves, nothing about tensors or sessions. Services and what SERVING means:

| service name | SERVING when |
|---|---|
| `""` (the server), `dtorch.Controller`, `dtorch.Worker` | ready: the controller serves; a worker is registered |
| `liveness` | the process serves gRPC at all (a worker still registering is alive, not ready) |

Everything turns NOT_SERVING when the server stops (a fenced or exiting worker, a controller shutting down).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

LIVENESS = "liveness"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """The health servicer of one gRPC server, for `service` ("dtorch.Controller" or "dtorch.Worker")."""

    def __init__(self, service: str, ready: bool = False) -> None:
        self.service = service
        self._servicer = health.HealthServicer(experimental_non_blocking=True)
        self._servicer.set(LIVENESS, SERVING)
        self.set_ready(ready)

    def attach(self, server: grpc.Server) -> None:
        """Add the health service to `server` (before it starts)."""
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def set_ready(self, ready: bool) -> None:
        status = SERVING if ready else NOT_SERVING
        for name in ("", self.service):
            self._servicer.set(name, status)

    def stop(self) -> None:
        """Every service NOT_SERVING from now on (the server is going away)."""
        self._servicer.enter_graceful_shutdown()


def check(target: str, service: str = "", timeout: float = 5.0,
          credentials: grpc.ChannelCredentials | None = None) -> str:
    """Ask the health service at `target` about `service`: "SERVING", "NOT_SERVING", ... (raises grpc.RpcError)."""
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                            timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    finally:
        channel.close()
