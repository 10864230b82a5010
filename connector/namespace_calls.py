"""A client's namespace calls: registering the namespace it uses, reporting
its usage of it, listing namespaces and explaining keys.

Usage (tokens served, chunks published) is tallied in the client and sent
in one ``ReportUsage`` per namespace about every ``USAGE_EVERY_S``, by a
timer thread (or :meth:`NamespaceCalls.flush_usage`, also called at close
and at exit): a load never waits on a report, and a report that fails is
kept for the next.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence

from kvdepot.errors import InvalidArgument, KVDepotError
from kvdepot.keys import Namespace, validate_keys
from kvdepot.metadata_client import MetadataClient
from kvdepot.proto.gen import metadata_pb2

logger = logging.getLogger(__name__)

USAGE_EVERY_S = 5.0
_CLIENTS = ("vllm", "lmcache", "client")


def _flush_at_exit(ref: weakref.ReferenceType[NamespaceCalls]) -> None:
    client = ref()
    if client is not None:
        with contextlib.suppress(Exception):  # the interpreter is going away
            client.flush_usage()


class NamespaceCalls:
    """The namespace part of :class:`~kvdepot.connector.client.KVDepotClient`."""

    _metadata: MetadataClient

    def _check_open(self) -> None:
        raise NotImplementedError

    def _init_namespaces(self) -> None:
        # The namespace this client's lookups count in ("" for none).
        self.namespace = ""
        self._usage: dict[str, Counter[str]] = {}
        self._usage_lock = threading.Lock()
        self._usage_timer: threading.Timer | None = None
        self._usage_at_exit = False

    def register_namespace(
        self, ns: Namespace | str, fields: Mapping[str, str], client: str = "client"
    ) -> bool:
        """Register the namespace this client's keys are in, with its fields
        (:func:`kvdepot.namespaces.namespace_fields`); its lookups then count
        in it. Idempotent; whether it was known already.

        Raises:
            InvalidArgument: A bad name, field or client kind.
            Unavailable: The metadata service cannot be reached.
        """
        self._check_open()
        name = ns.digest().hex() if isinstance(ns, Namespace) else ns
        if client not in _CLIENTS:
            raise InvalidArgument(f"client must be one of {', '.join(_CLIENTS)}, not {client!r}")
        # Its lookups count in it even if the service is away now.
        self.namespace = name
        reply = self._metadata.call(
            "RegisterNamespace",
            metadata_pb2.RegisterNamespaceRequest(
                name=name,
                fields=[metadata_pb2.NamespaceField(name=k, value=v) for k, v in fields.items()],
                client=client,
            ),
        )
        return bool(reply.known)

    def add_usage(
        self, *, served_tokens: int = 0, stored_chunks: int = 0, namespace: str = ""
    ) -> None:
        """Count tokens loaded into an engine or chunks published, in
        ``namespace`` (default: the registered one); sent every few seconds."""
        name = namespace or self.namespace
        if not name or not (served_tokens or stored_chunks):
            return
        with self._usage_lock:
            usage = self._usage.setdefault(name, Counter())
            usage["served_tokens"] += served_tokens
            usage["stored_chunks"] += stored_chunks
            if not self._usage_at_exit:
                # An engine's last report, if its process exits within the period.
                self._usage_at_exit = True
                atexit.register(_flush_at_exit, weakref.ref(self))
            if self._usage_timer is None:
                self._usage_timer = threading.Timer(USAGE_EVERY_S, self.flush_usage)
                self._usage_timer.daemon = True
                self._usage_timer.start()

    def flush_usage(self) -> None:
        """Send the usage tallied so far (kept for the next try if that fails)."""
        with self._usage_lock:
            usage, self._usage = self._usage, {}
            if self._usage_timer is not None:
                self._usage_timer.cancel()
                self._usage_timer = None
        for name, counts in usage.items():
            try:
                self._metadata.call(
                    "ReportUsage",
                    metadata_pb2.ReportUsageRequest(
                        namespace=name,
                        served_tokens=counts["served_tokens"],
                        stored_chunks=counts["stored_chunks"],
                    ),
                )
            except KVDepotError as exc:
                logger.debug("usage report failed (%s); kept for the next", exc)
                with self._usage_lock:
                    self._usage.setdefault(name, Counter()).update(counts)

    def namespaces(self) -> metadata_pb2.ListNamespacesResponse:
        """The namespaces the metadata service keeps, with their counters."""
        self._check_open()
        reply: metadata_pb2.ListNamespacesResponse = self._metadata.call(
            "ListNamespaces", metadata_pb2.ListNamespacesRequest()
        )
        return reply

    def explain(self, keys: Sequence[bytes]) -> metadata_pb2.ExplainResponse:
        """Per key: its replicas, or why it left (``kvdepot explain``)."""
        self._check_open()
        reply: metadata_pb2.ExplainResponse = self._metadata.call(
            "Explain", metadata_pb2.ExplainRequest(keys=validate_keys(keys))
        )
        return reply
