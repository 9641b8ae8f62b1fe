"""Warm restart of the SSD tier: which index entries the segment files on disk can still back.

Run once when a DiskTier opens its directory, before it serves anything. An entry survives when it was
written for this geometry and layout, lies inside the configured capacity, and its segment file exists and is
long enough; the others are deleted from the index (counted by reason). A directory written with another slot
size, block size or layout starts empty: its bytes cannot be read this way.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from kvtier.tiers.ssd.index import FORMAT_VERSION, DiskIndex, IndexEntry
from kvtier.tiers.ssd.io import SegmentFiles

log = logging.getLogger(__name__)


@dataclass
class Restored:
    """``blocks``: (slot, key, checksum), oldest write first; ``dropped``: reason -> entries deleted."""

    blocks: list[tuple[int, bytes, int]] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    next_seq: int = 0


def restore_index(index: DiskIndex, files: SegmentFiles, block_bytes: int, fingerprint: int) -> Restored:
    geometry = {"format": FORMAT_VERSION, "slot_bytes": files.slot_bytes, "per_segment": files.per_segment,
                "block_bytes": block_bytes, "fingerprint": fingerprint}
    old = index.geometry()
    if old != geometry:
        if old is not None:
            log.warning("SSD tier at %s was written with %s, now %s: its blocks cannot be read this way; "
                        "starting empty", files.root, old, geometry)
        index.reset(geometry)
        files.remove_all()
        return Restored()
    sizes = files.scan()
    owner: dict[int, tuple[int, bytes, int]] = {}  # slot -> (seq, key, checksum)
    out = Restored()
    drop: list[bytes] = []
    for key, e in index.items():
        reason = _invalid(key, e, sizes, files, block_bytes, fingerprint)
        if not reason and e is not None:
            slot = e.segment * files.per_segment + e.offset // files.slot_bytes
            prev = owner.get(slot)
            if prev is None or prev[0] < e.seq:
                if prev is not None:  # cannot happen with ordered writes; the newer entry wins
                    drop.append(prev[1])
                    out.dropped["duplicate_slot"] += 1
                owner[slot] = (e.seq, key, e.checksum)
                continue
            reason = "duplicate_slot"
        drop.append(key)
        out.dropped[reason] += 1
    index.write(delete=drop)
    ordered = sorted(owner.items(), key=lambda item: item[1][0])
    out.blocks = [(slot, key, checksum) for slot, (_, key, checksum) in ordered]
    out.next_seq = ordered[-1][1][0] + 1 if ordered else 0
    if out.blocks or drop:
        log.info("SSD tier at %s: %d blocks restored, %d dropped (%s)", files.root, len(out.blocks), len(drop),
                 ", ".join(f"{r}: {n}" for r, n in out.dropped.items()) or "none")
    return out


def _invalid(key: bytes, e: IndexEntry | None, sizes: dict[int, int], files: SegmentFiles, block_bytes: int,
             fingerprint: int) -> str:
    """Why an index entry cannot be served ("" when it can)."""
    if e is None or len(key) != 16:
        return "unreadable_entry"
    if e.length != block_bytes or e.fingerprint != fingerprint:
        return "other_layout"
    slot_in_segment, misaligned = divmod(e.offset, files.slot_bytes)
    if misaligned or slot_in_segment >= files.per_segment or \
            e.segment * files.per_segment + slot_in_segment >= files.num_slots:
        return "beyond_capacity"
    if e.segment not in sizes:
        return "segment_file_missing"
    if sizes[e.segment] < e.offset + files.slot_bytes:
        return "segment_file_truncated"
    return ""
