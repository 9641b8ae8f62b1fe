"""kill -9 an engine in the middle of its clean shutdown's write-down of DRAM to the SSD (TieredStore.close):
the SSD it leaves opens without error, and every block it lists is served, bit-exact, as its key's bytes
(a block listed but unreadable, or read as a miss, fails the test as much as a wrong byte would).

The engine is a real process (tests/shutdown_writer.py, forked from a forkserver with kvtier imported); each
kill point is a delay after the engine says its close began, searched between "nothing written yet" and "the
close finished", so kills land while batches are being written, synced and indexed. The default suite kills a
few times; the slow suite more.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
from dataclasses import dataclass

import pytest
import torch

import shutdown_writer as w
from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import TieredStore


@pytest.fixture(scope="module")
def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["shutdown_writer"])  # (ignored if another module started the server already)
    return ctx


@dataclass
class Outcome:
    killed: bool  # False: the close finished before the kill
    listed: int  # blocks the reopened SSD lists, each checked bit-exact


def shutdown_and_kill(ctx, ssd: str, delay: float | None) -> tuple[bool, float]:
    """Run an engine until ``delay`` s into its close, then SIGKILL it (None: let the close finish). Returns
    (killed, how long the close took when it finished, else ``delay``)."""
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=w.engine, args=(ssd, send))
    p.start()
    send.close()
    try:
        assert recv.poll(120), "the engine never started its close"
        assert recv.recv() == "closing"
        if delay is not None and not recv.poll(delay):
            p.kill()  # SIGKILL, somewhere in the write-down
            p.join(30)
            assert p.exitcode == -9, f"the engine ended with {p.exitcode} instead of being killed"
            return True, delay
        assert recv.poll(120), "the close never finished"
        took = recv.recv()
        p.join(30)
        assert p.exitcode == 0, f"the engine failed after its close: exit code {p.exitcode}"
        return False, took
    finally:
        if p.is_alive():
            p.kill()
            p.join(30)
        recv.close()


def check_ssd(ssd: str, caplog) -> int:
    """Open the SSD a killed engine left and check it: no error at open, nothing dropped as invalid, and every
    block it lists is its key's bytes. Returns how many it lists."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        store = TieredStore.from_config(w.config(ssd), w.BB)
    try:
        problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not problems, f"the SSD did not open cleanly: {problems}"
        disk = store.tiers[1]
        listed = disk.keys()
        strangers = set(listed) - set(w.KEYS)
        assert not strangers, f"the SSD lists {len(strangers)} keys the engine never put"
        out = torch.zeros(len(listed), w.BB, dtype=torch.uint8)
        assert_all_hits_exact(disk.get(listed, out), out, blocks_for(listed, w.BB))
        extra = disk.stats().extra
        dropped = {k: n for k, n in extra.items() if k.startswith("dropped_at_open") and n}
        assert not dropped and not extra.get("checksum_failures"), \
            f"entries on disk that do not hold their key's bytes: {dropped}, checksum failures " \
            f"{extra.get('checksum_failures')}"
        return len(listed)
    finally:
        store.close()


def kill_during_write_down(ctx, tmp_path, caplog, kills: int, seed: int) -> list[Outcome]:
    """Calibrate with one close left to finish, then ``kills`` kills at delays searched inside the write-down:
    a kill that found nothing written moves the next ones later, one after the close moves them earlier."""
    killed, took = shutdown_and_kill(ctx, str(tmp_path / "calibrate"), None)
    assert not killed and check_ssd(str(tmp_path / "calibrate"), caplog) == w.BLOCKS  # a finished close: all down
    rng = random.Random(seed)
    lo, hi = 0.0, took
    outcomes = []
    for n in range(kills):
        ssd = str(tmp_path / f"kill-{n}")
        delay = rng.uniform(lo, hi)
        killed, _ = shutdown_and_kill(ctx, ssd, delay)
        listed = check_ssd(ssd, caplog)
        assert killed or listed == w.BLOCKS, f"a finished close left {listed} of {w.BLOCKS} blocks on the SSD"
        outcomes.append(Outcome(killed, listed))
        if listed == w.BLOCKS:
            hi = delay
        elif listed == 0:
            lo = delay
    mid = [o for o in outcomes if o.killed and 0 < o.listed < w.BLOCKS]
    assert mid, f"no kill landed inside the write-down (close took {took:.3g} s): {outcomes}"
    print(f"{kills} kills in a {took:.3g} s write-down; blocks listed (all bit-exact) after each: "
          f"{[o.listed for o in outcomes]}")
    return outcomes


def test_kill_9_during_the_shutdown_write_down_leaves_a_consistent_ssd(tmp_path, forkserver, caplog):
    kill_during_write_down(forkserver, tmp_path, caplog, kills=4, seed=1)


@pytest.mark.slow
def test_kill_9_during_the_shutdown_write_down_20_times(tmp_path, forkserver, caplog):
    kill_during_write_down(forkserver, tmp_path, caplog, kills=20, seed=2)
