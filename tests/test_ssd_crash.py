"""kill -9 a process writing to the SSD tier at random moments; after each restart every block served must be
bit-exact and every acknowledged write must be there. The default suite kills a few times; the slow suite 25.
"""

import multiprocessing
import random
import time

import numpy as np
import pytest

import ssd_crash_writer as w
from bytecheck import check_rows


@pytest.fixture(scope="module")
def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["ssd_crash_writer", "kvtier.tiers.ssd"])
    return ctx


def _acknowledged(ack_path) -> list[int]:
    """Keys the writer's last put stored (and no later remove dropped): they must survive the kill."""
    last_put: list[int] = []
    for line in open(ack_path).read().splitlines()[1:]:
        op, _, rest = line.partition(" ")
        idx = [int(x) for x in rest.split()]
        last_put = idx if op == "put" else [i for i in last_put if i not in idx]
    return last_put


def crash_loop(ctx, path, kills, seed):
    rng = random.Random(seed)
    keys = w.keys()
    served_total = 0
    caught: dict[str, int] = {}  # torn or unindexed blocks found at reopen: misses, as they must be
    for n in range(kills):
        ack = path / f"ack-{n}"
        p = ctx.Process(target=w.run, args=(str(path / "tier"), str(ack), rng.randrange(1 << 30)))
        p.start()
        deadline = time.monotonic() + 30
        while not (ack.exists() and ack.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.4))  # kill somewhere in the middle of puts, fsyncs, index commits
        p.kill()  # SIGKILL
        p.join(10)
        assert p.exitcode == -9, f"writer {n} ended on its own with {p.exitcode} before it was killed"
        must = _acknowledged(ack)
        t = w.open_tier(str(path / "tier"))
        try:
            out = np.zeros((w.UNIVERSE, w.BLOCK), np.uint8)
            hit = t.get(keys, out)
            want = np.frombuffer(b"".join(w.block_bytes_for(k) for k in keys), np.uint8).reshape(w.UNIVERSE, w.BLOCK)
            got = check_rows(hit, out, want)
            assert not got.wrong, f"kill {n}: wrong bytes served: {got}"
            missing = [i for i in must if not hit[i]]
            assert not missing, f"kill {n}: acknowledged blocks {missing} lost"
            served_total += sum(hit)
            for name, n in t.stats().extra.items():
                if name.startswith("dropped_at_open") or name == "checksum_failures":
                    caught[name] = caught.get(name, 0) + n
        finally:
            t.close()
    assert served_total > 0  # the check above ran on real blocks
    print(f"{kills} kills: {served_total} blocks served bit-exact after restarts; caught as misses: {caught}")


def test_kill_9_while_writing_never_serves_wrong_bytes(tmp_path, forkserver):
    crash_loop(forkserver, tmp_path, kills=5, seed=1)


@pytest.mark.slow
def test_kill_9_while_writing_25_times(tmp_path, forkserver):
    crash_loop(forkserver, tmp_path, kills=25, seed=2)
