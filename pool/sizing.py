"""How a pool's blocks and slots may be sized: the smallest block a client may set, and the most slots a pool
keeps so that per-slot bookkeeping stays a small share of the memory it serves (PoolState sizes its tier by
these; the command line and the hello check a size by them before any memory is taken). Pure functions.
"""

from __future__ import annotations

from kvtier.units import format_bytes

MIN_BLOCK_BYTES = 512  # smaller "blocks" are a client bug, and would turn the pool's memory into bookkeeping
SLOT_OVERHEAD_BYTES = 256  # about what one slot costs in the tier's index, policy and key map
METADATA_SHARE = 16  # slots are capped so their bookkeeping stays under 1/16 of the memory served


def max_slots(capacity: int) -> int:
    """The most slots a pool of ``capacity`` bytes keeps: each costs about SLOT_OVERHEAD_BYTES of bookkeeping
    (index, policy, key map), held to 1/METADATA_SHARE of the memory served."""
    return max(1, capacity // (SLOT_OVERHEAD_BYTES * METADATA_SHARE))


def block_size_problem(block_bytes: int, capacity: int, minimum: int = MIN_BLOCK_BYTES) -> str | None:
    """Why a pool of ``capacity`` bytes cannot hold blocks of ``block_bytes`` (naming the sizes), or None."""
    if block_bytes < minimum:
        return (f"blocks of {block_bytes} B are smaller than the pool's minimum of {minimum} B (a KV block "
                "is kilobytes to megabytes; is block_bytes a count of something else?)")
    if block_bytes > capacity:
        return f"a block of {format_bytes(block_bytes)} does not fit the pool's capacity of {format_bytes(capacity)}"
    return None


__all__ = ["MIN_BLOCK_BYTES", "block_size_problem", "max_slots"]
