"""What ``batch_exists_v2`` answers: which prefix lengths of a span every pool can restore (SGLang 0.5.23's hit
policies, ``PoolHitPolicy`` in ``sglang/srt/mem_cache/hicache_storage.py``).

SGLang asks for a span of page keys (the KV pages, chained) and, per extra pool, a hit policy:

* ``all_pages``: the pool holds a page for every KV page of the prefix (the DSA indexer, KV-derived sidecars):
  a prefix of length p needs the pool's pages 0..p-1;
* ``trailing_pages``: the pool holds state that is valid only at the end of a prefix (Mamba/GDN: one state,
  window 1; sliding-window KV: the last ``window`` pages): a prefix of length p needs the pool's pages
  p-window..p-1 (0..p-1 when p < window). Such a pool allows a SET of lengths (a Mamba state at pages 4 and 8
  but not at 6), not a longest prefix;
* ``block_groups``: whole groups of ``group_pages`` keys, group g standing for FULL pages
  [g*block_pages, (g+1)*block_pages); the pool reports the pages its leading complete groups cover as its own
  verdict and never gates the KV hit.

The answer: ``restorable`` = the lengths 1..kv_pages that every gating pool allows (SGLang intersects these sets
over its ranks; a maximum would pick a length another rank cannot restore), ``final`` its largest element (0:
nothing restorable, so KV pages without their state are never reported as a hit), ``pool_pages`` each pool's own
verdict (its largest allowed length; the KV pool's leading run under "kv"). Pure functions, no SGLang import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
BLOCK_GROUPS = "block_groups"
POLICIES = (ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS)


@dataclass(frozen=True)
class PoolQuery:
    """One extra pool of a ``batch_exists_v2`` call: its name, policy and the policy's geometry.

    ``present``: for all_pages and trailing_pages, whether the pool holds the page of each span key (index i:
    the state or page stored under span key i); for block_groups, whether it holds each of its own keys, in
    group order."""

    name: str
    policy: str
    present: Sequence[bool]
    window: int = 1  # trailing_pages: pages that must exist at the end of a prefix
    block_pages: int = 0  # block_groups: FULL pages per group
    group_pages: int = 0  # block_groups: keys per group

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"pool {self.name}: unknown hit policy {self.policy!r}; known: {POLICIES}")
        if self.window < 1:
            raise ValueError(f"pool {self.name}: a trailing window must be >= 1 page, got {self.window}")
        if self.policy == BLOCK_GROUPS and (self.block_pages < 1 or self.group_pages < 1):
            raise ValueError(f"pool {self.name}: block_groups needs block_pages and group_pages >= 1, got "
                             f"{self.block_pages} and {self.group_pages}")


@dataclass(frozen=True)
class Hits:
    final: int
    restorable: list[int]
    pool_pages: dict[str, int]


def leading(present: Sequence[bool]) -> int:
    """How many leading entries are True."""
    for i, p in enumerate(present):
        if not p:
            return i
    return len(present)


def allowed_lengths(query: PoolQuery, kv_pages: int) -> set[int] | None:
    """The prefix lengths in 1..kv_pages this pool can restore (None: the pool does not gate the KV hit)."""
    if query.policy == BLOCK_GROUPS:
        return None
    present = list(query.present[:kv_pages]) + [False] * max(0, kv_pages - len(query.present))
    if query.policy == ALL_PAGES:
        return set(range(1, leading(present) + 1))
    # trailing_pages: a running count of consecutive held pages ending at each page
    run, allowed = 0, set()
    for p in range(1, kv_pages + 1):
        run = run + 1 if present[p - 1] else 0
        if run >= min(query.window, p):
            allowed.add(p)
    return allowed


def block_group_pages(query: PoolQuery, kv_pages: int) -> int:
    """FULL pages covered by the pool's leading complete groups (capped at the KV hit)."""
    groups = leading(query.present) // query.group_pages
    return min(groups * query.block_pages, kv_pages)


def span_hits(kv_pages: int, pools: Sequence[PoolQuery]) -> Hits:
    """The v2 answer for a span whose KV pool holds ``kv_pages`` leading pages (module docstring)."""
    restorable = set(range(1, kv_pages + 1))
    pool_pages = {"kv": kv_pages} if kv_pages else {}
    for query in pools:
        allowed = allowed_lengths(query, kv_pages)
        if allowed is None:
            own = block_group_pages(query, kv_pages)
        else:
            restorable &= allowed
            own = max(allowed, default=0)
        if own:
            pool_pages[query.name] = own
    ordered = sorted(restorable)
    return Hits(ordered[-1] if ordered else 0, ordered, pool_pages)
