"""The engine half of the shutdown kill test (tests/test_store_shutdown_kill.py): a TieredStore with DRAM over an
SSD puts blocks whose bytes derive from their keys, then closes, which writes DRAM down to the SSD, until the
test kills it with SIGKILL somewhere in that write-down.

Runs in a child forked from a forkserver that has kvtier and torch imported, so each kill costs milliseconds,
not an interpreter start. It tells the test over ``conn`` when the write-down starts and, if it lives that long,
how long the close took.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import torch

from conftest import blocks_for
from kvtier import TieredStore
from kvtier.keys import Namespace

BB = 32 << 10
BLOCKS = 256  # 8 MiB of DRAM to write down
KEYS = Namespace("shutdown-kill").keys(range(BLOCKS))


def config(ssd: str) -> dict:
    """DRAM holds every block (on_evict writes nothing before the close); a small write-behind staging makes the
    write-down many batches, each its own fdatasync and index commit, so a kill lands between and inside them."""
    return {"dram_capacity": BLOCKS * BB, "ssd_path": ssd, "ssd_capacity": 2 * BLOCKS * BB,
            "ssd_segment_bytes": "1MiB", "ssd_staging_bytes": 8 * BB}


def engine(ssd: str, conn: Connection) -> None:
    torch.set_num_threads(1)
    s = TieredStore.from_config(config(ssd), BB)
    if s.put(KEYS, blocks_for(KEYS, BB)).stored != BLOCKS or any(s.tiers[1].contains(KEYS)):
        raise SystemExit("the setup failed: DRAM did not take every block, or some reached the SSD before close")
    t0 = time.monotonic()
    conn.send("closing")  # the write-down starts now
    s.close()
    conn.send(time.monotonic() - t0)
