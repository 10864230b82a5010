"""``KVDepotConnectorAdapter``: how LMCache finds and builds the connector.

LMCache's ``ConnectorManager`` loads each ``remote_storage_plugins`` entry's
``module_path`` / ``class_name`` from ``extra_config`` and asks every adapter
whether it can parse the backend's URL. This adapter answers for
``plugin://kvdepot`` (and ``plugin://kvdepot.<instance>``), the URL LMCache
gives a plugin backend, and for ``kvdepot://host:port[,host:port]``.
"""

from __future__ import annotations

import logging
from typing import Any

from lmcache.v1.storage_backend.connector import ConnectorAdapter

from kvdepot.connector.lmcache.connector import KVDepotLMCacheConnector
from kvdepot.connector.lmcache.settings import SCHEME, is_plugin_url, resolve

logger = logging.getLogger(__name__)


class KVDepotConnectorAdapter(ConnectorAdapter):
    """Builds a :class:`KVDepotLMCacheConnector` for LMCache's remote backend."""

    def __init__(self) -> None:
        super().__init__(f"{SCHEME}://")

    def can_parse(self, url: str) -> bool:
        return url.startswith(self.schema) or is_plugin_url(url)

    def create_connector(self, context: Any) -> KVDepotLMCacheConnector:
        """Create the connector from LMCache's ``ConnectorContext``.

        Raises:
            InvalidArgument: no or a bad ``kvdepot://`` URL configured.
        """
        config = context.config
        settings = resolve(
            context.url,
            getattr(config, "extra_config", None),
            plugin_name=context.plugin_name,
        )
        return KVDepotLMCacheConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=config,
            metadata=context.metadata,
            settings=settings,
        )
