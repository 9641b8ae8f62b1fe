"""Turn what callers pass as blocks (one 2-D tensor, a list of tensors, numpy arrays, bytes) into row addresses.

Every store call takes a batch of blocks. The fast form is one contiguous tensor or array with one block per
row (N x block_bytes bytes); a list of per-block buffers works too. ``BlockRows`` keeps the caller's objects
alive while their addresses are in use; the caller owns the memory and must not change or free it until the
call (or its future) completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class BlockRows:
    """Start address of each block and the objects that own those bytes."""

    ptrs: np.ndarray  # uint64, one per block
    owners: tuple[Any, ...]

    def take(self, index: Sequence[int]) -> BlockRows:
        """The rows at ``index``: ascending, distinct positions (so as many as there are rows is every row, and
        this object itself comes back)."""
        if len(index) == len(self.ptrs):
            return self
        return BlockRows(self.ptrs[list(index)], self.owners)


def block_rows(
    blocks: Any, count: int, block_bytes: int, *, writable: bool = False, dtypes: Sequence[str] = (),
    what: str = "blocks",
) -> BlockRows:
    """Validate ``blocks`` as ``count`` host buffers of ``block_bytes`` each and return their addresses.

    ``dtypes``: element types accepted besides uint8/int8 (the layout's dtype); empty accepts any.
    Raises ValueError naming the expected and actual sizes (and the block's index) on any mismatch.
    """
    if isinstance(blocks, BlockRows):  # already validated by an outer layer (the store)
        if len(blocks.ptrs) != count:
            raise ValueError(f"{what}: {count} keys but {len(blocks.ptrs)} blocks")
        return blocks
    if _is_array(blocks):
        if _nbytes(blocks) == count * block_bytes and (count == 0 or _rows(blocks) in (count, None)):
            _check_buffer(blocks, writable, dtypes, what)
            base = _address(blocks)
            return BlockRows(base + np.arange(count, dtype=np.uint64) * np.uint64(block_bytes), (blocks,))
        if count == 1 and _nbytes(blocks) != block_bytes:
            raise ValueError(f"{what}: expected {block_bytes} bytes per block, got {_nbytes(blocks)} bytes")
        if _rows(blocks) == count and count:
            per_row = _nbytes(blocks) // count
            raise ValueError(f"{what}: expected {block_bytes} bytes per block, got {per_row} bytes per row "
                             f"({tuple(blocks.shape)} {blocks.dtype})")
        raise ValueError(f"{what}: expected {count} blocks of {block_bytes} bytes ({count * block_bytes} bytes), "
                         f"got an array of {_nbytes(blocks)} bytes with shape {tuple(blocks.shape)}")
    if not isinstance(blocks, Sequence) or isinstance(blocks, (bytes, bytearray, memoryview, str)):
        raise TypeError(f"{what}: expected a tensor/array with one block per row or a list of blocks, "
                        f"got {type(blocks).__name__}")
    if len(blocks) != count:
        raise ValueError(f"{what}: {count} keys but {len(blocks)} blocks")
    ptrs = np.empty(count, dtype=np.uint64)
    owners = []
    for i, b in enumerate(blocks):
        if isinstance(b, (bytes, bytearray, memoryview)):
            b = np.frombuffer(b, dtype=np.uint8)  # read-only for bytes: rejected below if writable
        elif not _is_array(b):
            raise TypeError(f"{what}[{i}]: expected a tensor, array or bytes, got {type(b).__name__}")
        if _nbytes(b) != block_bytes:
            raise ValueError(f"{what}[{i}]: expected {block_bytes} bytes, got {_nbytes(b)} bytes")
        _check_buffer(b, writable, dtypes, f"{what}[{i}]")
        ptrs[i] = _address(b)
        owners.append(b)
    return BlockRows(ptrs, tuple(owners))


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or type(x).__module__.startswith("torch")


def _nbytes(x: Any) -> int:
    return int(x.nbytes)


def _rows(x: Any) -> int | None:
    return int(x.shape[0]) if len(x.shape) >= 2 else None


def _address(x: Any) -> int:
    return int(x.ctypes.data) if isinstance(x, np.ndarray) else int(x.data_ptr())


def _check_buffer(x: Any, writable: bool, dtypes: Sequence[str], what: str) -> None:
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError(f"{what}: the array must be C-contiguous")
        if writable and not x.flags.writeable:
            raise ValueError(f"{what}: the output buffer is read-only")
        dtype = str(x.dtype)
    else:
        if x.device.type != "cpu":
            raise ValueError(f"{what}: host tiers take CPU tensors, got a tensor on {x.device}; "
                             "stage GPU blocks with kvtier.kernels first")
        if not x.is_contiguous():
            raise ValueError(f"{what}: the tensor must be contiguous")
        dtype = str(x.dtype).removeprefix("torch.")
    if dtypes and dtype not in ("uint8", "int8") and dtype not in dtypes:
        raise ValueError(f"{what}: expected dtype {' or '.join(['uint8', *dtypes])}, got {dtype}")
