"""The namespace an LMCache engine's chunks are in, registered with the
metadata service (``kvdepot namespaces`` lists it beside vLLM engines').

LMCache keys its chunks itself (:mod:`kvdepot.connector.lmcache.engine_keys`),
not by a chain from a kvdepot namespace, so its namespace is a name for the
fields its keys depend on: ``key_scheme`` tells ``kvdepot explain`` not to
recompute a prompt's keys in it.
"""

from __future__ import annotations

import logging
from typing import Any

import xxhash

from kvdepot.connector.client import KVDepotClient
from kvdepot.errors import KVDepotError

logger = logging.getLogger(__name__)


def lmcache_fields(metadata: Any, config: Any, encoding: str) -> dict[str, str]:
    """What LMCache's keys and bytes depend on, as namespace fields."""
    dtype = str(getattr(metadata, "kv_dtype", "")).removeprefix("torch.")
    return {
        "model": str(getattr(metadata, "model_name", "")),
        "kv_dtype": dtype,
        "chunk_tokens": str(getattr(config, "chunk_size", "") or ""),
        "tp_size": str(getattr(metadata, "world_size", "")),
        "tp_rank": str(getattr(metadata, "worker_id", "")),
        "layout": f"lmcache:{encoding}:{getattr(metadata, 'kv_shape', '')}",
        "key_scheme": "lmcache-v1",
    }


def lmcache_namespace(fields: dict[str, str]) -> str:
    """The name (a digest in hex) of the namespace with ``fields``."""
    data = "\n".join(f"{k}={v}" for k, v in sorted(fields.items())).encode()
    return xxhash.xxh3_128_hexdigest(b"lmcache-namespace\n" + data)


def register(client: KVDepotClient, metadata: Any, config: Any, encoding: str) -> None:
    """Register the engine's namespace (on a pool thread: it may wait on the service)."""
    fields = lmcache_fields(metadata, config, encoding)
    try:
        client.register_namespace(lmcache_namespace(fields), fields, "lmcache")
    except KVDepotError as exc:
        logger.warning("kvdepot namespace of this LMCache engine not registered: %s", exc)
