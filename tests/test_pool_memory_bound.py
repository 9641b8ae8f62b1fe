"""Issue 13 item 2 against a real kvtier-pool: memory beyond the pool's capacity has one budget for all clients.
A client that sends gets and never reads the replies cannot grow the pool (nor starve others, nor keep
SIGTERM from stopping it), and many honest concurrent small getters cost memory sized to their replies."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from attack import RawClient, peak_mib, reset_peak, rss_mib
from bytecheck import assert_all_hits_exact
from kvtier import wire
from kvtier.keys import Namespace
from kvtier.transport import connect
from kvtier.wire import pool as P
from poolproc import PoolProcess

BB = 64 << 10
ns = Namespace("memory-bound")
# The pool's own bound beyond its capacity (docs/reliability.md "Memory"): its memory budget (--staging-bytes, 64 MiB
# here) plus what zmq and the interpreter keep around; RSS beyond it is a leak.
BOUND_MIB = 160
GUARD_MIB = 1500  # stop flooding past this: a broken pool must fail the test, not take the machine down


def rows(a: np.ndarray) -> np.ndarray:
    return np.uint64(a.ctypes.data) + np.arange(a.shape[0], dtype=np.uint64) * np.uint64(a.shape[1])


def stored_pool(tmp_path, n: int = 512):
    p = PoolProcess(tmp_path, capacity="64MiB", block_bytes=BB, args=("--prefault", "--staging-bytes", "64MiB")).start()
    c = connect(p.tcp, BB, transport="tcp", timeout_s=5.0)
    keys = ns.keys(range(n))
    src = np.stack([np.full(BB, i % 251, np.uint8) for i in range(n)])
    assert all(c.put(keys, rows(src)))
    return p, c, keys, src


@pytest.mark.slow  # a memory stress
def test_a_client_that_never_reads_its_replies_cannot_grow_or_stall_the_pool(tmp_path):
    p, engine, keys, src = stored_pool(tmp_path)
    try:
        pid = p.proc.pid
        base = peak = rss_mib(pid)
        host, port = p.tcp[len("tcp://"):].rsplit(":", 1)
        flood = RawClient(f"tcp://127.0.0.2:0;{host}:{port}", sndhwm=0, rcvhwm=1)  # another host than the engine
        sent = 0
        for i in range(20_000):  # one-block gets, never read (a SIGSTOPped or hostile client)
            flood.send(P.GET, {"keys": wire.pack_keys([keys[i % len(keys)]]), "block_bytes": BB})
            sent += 1
            if i % 250 == 0:
                peak = max(peak, rss_mib(pid))
                if peak - base > GUARD_MIB:
                    break
        # Others are served meanwhile, at once: the flood waits its turn, not the other way round.
        out = np.zeros((8, BB), np.uint8)
        t0 = time.monotonic()
        hit = engine.get(keys[:8], rows(out))
        waited = time.monotonic() - t0
        assert_all_hits_exact(hit, out, src[:8])
        assert waited < 2.0, f"an honest get waited {waited:.1f} s behind the flood"
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and peak - base <= GUARD_MIB:
            peak = max(peak, rss_mib(pid))
            time.sleep(0.05)
        print(f"flood: {sent} unread one-block gets; pool RSS {base:.0f} MiB (64 MiB capacity, prefaulted) -> "
              f"peak {peak:.0f} MiB, +{peak - base:.0f} MiB (bound {BOUND_MIB} MiB); honest get {waited * 1e3:.0f} ms")
        assert peak - base < BOUND_MIB, (f"{sent} unread one-block gets grew the pool by {peak - base:.0f} MiB "
                                         f"(bound {BOUND_MIB} MiB)")
        # SIGTERM stops it within a second or two, with the flood's replies still unread.
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        rc = p.proc.wait(30)
        took = time.monotonic() - t0
        print(f"SIGTERM under the flood: exit {rc} after {took:.2f} s")
        assert rc == 0 and took < 2.5, f"SIGTERM took {took:.1f} s under the flood (exit {rc})"
        flood.close()
    finally:
        engine.close()
        p.kill()


def test_many_honest_concurrent_small_gets_cost_memory_sized_to_their_replies(tmp_path):
    p, _, keys, src = stored_pool(tmp_path)
    try:
        pid = p.proc.pid
        base = rss_mib(pid)
        reset_peak(pid)
        errors: list[str] = []

        def getter(i: int) -> None:
            c = connect(p.tcp, BB, transport="tcp", timeout_s=10.0)
            out = np.zeros((1, BB), np.uint8)
            try:
                for j in range(40):
                    k = (i * 40 + j) % len(keys)
                    if c.get([keys[k]], rows(out)) != [True] or not np.array_equal(out[0], src[k]):
                        errors.append(f"getter {i}: block {k} wrong or missing")
            finally:
                c.close()
        threads = [threading.Thread(target=getter, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        grown = peak_mib(pid) - base
        print(f"32 concurrent one-block getters: pool RSS {base:.0f} MiB, peak +{grown:.0f} MiB")
        assert grown < 64, f"32 concurrent one-block getters peaked {grown:.0f} MiB above the pool's RSS"
    finally:
        p.kill()
