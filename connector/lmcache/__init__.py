"""kvdepot as LMCache's remote storage backend (LMCache 0.5.x).

Configure it through LMCache's remote storage plugin framework::

    remote_storage_plugins: ["kvdepot"]
    extra_config:
      remote_storage_plugin.kvdepot.module_path: kvdepot.connector.lmcache
      remote_storage_plugin.kvdepot.class_name: KVDepotConnectorAdapter
      remote_storage_plugin.kvdepot.url: "kvdepot://127.0.0.1:7700"

Modules: :mod:`.keys` maps LMCache's ``CacheEngineKey`` onto kvdepot keys,
:mod:`.chunks` maps its memory objects onto chunk bytes, :mod:`.connector`
implements LMCache's ``RemoteConnector`` and :mod:`.adapter` is what LMCache
loads; :mod:`.settings` parses the ``kvdepot://`` URL.
"""

from __future__ import annotations

from kvdepot.connector.lmcache.adapter import KVDepotConnectorAdapter
from kvdepot.connector.lmcache.connector import KVDepotConnector, KVDepotLMCacheConnector
from kvdepot.connector.lmcache.engine_keys import chunk_key
from kvdepot.connector.lmcache.settings import PluginSettings

__all__ = [
    "KVDepotConnector",
    "KVDepotConnectorAdapter",
    "KVDepotLMCacheConnector",
    "PluginSettings",
    "chunk_key",
]
