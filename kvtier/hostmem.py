"""HostBuffer: one large host allocation, made once: plain, page-locked for fast GPU copies, or shared.

A shared buffer is a file (normally under /dev/shm) mapped MAP_SHARED, so another process (the node pool's
clients) can map the same bytes. Page-locking uses CUDA's host registration and is done only when CUDA is
present; on a CPU-only machine "auto" means plain memory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PAGE = 4096


class HostBuffer:
    """``nbytes`` of host memory as a 1-D uint8 tensor. Owned by its creator; freed on close()."""

    def __init__(self, nbytes: int, *, shm_path: str | os.PathLike[str] | None = None,
                 pin_memory: str | bool = "auto", prefault: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"HostBuffer size must be > 0, got {nbytes}")
        self.nbytes = nbytes
        self.path = Path(shm_path) if shm_path else None
        self._registered = False
        want_pin = _want_pin(pin_memory)
        if self.path is not None:
            self.tensor = _map_file(self.path, nbytes)
            if want_pin:
                self._registered = _cuda_host_register(self.tensor)
        elif want_pin:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = bool(want_pin and (self._registered or self.path is None))
        if prefault:
            self.tensor.zero_()  # fault every page in now rather than on the first puts
        self.ptr = int(self.tensor.data_ptr())

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self._registered = False
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def __repr__(self) -> str:
        where = f"shared at {self.path}" if self.path else ("pinned" if self.pinned else "private")
        return f"HostBuffer({self.nbytes} B, {where})"


def _want_pin(pin_memory: str | bool) -> bool:
    if isinstance(pin_memory, bool):
        wanted = pin_memory
    elif pin_memory in ("auto", "true", "false"):
        wanted = pin_memory == "true" or (pin_memory == "auto" and torch.cuda.is_available())
    else:
        raise ValueError(f"pin_memory must be auto, true or false, got {pin_memory!r}")
    if wanted and not torch.cuda.is_available():
        log.warning("pin_memory requested but CUDA is not available; using plain host memory")
        return False
    return wanted


def _map_file(path: Path, nbytes: int) -> torch.Tensor:
    """Create (or reuse) ``path`` with exactly ``nbytes`` and map it shared."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if hasattr(os, "posix_fallocate"):
            try:  # reserve the pages now: a full /dev/shm must fail here, not with SIGBUS on a later put
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                raise OSError(e.errno, f"cannot reserve {nbytes} bytes for the shared buffer {path}: "
                                       f"{e.strerror}") from None
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def _cuda_host_register(t: torch.Tensor) -> bool:
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(rc) != 0:
        log.warning("cudaHostRegister of the shared DRAM buffer failed (%s); GPU copies will be slower", rc)
        return False
    return True
