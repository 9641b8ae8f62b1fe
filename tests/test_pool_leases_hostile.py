"""Issue 13 items 1 and 5 against a real kvtier-pool: a stranger on the pool's control port cannot act on
another client's leases (release them to slip its own bytes under that client's get, or commit a reservation
before its bytes are written), a one-sided get whose slot was given to another key mid-copy is a miss (the
slot's generation, read after the copy), and a client reserving in a loop cannot evict what others stored."""

from __future__ import annotations

import time

import numpy as np
import pytest

from attack import RawClient
from bytecheck import assert_all_hits_exact
from kvtier import wire
from kvtier.keys import Namespace
from kvtier.transport import connect
from kvtier.wire import pool as P
from poolproc import PoolProcess

BB = 64 << 10
ns = Namespace("hostile-leases")


def rows(a: np.ndarray) -> np.ndarray:
    return np.uint64(a.ctypes.data) + np.arange(a.shape[0], dtype=np.uint64) * np.uint64(a.shape[1])


def filled(n: int, value: int) -> np.ndarray:
    return np.full((n, BB), value, np.uint8)


def on_reply(conn, op: str, attack) -> None:
    """Run ``attack(reply body)`` when ``conn`` gets its reply to ``op``, before it copies (once)."""
    handle = conn.channel._handle
    done = []

    def hooked(req, ok, body, data, peer):
        if req.op == op and not done:
            done.append(True)
            attack(body)
        return handle(req, ok, body, data, peer)
    conn.channel._handle = hooked


def stranger_on(endpoint: str) -> tuple[RawClient, dict]:
    """A raw client that said hello: its own session token (what a lease op must carry), as a dict to splat."""
    s = RawClient(endpoint)
    ok, body, _ = s.call(P.HELLO, {"block_bytes": BB})
    assert ok
    return s, ({"session": body["session"]} if "session" in body else {})


def body_for(keys, **extra) -> dict:
    return {"keys": wire.pack_keys(keys), "block_bytes": BB, **extra}


def test_a_stranger_cannot_release_a_lease_and_slip_its_bytes_under_anothers_get(tmp_path):
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity=str(BB), block_bytes=BB) as p:
        victim = connect(p.ipc, BB, timeout_s=5.0)
        stranger, session = stranger_on(p.ipc)
        x, y = ns.keys([1, 2])
        mine = filled(1, 0xAA)
        assert victim.put([x], rows(mine)) == [True]
        victim.locations.forget_all()  # the get acquires (a read where the put left x: test_pool_locations.py)
        seen = {}

        def attack(body):  # the stranger knows the lease number (guessed or seen): release, remove, refill
            ok, r, _ = stranger.call(P.RELEASE, {"leases": [body["lease"]], **session})
            seen["release"] = r.get("valid")
            stranger.call(P.REMOVE, body_for([x]))
            seen["put"] = stranger.call(P.PUT, body_for([y]), (b"\xbb" * BB,))[1].get("held")
        on_reply(victim, P.ACQUIRE, attack)
        out = filled(1, 0)
        hit = victim.get([x], rows(out))
        assert not hit[0] or (out == 0xAA).all(), "a hit carrying the stranger's bytes"
        assert seen["release"] is False  # the lease is the victim's: the stranger's release acts on nothing
        assert hit == [True]  # so the slot stayed the victim's until its own release
        stranger.close()
        victim.close()


def test_a_get_whose_slot_was_refilled_mid_copy_is_a_miss_by_its_generation(tmp_path):
    """Even a release the pool accepts (here: sent with the victim's own session from its own process, as a
    bug in the client could) cannot make a get return another key's bytes: the get reads its slot's
    generation after the copy and counts a changed one as a miss."""
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity=str(BB), block_bytes=BB) as p:
        victim = connect(p.ipc, BB, timeout_s=5.0)
        stranger, _ = stranger_on(p.ipc)
        x, y = ns.keys([3, 4])
        mine = filled(1, 0xAA)
        assert victim.put([x], rows(mine)) == [True]
        victim.locations.forget_all()  # the get acquires (a read where the put left x: test_pool_locations.py)
        own = {"session": victim.session} if getattr(victim, "session", None) else {}

        def attack(body):
            stranger.call(P.RELEASE, {"leases": [body["lease"]], **own})
            stranger.call(P.REMOVE, body_for([x]))
            stranger.call(P.PUT, body_for([y]), (b"\xbb" * BB,))
        on_reply(victim, P.ACQUIRE, attack)
        out = filled(1, 0)
        hit = victim.get([x], rows(out))
        assert not hit[0] or (out == 0xAA).all(), "a hit carrying another key's bytes"
        assert hit == [False] and not out.any()  # a miss, its row zeroed
        stranger.close()
        victim.close()


