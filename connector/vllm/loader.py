"""Layer-pipelined loading of chunks for the vLLM connector.

A chunk written by the connector starts with a small header holding the
xxh3-64 of each layer's (encoded) bytes and the codec header, then the
layers in order::

    [ L x u64 layer checksums | 16 B codec header, padded to 64 B ][ layer 0 ] ... [ layer L-1 ]

so a reader can fetch one layer of every chunk at a time (ranged reads) and
verify each layer end to end against what the writer hashed. A chunk whose
codec header differs from the one the reader expects (another codec, block
size, dtype or shape) is a miss: its bytes are never decoded. A background
thread fetches the headers, then layer 0, 1, … ; the engine's forward pass
waits only for the layer it is about to run, so layer 0 computes while later
layers are still in flight. A chunk whose layer is missing or fails its
checksum cuts the loadable prefix there: its blocks, and those of every later
chunk of the request, are reported for recomputation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvdepot.connector.client import KVDepotClient
from kvdepot.connector.codec.base import HEADER_BYTES as CODEC_HEADER_BYTES
from kvdepot.errors import InvalidArgument, KVDepotError
from kvdepot.keys import ChunkKey
from kvdepot.wire.xxh3 import checksum

logger = logging.getLogger(__name__)


def header_bytes(num_layers: int) -> int:
    """Size of the chunk header (checksums and codec header), padded to 64 bytes."""
    return -(-(8 * num_layers + CODEC_HEADER_BYTES) // 64) * 64


def write_header(
    staging: np.ndarray, num_layers: int, layer_bytes: int, codec_header: bytes
) -> None:
    """Fill each row's header with the checksums of its layers and the codec header."""
    if len(codec_header) != CODEC_HEADER_BYTES:
        raise InvalidArgument(f"codec header must be {CODEC_HEADER_BYTES} bytes")
    hb = header_bytes(num_layers)
    at = 8 * num_layers
    for row in staging:
        sums = np.array(
            [
                checksum(row[hb + li * layer_bytes : hb + (li + 1) * layer_bytes].data)
                for li in range(num_layers)
            ],
            dtype="<u8",
        )
        row[:at] = sums.view(np.uint8)
        row[at : at + CODEC_HEADER_BYTES] = np.frombuffer(codec_header, dtype=np.uint8)
        row[at + CODEC_HEADER_BYTES : hb] = 0


@dataclass
class LoadJob:
    """The chunks one step loads, and how far each request's prefix got."""

    keys: list[list[ChunkKey]]
    staging: list[np.ndarray]
    num_layers: int
    ok: list[int] = field(default_factory=list)  # leading good chunks per request
    layer_ok: list[list[int]] = field(default_factory=list)  # ok as of each layer
    events: list[threading.Event] = field(default_factory=list)
    error: str = ""
    deadline: float = 0.0  # time.monotonic() by which every layer must arrive
    started: float = 0.0
    fetch_s: float = 0.0  # set when every layer arrived

    def wait_layer(self, layer: int, timeout_s: float) -> list[int] | None:
        """Block until ``layer`` arrived; the leading good chunks per request,
        or None if it did not arrive in time."""
        if not self.events[layer].wait(timeout_s):
            return None
        return self.layer_ok[layer]


