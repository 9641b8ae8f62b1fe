"""LocationTable: the numbering of the directory's locations, each one bit of every directory entry's mask.

Each (node, tier) of a node's sync generation owns one location while that generation lasts (nodes.py). A
location taken away from its owner (a new sync generation, a death) is *retired*: its bits may still be set in
the directory, which sweeps them and hands the number back (``release``) before it is numbered again, so a
new owner never inherits an old owner's placements. At most ``limit`` locations are held at once (the master's
--max-locations): whether a node fits depends on the numbers held, never on how far the sweep got, so masters
sharing one log (master/shared.py) all give the same answer.

Runs in the master's event loop; not thread-safe. Owned by NodeRegistry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier import wire
from kvtier.wire import WireError

Owner = tuple[str, str]  # (node id, tier name)


class LocationTable:
    """Location numbers: their owners (None: retired or free) and the swept ones free for reuse."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._owner: list[Owner | None] = []  # location -> (node, tier) while owned
        self._free: list[int] = []  # swept locations, reusable

    @property
    def count(self) -> int:
        """Locations ever numbered (owned, retired or free): the directory masks need this many bits."""
        return len(self._owner)

    def owner(self, loc: int) -> Owner | None:
        return self._owner[loc] if loc < len(self._owner) else None

    def number(self, node_id: str, tiers: Sequence[str],
               reclaim: Callable[[], list[int]] | None) -> dict[str, int]:
        """A location for each of ``tiers`` of ``node_id``, lowest free numbers first (``reclaim``: finishes the
        directory's sweep now, returning the locations it freed, where the free ones do not suffice);
        ERR_TOO_LARGE where fewer than ``len(tiers)`` are left under the limit."""
        held = sum(o is not None for o in self._owner)
        if self.limit - held < len(tiers):
            raise WireError(wire.ERR_TOO_LARGE, f"node {node_id!r} needs {len(tiers)} directory locations "
                                                f"and {held} of the master's {self.limit} are held (one per "
                                                "node tier): forget dead nodes, or raise --max-locations")
        available = len(self._free) + max(0, self.limit - len(self._owner))
        if available < len(tiers) and reclaim is not None:
            self.release(reclaim())
        out: dict[str, int] = {}
        for tier in tiers:
            if self._free:
                self._free.sort()
                loc = self._free.pop(0)
                self._owner[loc] = (node_id, tier)
            else:
                loc = len(self._owner)
                self._owner.append((node_id, tier))
            out[tier] = loc
        return out

    def retire(self, locations: Sequence[int]) -> None:
        """Take these locations from their owners; their bits are swept by the directory, then ``release``d."""
        for loc in locations:
            self._owner[loc] = None

    def release(self, locations: Sequence[int]) -> None:
        """The directory swept these locations clean: they may be numbered again."""
        for loc in locations:
            if loc < len(self._owner) and self._owner[loc] is None and loc not in self._free:
                self._free.append(loc)

    def set_owner(self, loc: int, owner: Owner | None) -> None:
        """Number ``loc`` as held by ``owner`` (None: unowned), numbering every location below it too."""
        if loc >= len(self._owner):
            self._owner.extend([None] * (loc + 1 - len(self._owner)))
        self._owner[loc] = owner

    def adopt_orphans(self, present: Sequence[int], owned: set[int]) -> list[int]:
        """After a restart: of the locations with bits in the restored directory (``present``), those not
        ``owned`` must be swept before reuse (returned, retired); every other unowned number is free now."""
        orphans = [loc for loc in present if loc not in owned]
        for loc in orphans:
            self.set_owner(loc, None)
        swept = set(orphans)
        self._free = [i for i, o in enumerate(self._owner) if o is None and i not in swept]
        return orphans