def test_a_stranger_cannot_commit_anothers_reservation_before_its_bytes_are_written(tmp_path):
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity=str(8 * BB), block_bytes=BB) as p:
        writer = connect(p.ipc, BB, timeout_s=5.0)
        reader = connect(p.ipc, BB, timeout_s=5.0)
        stranger, session = stranger_on(p.ipc)
        x = ns.keys([5])[0]
        early: dict = {}

        def attack(body):  # publish the writer's slots now, and read them at once
            ok, r, _ = stranger.call(P.COMMIT, {"leases": [body["lease"]], "oks": [True], **session})
            early["valid"] = r.get("valid")
            out = filled(1, 0x55)
            early["hit"] = reader.get([x], rows(out))
            early["right"] = bool((out == 0xAA).all())
        on_reply(writer, P.RESERVE, attack)
        src = filled(1, 0xAA)
        stored = writer.put([x], rows(src))
        assert not early["hit"][0] or early["right"], "a reader saw the key before its bytes were written"
        assert early["valid"] == [False]  # the reservation is the writer's: the stranger's commit acts on nothing
        assert stored == [True]
        out = filled(1, 0)
        assert_all_hits_exact(reader.get([x], rows(out)), out, 0xAA)
        for c in (writer, reader, stranger):
            c.close()


def test_lease_numbers_say_nothing_about_the_next_one(tmp_path):
    with PoolProcess(tmp_path, ipc=True, tcp=False, capacity=str(8 * BB), block_bytes=BB) as p:
        s, session = stranger_on(p.ipc)
        keys = ns.keys(range(10, 14))
        leases = [s.call(P.RESERVE, body_for([k], **session))[1]["lease"] for k in keys]
        assert len(set(leases)) == 4 and all(0 < x < 1 << 62 for x in leases)
        assert all(abs(a - b) > 1 << 20 for a, b in zip(leases, leases[1:]))  # not a counter
        s.close()


def test_a_tcp_client_reserving_in_a_loop_cannot_evict_what_others_stored(tmp_path):
    """Reservations are held for a lease and its quarantine: without a quota, a stranger reserving the whole
    pool again and again keeps it empty. Each client's reservations are capped, and all of them together."""
    with PoolProcess(tmp_path, capacity=str(64 * BB), block_bytes=BB, lease_s=30.0) as p:
        engine = connect(p.tcp, BB, transport="tcp", timeout_s=5.0)
        kept = ns.keys(range(100, 148))
        src = np.stack([filled(1, i)[0] for i in range(48)])
        assert all(engine.put(kept, rows(src)))
        stranger, session = stranger_on(p.tcp)
        refused = 0
        for i in range(20):
            ok, body, _ = stranger.call(P.RESERVE, body_for(ns.keys(range(1000 + 64 * i, 1064 + 64 * i)), **session))
            refused += not ok or not all(P.unbitmap(body["held"], 64))
        held = engine.contains(kept)
        assert sum(held) == 48, f"{48 - sum(held)} of 48 stored blocks evicted by another client's reservations"
        assert refused == 20  # every reserve past the quota was cut short (reported not held), none hung
        stats = engine.stats()
        assert stats["counters"].get("quota_refused_blocks", 0) > 0
        stranger.close()
        engine.close()


@pytest.mark.parametrize("op", [P.ACQUIRE])
def test_acquire_leases_are_capped_per_client_too(tmp_path, op):
    """Acquired blocks cannot be evicted until released: a client acquiring everything in a loop would make
    every put fail for a lease. Past its quota an acquire answers misses."""
    with PoolProcess(tmp_path, capacity=str(64 * BB), block_bytes=BB) as p:
        engine = connect(p.tcp, BB, transport="tcp", timeout_s=5.0)
        keys = ns.keys(range(200, 264))
        src = filled(64, 7)
        assert all(engine.put(keys, rows(src)))
        stranger, session = stranger_on(p.tcp)
        for _ in range(10):
            stranger.call(op, body_for(keys, **session))
        fresh = ns.keys(range(300, 332))
        more = filled(32, 9)
        t0 = time.monotonic()
        assert sum(engine.put(fresh, rows(more))) >= 16  # slots the stranger could not pin are evicted for these
        assert time.monotonic() - t0 < 5.0
        stranger.close()
        engine.close()


def test_a_client_taking_one_block_leases_in_a_loop_holds_at_most_its_count_of_them(tmp_path):
    """Within its byte quota (a quarter of a 1 GiB pool: 65,536 blocks of 4 KiB) a client acquiring one block
    in a loop would fill the lease table with entries; it holds at most 1,024 leases at once."""
    bb = 4096
    with PoolProcess(tmp_path, capacity="1GiB", block_bytes=bb) as p:
        s = RawClient(p.tcp)
        ok, hello, _ = s.call(P.HELLO, {"block_bytes": bb})
        session = {"session": hello["session"]} if "session" in hello else {}
        key = ns.keys([900])
        s.call(P.PUT, {"keys": wire.pack_keys(key), "block_bytes": bb}, (b"\x01" * bb,))
        granted = 0
        for _ in range(1500):
            ok, body, _ = s.call(P.ACQUIRE, {"keys": wire.pack_keys(key), "block_bytes": bb, **session})
            granted += bool(ok and body.get("lease"))
        leases = s.call(P.STATS, {})[1]["leases"]
        assert leases <= 1024 and granted <= 1024, (leases, granted)
        s.close()