class LayerLoader:
    """Runs load jobs on one background thread, layer by layer."""

    def __init__(
        self, client: KVDepotClient, num_layers: int, layer_bytes: int, codec_header: bytes
    ) -> None:
        if len(codec_header) != CODEC_HEADER_BYTES:
            raise InvalidArgument(f"codec header must be {CODEC_HEADER_BYTES} bytes")
        self._client = client
        self._layers = num_layers
        self._layer_bytes = layer_bytes
        self._header = header_bytes(num_layers)
        self._codec_header = np.frombuffer(codec_header, dtype=np.uint8)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-load")

    @property
    def chunk_bytes(self) -> int:
        return self._header + self._layers * self._layer_bytes

    def start(self, keys: Sequence[Sequence[ChunkKey]], timeout_s: float) -> LoadJob:
        now = time.monotonic()
        job = LoadJob(
            keys=[list(k) for k in keys],
            staging=[np.empty((len(k), self.chunk_bytes), dtype=np.uint8) for k in keys],
            num_layers=self._layers,
            ok=[len(k) for k in keys],
            layer_ok=[[] for _ in range(self._layers)],
            events=[threading.Event() for _ in range(self._layers)],
            deadline=now + timeout_s,
            started=now,
        )
        self._pool.submit(self._run, job)
        return job

    def _run(self, job: LoadJob) -> None:
        try:
            self._fetch(job)
        except (KVDepotError, OSError) as exc:
            job.error = str(exc)
            logger.warning("kvdepot layer load failed: %s", exc)
        except Exception as exc:  # never leave the forward pass waiting
            job.error = repr(exc)
            logger.exception("kvdepot layer load crashed")
        finally:
            if job.error:
                job.ok = [0] * len(job.ok)
            for layer, event in enumerate(job.events):
                if not event.is_set():
                    job.layer_ok[layer] = list(job.ok)
                    event.set()

    def _fetch(self, job: LoadJob) -> None:
        replicas: list[list[list[str]]] = []
        for r, keys in enumerate(job.keys):
            reply = self._client.lookup_locations(keys, count="none")
            job.ok[r] = min(job.ok[r], int(reply.hits))
            replicas.append([[x.address for x in loc.replicas] for loc in reply.locations])
        got = self._read(job, replicas, 0, self._header)
        at = 8 * self._layers
        for r, staging in enumerate(job.staging):
            for c in range(job.ok[r]):
                # Written with another codec or shape: a miss, never decoded.
                if got[r][c] and not np.array_equal(
                    staging[c, at : at + CODEC_HEADER_BYTES], self._codec_header
                ):
                    logger.warning("kvdepot: chunk with an unexpected codec header; a miss")
                    got[r][c] = False
        self._cut(job, got)
        sums = [
            [staging[c, : 8 * self._layers].view("<u8").tolist() for c in range(job.ok[r])]
            for r, staging in enumerate(job.staging)
        ]
        for layer in range(self._layers):
            start = self._header + layer * self._layer_bytes
            got = self._read(job, replicas, start, self._layer_bytes)
            for r, staging in enumerate(job.staging):
                for c in range(job.ok[r]):
                    data = staging[c, start : start + self._layer_bytes].data
                    if not got[r][c] or checksum(data) != sums[r][c][layer]:
                        job.ok[r] = c  # the usable prefix ends before this chunk
                        break
            job.layer_ok[layer] = list(job.ok)
            if layer == self._layers - 1:
                job.fetch_s = time.monotonic() - job.started
            job.events[layer].set()

    @staticmethod
    def _cut(job: LoadJob, got: list[list[bool]]) -> None:
        for r, flags in enumerate(got):
            for c in range(job.ok[r]):
                if not flags[c]:
                    job.ok[r] = c
                    break

    def _read(
        self, job: LoadJob, replicas: list[list[list[str]]], offset: int, length: int
    ) -> list[list[bool]]:
        """Read ``[offset, offset+length)`` of every chunk still in a prefix."""
        keys: list[ChunkKey] = []
        bufs: list[np.ndarray] = []
        reps: list[list[str]] = []
        where: list[tuple[int, int]] = []
        for r, staging in enumerate(job.staging):
            for c in range(job.ok[r]):
                keys.append(job.keys[r][c])
                bufs.append(staging[c, offset : offset + length])
                reps.append(replicas[r][c])
                where.append((r, c))
        flags = [[False] * len(k) for k in job.keys]
        if keys:
            done = self._client.get_ranges_into(keys, [(offset, length)] * len(keys), bufs, reps)
            for (r, c), ok in zip(where, done, strict=True):
                flags[r][c] = ok
        return flags

    def close(self) -> None:
        self._pool.shutdown(wait=True)
