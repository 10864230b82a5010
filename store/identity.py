"""The identity of a store instance: what makes a node id its own.

A node id is owned by the store instance that holds a live lease on it: the
metadata service refuses a registration of that id from any other instance
(a duplicate ``--node-id``), unless the lease has run out or the operator
forces it. An instance is a random id made at start; a store with an SSD
directory keeps it there (next to the segments, under the directory's lock),
so that a store restarted on its own SSD directory after a crash is the same
instance and takes its node id back at once instead of waiting for the lease.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from kvdepot.errors import Unavailable

logger = logging.getLogger(__name__)

INSTANCE_FILE = "instance-id"
"""The file in the SSD directory that keeps the instance id."""


def new_instance_id() -> str:
    """A fresh random instance id (32 hex digits)."""
    return uuid.uuid4().hex


def _valid(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def instance_identity(ssd_dir: str) -> str:
    """This store instance's id: the one kept in ``ssd_dir``, else a new one.

    Args:
        ssd_dir: The store's SSD directory (already created and locked by its
            SSD tier); empty for a store without one, whose every start is a
            new instance.

    Raises:
        Unavailable: The id file cannot be read or written.
    """
    if not ssd_dir:
        return new_instance_id()
    path = Path(ssd_dir) / INSTANCE_FILE
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        text = ""
    except OSError as exc:
        raise Unavailable(f"cannot read the store's instance id {path}: {exc}") from None
    if _valid(text):
        return text
    if text:
        logger.warning("%s does not hold an instance id; a new one replaces it", path)
    ident = new_instance_id()
    tmp = path.with_name(INSTANCE_FILE + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, (ident + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        raise Unavailable(f"cannot write the store's instance id {path}: {exc}") from None
    return ident
