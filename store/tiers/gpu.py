"""The GPU tier: one preallocated torch tensor on a device, used as an arena.

Chunks reach it from DRAM (hot chunks are promoted up in the background)
and leave it for DRAM (demoted when it fills, or moved down for a reader
that maps the DRAM arena). Bytes move with ``Tensor.copy_`` between the
device tensor and a CPU tensor that aliases the host buffer
(``torch.frombuffer``), so no intermediate copy is made; with the DRAM arena
page-locked (:func:`pin_host_memory`) those copies are DMA transfers.

The device is injected: ``cuda``/``cuda:N`` on a GPU node, ``cpu`` in tests,
so the same code paths run everywhere. torch is imported when a tier is
created (or memory pinned), never when this module is imported: a store
without a GPU tier does not load it.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvdepot.errors import InvalidArgument, Unavailable
from kvdepot.keys import ChunkKey
from kvdepot.store.allocator import Allocator
from kvdepot.store.tiers.base import AllocatorSpace, Tier, TierLimits

logger = logging.getLogger(__name__)


def _torch() -> ModuleType:
    try:
        import torch
    except ImportError as exc:
        raise Unavailable(f"the gpu tier needs torch: {exc}") from exc
    return torch


def _host_tensor(torch: ModuleType, buf: memoryview) -> Any:
    # frombuffer warns about read-only buffers (a tensor could write them);
    # these tensors are only ever copied from.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def pin_host_memory(address: int, size: int) -> bool:
    """Page-lock ``size`` bytes at ``address`` with CUDA; False where CUDA is not.

    Failures are logged: unpinned memory still works, only slower.
    """
    try:
        torch = _torch()
    except Unavailable as exc:
        logger.warning("DRAM arena not pinned: %s", exc)
        return False
    if not torch.cuda.is_available():
        logger.info("DRAM arena not pinned: CUDA is not available")
        return False
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(address, size, 0)
    if rc != _cuda_success(cudart):
        logger.warning("DRAM arena not pinned: cudaHostRegister failed with %s", rc)
        return False
    logger.info("DRAM arena of %d bytes pinned for CUDA", size)
    return True


def unpin_host_memory(address: int) -> None:
    """Undo :func:`pin_host_memory`.

    Raises:
        Unavailable: If CUDA refuses.
    """
    torch = _torch()
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostUnregister(address)
    if rc != _cuda_success(cudart):
        raise Unavailable(f"cudaHostUnregister failed with {rc}")


def _cuda_success(cudart: Any) -> Any:
    errors = getattr(cudart, "cudaError", None)
    return getattr(errors, "success", 0)


@dataclass(frozen=True, slots=True)
class GpuTierConfig:
    """The GPU tier's settings: ``gpu_*`` of the store's (documented there)."""

    capacity_bytes: int
    device: str
    watermarks: str


class GpuTier(AllocatorSpace, Tier):
    """Chunks in a device tensor.

    Args:
        capacity: Bytes of the tensor, allocated up front.
        device: torch device, e.g. ``cuda``, ``cuda:1`` or ``cpu`` (tests).
        limits: The tier's watermarks.
        alignment: Granularity of allocations (a power of two).

    Raises:
        InvalidArgument: If ``capacity`` or ``device`` is invalid.
        Unavailable: If torch is missing, the device does not exist, or the
            tensor cannot be allocated.
    """

    name = "gpu"
    config_type = GpuTierConfig

    def __init__(
        self,
        capacity: int,
        *,
        device: str = "cuda",
        limits: TierLimits = TierLimits(),  # noqa: B008 - frozen, immutable default
        alignment: int = 4096,
    ) -> None:
        super().__init__(limits)
        torch = _torch()
        self._torch = torch
        try:
            self._device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidArgument(f"bad gpu tier device {device!r}: {exc}") from exc
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise Unavailable(f"gpu tier on {device}: CUDA is not available")
        self._allocator = Allocator(capacity, alignment)
        try:
            self._buf = torch.empty(
                self._allocator.capacity, dtype=torch.uint8, device=self._device
            )
        except RuntimeError as exc:  # out of device memory
            raise Unavailable(f"cannot allocate {capacity} bytes on {device}: {exc}") from exc
        logger.info("gpu tier: %d bytes on %s", self._allocator.capacity, self._device)

    @classmethod
    def from_config(cls, config: GpuTierConfig) -> GpuTier:
        """The GPU tier of ``capacity_bytes`` on ``device``."""
        return cls(
            config.capacity_bytes,
            device=config.device,
            limits=TierLimits.parse(config.watermarks),
        )

    @property
    def device(self) -> str:
        """The torch device the tier lives on."""
        return str(self._device)

    def write(self, handle: int, data: memoryview, *, key: ChunkKey, checksum: int) -> None:
        n = len(data)
        self._buf[handle : handle + n].copy_(_host_tensor(self._torch, data))

    def read_into(self, handle: int, dest: memoryview) -> None:
        n = len(dest)
        _host_tensor(self._torch, dest).copy_(self._buf[handle : handle + n])

    def close(self) -> None:
        # The tensor's memory returns to torch's caching allocator (a slice
        # would keep all of it alive).
        self._buf = self._torch.empty(0, dtype=self._torch.uint8, device=self._device)
