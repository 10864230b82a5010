"""gRPC health checking (``grpc.health.v1``) of a daemon, following what it depends on.

Each daemon serves the standard health service with reflection, so
``grpc_health_probe``, ``grpcurl`` and ``kvdepot health`` can ask it. The
status is SERVING while the daemon can do its job: for a store, while it holds
a lease with a metadata service; for the metadata service, while its index
backend answers. :class:`HealthState` flips every service name the daemon
registers at once and logs each transition once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)


class HealthState:
    """The health status of one daemon's gRPC server.

    Args:
        server: The daemon's ``grpc.aio`` server, before it starts.
        services: Full names of the daemon's own services (e.g. ``kvdepot.v1.Store``).
        daemon: How the daemon is named in logs, e.g. ``"store node-1"``.
    """

    def __init__(self, server: grpc.aio.Server, services: Sequence[str], daemon: str) -> None:
        self._servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]  # stubs predate aio
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self._names = ("", *services)
        reflection.enable_server_reflection(
            (*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        self.daemon = daemon
        self._serving: bool | None = None

    @property
    def serving(self) -> bool:
        """Whether the daemon reports SERVING (readable from any thread)."""
        return bool(self._serving)

    async def set(self, serving: bool, reason: str = "") -> None:
        """Report SERVING or NOT_SERVING; logs only when the status changes."""
        if serving == self._serving:
            return
        first = self._serving is None
        self._serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self._names:
            await self._servicer.set(name, status)
        name = "SERVING" if serving else "NOT_SERVING"
        if first and serving:
            return  # the daemon's "listening" line says as much
        # A daemon that starts NOT_SERVING (a store before it registers) says so quietly.
        log = logger.info if serving or first else logger.warning
        log(
            "%s health: %s%s",
            self.daemon,
            name,
            f" ({reason})" if reason else "",
            extra={"event": "health", "daemon": self.daemon, "status": name, "reason": reason},
        )
