"""The engine half of the shutdown kill test (tests/test_store_shutdown_kill.py): a TieredStore with DRAM over an
SSD puts blocks whose bytes derive from their keys, then closes, which writes DRAM down to the SSD, until the
test kills it with SIGKILL somewhere in that write-down.

Runs in a child forked from a forkserver that has kvtier and torch imported, so each kill costs milliseconds,
not an interpreter start. It tells the test over ``conn`` when the write-down starts and, if it lives that long,
how long the close took. With a ``stop`` point it freezes right after its n-th index commit or segment write of
the close and says so, so the test kills it exactly where a write order matters (a random delay rarely lands
in the short gap between an index commit and the data it names). The freeze only waits; it changes no order.
"""

from __future__ import annotations

import itertools
import threading
import time
from multiprocessing.connection import Connection

import torch

from conftest import blocks_for
from kvtier import TieredStore
from kvtier.keys import Namespace
from kvtier.tiers.ssd.index import DiskIndex
from kvtier.tiers.ssd.io import SegmentFiles

BB = 32 << 10
BLOCKS = 256  # 8 MiB of DRAM to write down
STAGED_BLOCKS = 8  # the SSD's write-behind staging: the write-down's batches hold at most this many blocks
KEYS = Namespace("shutdown-kill").keys(range(BLOCKS))


def config(ssd: str) -> dict:
    """DRAM holds every block (on_evict writes nothing before the close); a small write-behind staging makes the
    write-down many batches, each its own fdatasync and index commit, so a kill lands between and inside them."""
    return {"dram_capacity": BLOCKS * BB, "ssd_path": ssd, "ssd_capacity": 2 * BLOCKS * BB,
            "ssd_segment_bytes": "1MiB", "ssd_staging_bytes": STAGED_BLOCKS * BB}


def engine(ssd: str, conn: Connection, stop: tuple[str, int] | None = None) -> None:
    torch.set_num_threads(1)
    s = TieredStore.from_config(config(ssd), BB)
    if s.put(KEYS, blocks_for(KEYS, BB)).stored != BLOCKS or any(s.tiers[1].contains(KEYS)):
        raise SystemExit("the setup failed: DRAM did not take every block, or some reached the SSD before close")
    if stop is not None:
        freeze_after(*stop, conn)
    t0 = time.monotonic()
    conn.send("closing")  # the write-down starts now
    s.close()
    conn.send(time.monotonic() - t0)


def freeze_after(what: str, n: int, conn: Connection) -> None:
    """From now on, freeze this process right after its ``n``-th index commit of new entries (``what`` "index":
    DiskIndex.write with ``put``) or segment write ("data": SegmentFiles.write), telling ``conn`` first."""
    cls = DiskIndex if what == "index" else SegmentFiles
    real = cls.write
    count, lock = itertools.count(1), threading.Lock()

    def write(self, *args, **kw):
        real(self, *args, **kw)
        if what == "index" and not kw.get("put"):
            return  # a delete-only (or empty) transaction: not a commit of new blocks
        with lock:
            k = next(count)
        if k == n:
            conn.send(("frozen", what, n))
            time.sleep(120)  # until the test kills this process
    cls.write = write
