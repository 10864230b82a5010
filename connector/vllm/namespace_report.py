"""What the vLLM connector tells the metadata service about its namespace.

The scheduler registers the engine's namespace with its fields once per
process (``kvdepot namespaces`` lists it; ``kvdepot explain`` compares it
with the others), and reports the tokens the engine loaded from kvdepot:
the cluster's "served" figure, beside what its lookups found held.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Mapping

from kvdepot.connector.client import KVDepotClient
from kvdepot.connector.vllm.model_identity import ModelIdentity
from kvdepot.connector.vllm.settings import ConnectorSettings
from kvdepot.errors import KVDepotError
from kvdepot.keys import Namespace
from kvdepot.namespaces import namespace_fields

logger = logging.getLogger(__name__)

# The schedulers' clients of this process, for flush_reports.
_REPORTING: weakref.WeakSet[KVDepotClient] = weakref.WeakSet()


def vllm_namespace_fields(
    ns: Namespace, settings: ConnectorSettings, identity: ModelIdentity | None = None
) -> dict[str, str]:
    """The fields of an engine's namespace, as registered."""
    return namespace_fields(
        ns,
        cache_salt=settings.cache_salt,
        model_source=identity.source if identity is not None else "",
        codec=settings.codec_spec().namespace_key(),
    )


def use_namespace(client: KVDepotClient, ns: Namespace) -> None:
    """Count ``client``'s lookups and published chunks in ``ns`` (a worker's
    client: the scheduler registers the namespace)."""
    client.namespace = ns.digest().hex()
    _REPORTING.add(client)


def register_namespace(
    client: KVDepotClient,
    ns: Namespace,
    settings: ConnectorSettings,
    identity: ModelIdentity | None = None,
) -> None:
    """Register the engine's namespace, off the engine's start: a metadata
    service that is away or slow costs only the listing, never the start."""
    use_namespace(client, ns)
    fields = vllm_namespace_fields(ns, settings, identity)
    threading.Thread(
        target=_register, args=(client, ns, fields), name="kvdepot-namespace", daemon=True
    ).start()


def _register(client: KVDepotClient, ns: Namespace, fields: dict[str, str]) -> None:
    try:
        client.register_namespace(ns, fields, "vllm")
    except KVDepotError as exc:
        logger.warning("kvdepot namespace %s not registered: %s", ns.digest().hex(), exc)


def report_served(client: KVDepotClient, stats: Mapping[str, int]) -> None:
    """Count the tokens the workers loaded in a step (sent every few seconds)."""
    tokens = stats.get("tokens_hit", 0)
    if isinstance(tokens, int) and tokens > 0:
        client.add_usage(served_tokens=tokens)


def flush_reports() -> None:
    """Send the usage the schedulers of this process tallied (their reports
    go every few seconds: for a process about to exit, or a test)."""
    for client in list(_REPORTING):
        client.flush_usage()
