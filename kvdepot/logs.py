"""Log output of the ``kvdepot`` processes: human text or one JSON object per line.

``--log-format json`` makes every record one line of JSON on stderr, with
``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``msg`` and
the record's extra fields (``logger.info(..., extra={"event": "registered",
"chunks": 3})``), so a log shipper needs no parsing rules. Daemons log one
line per significant event (listening, registered, lease expired, health
changed, a summary of evictions), never one per chunk.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from kvdepot.errors import InvalidArgument

LOG_FORMATS = ("text", "json")

# Attributes every LogRecord has; anything else came in through ``extra``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_") and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Send the root logger's records to stderr as ``fmt`` (``text`` or ``json``).

    Raises:
        InvalidArgument: an unknown format or level.
    """
    if fmt not in LOG_FORMATS:
        raise InvalidArgument(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise InvalidArgument(f"unknown log level {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
