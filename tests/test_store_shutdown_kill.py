"""kill -9 an engine in the middle of its clean shutdown's write-down of DRAM to the SSD (TieredStore.close):
the SSD it leaves opens without error, and every block it lists is served, bit-exact, as its key's bytes
(a block listed but unreadable, or read as a miss, fails the test as much as a wrong byte would).

The engine is a real process (tests/shutdown_writer.py, forked from a forkserver with kvtier imported). Kill
points: exactly after the engine's n-th index commit or n-th segment write of the close (it freezes there and
says so: the moments where a write order decides what the SSD lists), and delays after its close began, searched
between "nothing written yet" and "the close finished". The default suite kills at a few exact points; the slow
suite after every batch and at 20 searched delays.
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


def shutdown_and_kill(ctx, ssd: str, delay: float | None = None, stop: tuple[str, int] | None = None
                      ) -> tuple[bool, float]:
    """Run an engine until ``delay`` s into its close, or until it froze at ``stop`` (shutdown_writer.freeze_after),
    then SIGKILL it (neither: let the close finish). Returns (killed, how long the close took if it finished)."""
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=w.engine, args=(ssd, send, stop))
    p.start()
    send.close()
    try:
        assert recv.poll(120), "the engine never started its close"
        assert recv.recv() == "closing"
        if stop is not None:
            assert recv.poll(120), "the engine neither froze nor finished"
            said = recv.recv()
            assert said == ("frozen", *stop), f"the close ended before {stop} ({said})"
        elif delay is not None and not recv.poll(delay):
            pass  # still closing after the delay
        else:
            assert recv.poll(120), "the close never finished"
            took = recv.recv()
            p.join(30)
            assert p.exitcode == 0, f"the engine failed after its close: exit code {p.exitcode}"
            return False, took
        p.kill()  # SIGKILL, in the middle of the write-down
        p.join(30)
        if p.exitcode == 0 and stop is None:
            # The close finished between the poll's timeout and the kill: a close that was not killed (the caller
            # then requires every block on the SSD), not a failure.
            return False, 0.0
        assert p.exitcode == -9, f"the engine ended with {p.exitcode} instead of being killed"
        return True, 0.0
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


def kill_at_stops(ctx, tmp_path, caplog, stops: list[tuple[str, int]]) -> list[int]:
    """A kill right after each ``stop``; the blocks the SSD lists after each (all checked bit-exact)."""
    listed = []
    for what, n in stops:
        ssd = str(tmp_path / f"{what}-{n}")
        assert shutdown_and_kill(ctx, ssd, stop=(what, n))[0]
        listed.append(check_ssd(ssd, caplog))
        assert 0 < listed[-1] < w.BLOCKS or (what, n) == ("data", 1), \
            f"killed after {what} write {n}: {listed[-1]} of {w.BLOCKS} blocks listed, not part of them"
    print(f"blocks listed (all bit-exact) after kills at {stops}: {listed}")
    return listed


def kill_during_write_down(ctx, tmp_path, caplog, kills: int, seed: int) -> list[Outcome]:
    """Calibrate with one close left to finish, then ``kills`` kills at delays searched inside the write-down:
    a kill that found nothing written moves the next ones later, one after the close moves them earlier."""
    killed, took = shutdown_and_kill(ctx, str(tmp_path / "calibrate"))
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


def test_kill_9_right_after_an_index_commit_or_a_data_write_of_the_write_down_leaves_a_consistent_ssd(
        tmp_path, forkserver, caplog):
    kill_at_stops(forkserver, tmp_path, caplog, [("index", 1), ("data", 3), ("index", 6), ("data", 12)])


@pytest.mark.slow
def test_kill_9_after_every_batch_of_the_write_down(tmp_path, forkserver, caplog):
    batches = w.BLOCKS // w.STAGED_BLOCKS  # at least this many commits: write-behind batches hold at most staging
    kill_at_stops(forkserver, tmp_path, caplog, [(what, n) for n in range(1, batches) for what in ("index", "data")])


@pytest.mark.slow
def test_kill_9_during_the_shutdown_write_down_at_20_searched_delays(tmp_path, forkserver, caplog):
    kill_during_write_down(forkserver, tmp_path, caplog, kills=20, seed=2)
