"""Whether Redis still holds the directory history a master applied, and starting a new one when it does not.

SharedBackend (shared.py) asks ``history_lost`` whenever Redis comes back under the epoch it followed, or its
tail stepped back: Redis may have restarted without its data or behind its last writes, an older RDB/AOF may
have been restored, a FLUSHALL run. Writes this master applied (and answered: nodes were told their events were
in) would then be gone. A loss is counted and logged (``count_loss``: kvtier_master_directory_losses, by what
was found), and ``rebase`` replaces the epoch and appends the ``_rebase`` entry in one script (one master wins;
the reload that follows applies it, and every node resyncs). No epoch at all is re-seeding, SharedBackend._seed.

Pure functions over the log (redis_log.py); the caller owns the state they read (its applied position).
"""

from __future__ import annotations

import logging

from kvtier.master import commands
from kvtier.master.metrics import MasterMetrics
from kvtier.master.redis_log import RedisLog, pack

log = logging.getLogger("kvtier.master")

# What a master found when it checked the directory's history (the kvtier_master_directory_losses label).
EMPTY, BEHIND, REWRITTEN = "empty", "behind", "rewritten"


def stream_id(eid: bytes) -> tuple[int, int]:
    """A Redis stream id (b"ms-seq") as a pair that orders as the stream does."""
    ms, _, seq = eid.partition(b"-")
    return int(ms), int(seq or 0)


async def history_lost(rlog: RedisLog, last_n: int, last_id: bytes, stepped_back: bool) -> tuple[str, str] | None:
    """(what, why) if the log under this master's epoch no longer holds entry ``last_n`` (stream id ``last_id``),
    the one it applied last, as it was (Redis restarted behind its last writes, an older copy restored, entries
    appended after either; ``stepped_back``: its tail read an entry at or before it); None if it does, or if a
    trim behind a snapshot took it (this master fell behind: a plain reload)."""
    counter = await rlog.counter()
    if counter < last_n:
        return BEHIND, f"redis's log counter is {counter}, behind entry {last_n} this master applied"
    if stepped_back:
        return REWRITTEN, f"the log stepped back to an entry at or before {last_n}, which this master applied"
    if last_n == 0:
        return None
    n = await rlog.entry_n(last_id)
    if n == last_n:
        return None
    if n is None:
        first = await rlog.first_id()
        if first is not None and stream_id(first) > stream_id(last_id):
            return None  # trimmed behind a snapshot taken past this master
    what = "gone" if n is None else f"entry {n} now"
    return REWRITTEN, f"entry {last_n} this master applied last (id {last_id.decode()}) is {what}"


def count_loss(metrics: MasterMetrics, url: str, what: str, why: str) -> None:
    """One loss this master found (``what``: EMPTY, BEHIND, REWRITTEN), counted and logged."""
    metrics.directory_losses.labels(what).inc()
    log.warning("kvtier-master: the shared directory in %s lost writes this master applied (%s): starting a "
                "new epoch; every node resyncs with a full inventory", url, why)


async def rebase(rlog: RedisLog, followed: str, why: str, wall: float, master_id: str) -> None:
    """Replace the epoch ``followed`` and log ``_rebase`` under the new one (the reload that follows applies it);
    nothing if another master did first (the reload applies theirs)."""
    epoch = rlog.new_epoch()
    e = commands.entry(commands.REBASE, {"epoch": epoch, "why": why}, None, wall, master_id, 0)
    n = await rlog.rebase(followed, epoch, pack(e))
    if n is None:
        log.info("kvtier-master: another master started a new epoch first")
    else:
        log.warning("kvtier-master: new epoch %s from log entry %d", epoch, n)
