"""kvdepot: a KV-centric distributed cache store for LLM inference."""

from kvdepot.errors import (
    CapacityExceeded,
    Corrupt,
    InvalidArgument,
    KVDepotError,
    NotFound,
    Unavailable,
)

__version__ = "0.1.0"

__all__ = [
    "CapacityExceeded",
    "Corrupt",
    "InvalidArgument",
    "KVDepotError",
    "NotFound",
    "Unavailable",
    "__version__",
]
