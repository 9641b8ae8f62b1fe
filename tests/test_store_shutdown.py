"""What reaches the SSD, in engine-like processes with a real DRAM tier over a real DiskTier (O_DIRECT where the
file system has it): a clean close with the default ssd_offload on_evict writes DRAM's blocks down, so the next
process finds them (bit-exact), within a bound it logs; a bound of 0 writes nothing and says what was lost
(the negative control); and write_through stores on the SSD the whole batch a put offered, also the blocks
DRAM had no room for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import TieredStore
from kvtier.keys import Namespace

BB = 16 << 10
KEYS = Namespace("shutdown-test").keys(range(400))

ENGINE = r"""
import atexit, json, logging, os, signal, sys, torch
sys.path.insert(0, sys.argv[3])
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from conftest import blocks_for
from kvtier import TieredStore
from test_store_shutdown import BB, KEYS, config
n = int(sys.argv[2])
extra = json.loads(sys.argv[4])
s = TieredStore.from_config({**config(sys.argv[1]), **extra}, BB)
for i in range(0, n, 64):  # (batches of up to 1 MiB: with copy_threads 0 those take 1 or 2 threads)
    part = KEYS[i:min(n, i + 64)]
    assert s.put(part, blocks_for(part, BB)).stored == len(part)
assert sum(s.tiers[1].contains(KEYS[:n])) == 0  # nothing evicted: on_evict has written nothing yet
if sys.argv[5] == "atexit":  # as an atexit handler or a weakref finalizer (vLLM's in-process engine's) would
    atexit.register(s.close)
elif sys.argv[5] == "sigterm":  # a SIGTERM whose handler raises SystemExit arrives once the SSD took a batch
    def stop(signum, frame):
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    s.add_listener(lambda e: e.kind == "stored" and e.tier == "ssd" and os.kill(os.getpid(), signal.SIGTERM))
    s.close()
else:
    s.close()
"""


def config(ssd: str) -> dict:
    return {"dram_capacity": 64 * BB, "ssd_path": ssd, "ssd_capacity": 1024 * BB, "ssd_segment_bytes": "1MiB"}


def engine(tmp_path, n: int, close_timeout_s: float | None = None, closing: str = "main", **extra) -> str:
    """An engine-like process: puts ``n`` blocks, closes its store (``closing``: "main" on its main thread, or
    "atexit" in an atexit handler, after the main thread ended); its log. ``extra``: more config keys."""
    if close_timeout_s is not None:
        extra["close_timeout_s"] = close_timeout_s  # else the default
    r = subprocess.run([sys.executable, "-c", ENGINE, str(tmp_path / "ssd"), str(n), str(Path(__file__).parent),
                        json.dumps(extra), closing], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stderr


def next_process_finds_on_ssd(tmp_path, n: int) -> None:
    """A new store over the engine's SSD directory serves its first ``n`` blocks, exact, all from the SSD."""
    with TieredStore.from_config(config(str(tmp_path / "ssd")), BB) as s:
        out = torch.zeros(n, BB, dtype=torch.uint8)
        assert_all_hits_exact(s.get(KEYS[:n], out), out, blocks_for(KEYS[:n], BB))
        assert s.stats()["tiers"]["ssd"]["hits"] == n


def test_a_clean_close_writes_drams_blocks_to_the_ssd_and_the_next_process_finds_them(tmp_path):
    log = engine(tmp_path, 48)
    next_process_finds_on_ssd(tmp_path, 48)
    assert "close: wrote 48 DRAM blocks" in log and "to ssd" in log, log


def test_a_close_while_the_interpreter_exits_still_writes_drams_blocks_down(tmp_path):
    """A store closed after the main thread ended (an atexit handler, or a weakref finalizer as vLLM's in-process
    engine's shutdown): concurrent.futures has stopped its pools by then, and the SSD's I/O used to be refused
    ("cannot schedule new futures after interpreter shutdown": 0 of 64 written, one warning). With copy_threads 0,
    so DRAM's 1 MiB copies took 1 or 2 threads by measured rate."""
    log = engine(tmp_path, 64, closing="atexit", copy_threads=0)
    next_process_finds_on_ssd(tmp_path, 64)
    assert "close: wrote 64 DRAM blocks" in log and "runs on the closing thread" in log, log


def test_a_write_down_a_signal_interrupts_says_what_it_lost(tmp_path):
    """A SIGTERM whose handler raises SystemExit (as vLLM's worker's does) stops the write-down after its first
    batch of 256 (write-behind off: the batch is written, and the handler runs, on the closing thread): the log
    says so and how far it got, where it used to say nothing at all; the next process finds exactly those."""
    log = engine(tmp_path, 400, closing="sigterm", dram_capacity=512 * BB, ssd_staging_bytes=0)
    assert "close: writing DRAM's blocks to ssd was interrupted (SystemExit) after 256 of 400" in log, log
    with TieredStore.from_config(config(str(tmp_path / "ssd")), BB) as s:
        assert sum(s.contains(KEYS)) == 256


def test_a_close_bound_that_passes_loses_the_rest_and_says_so(tmp_path):
    log = engine(tmp_path, 48, close_timeout_s=0.0)
    assert "wrote 0 of 48 DRAM blocks" in log and "48 not written" in log, log
    with TieredStore.from_config(config(str(tmp_path / "ssd")), BB) as s:
        assert s.contains(KEYS[:48]) == [False] * 48


def test_write_through_stores_the_whole_batch_on_the_ssd_not_only_what_dram_took(tmp_path):
    cfg = {**config(str(tmp_path / "ssd")), "ssd_offload": "write_through", "dram_capacity": 128 * BB}
    with TieredStore.from_config(cfg, BB) as s:
        r = s.put(KEYS, blocks_for(KEYS, BB))  # 400 blocks into a DRAM of 128
        assert r.stored == 128 and len(r.rejected) == 272
        assert s.flush(30)
        assert s.tiers[1].contains(KEYS) == [True] * 400
        out = torch.zeros(400, BB, dtype=torch.uint8)
        assert_all_hits_exact(s.get(KEYS, out), out, blocks_for(KEYS, BB))  # the DRAM rejects come back from the SSD


def test_blocks_dram_refuses_go_down_as_evictions_would_under_on_evict(tmp_path):
    """DRAM full of pinned blocks: a put it cannot hold goes to the SSD (it would have been evicted at once)."""
    with TieredStore.from_config(config(str(tmp_path / "ssd")), BB) as s:
        s.put(KEYS[:64], blocks_for(KEYS[:64], BB))
        s.pin(KEYS[:64])
        r = s.put(KEYS[64:96], blocks_for(KEYS[64:96], BB))
        assert r.stored == 0 and len(r.rejected) == 32
        assert s.flush(30)
        assert s.tiers[1].contains(KEYS[64:96]) == [True] * 32
        s.unpin(KEYS[:64])
