"""kvtier.backoff.Backoff, the one back-off of the client (pool endpoints, kvtier-master, master failover), and
its three users, driven by an injected clock: no sleeps, nothing here depends on the machine's speed."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.backoff import Backoff
from kvtier.client import MasterTimeout
from kvtier.client.master import Failover
from kvtier.tiers.pool import BACKOFF_S, PoolTier
from kvtier.tiers.pool_route import MasterBackoff, PeerRoute
from kvtier.transport.base import PoolUnavailable


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def test_backoff_doubles_caps_and_an_answer_resets_it():
    clock = FakeClock()
    b = Backoff(0.5, 2.0, clock=clock)
    assert b.up() and not b.failing and b.left_s() == 0
    assert b.failed() is True  # the first failure: the caller logs "down" once
    lengths = [b.current_s]
    for _ in range(3):
        assert not b.up() and b.left_s() == pytest.approx(b.current_s)
        clock.advance(b.current_s - 0.001)
        assert not b.up()  # not a moment early
        clock.advance(0.001)
        assert b.up() and b.failing  # run out, but no answer yet
        assert b.failed() is False  # still failing: not logged again
        lengths.append(b.current_s)
    assert lengths == [0.5, 1.0, 2.0, 2.0]
    assert b.answered() is True and b.answered() is False  # the change to "answering" is reported once
    assert b.up() and b.current_s == 0 and b.down_until == 0
    b.failed()
    assert b.current_s == 0.5  # the answer reset the length


def test_a_hold_is_fixed_and_leaves_the_doubling_alone():
    clock = FakeClock()
    b = Backoff(0.5, 10.0, clock=clock)
    b.failed()
    b.failed(hold_s=60.0)
    assert b.current_s == 60.0 and b.left_s() == 60.0
    clock.advance(60.0)
    b.failed()
    assert b.current_s == 1.0  # the doubling went on from the last doubling failure


@pytest.mark.parametrize("first,most", [(0, 1), (-1, 1), (2, 1)])
def test_bad_lengths_are_refused(first, most):
    with pytest.raises(ValueError, match="first_s <= max_s"):
        Backoff(first, most)


@given(st.lists(st.sampled_from(["fail", "answer", "wait"]), max_size=40),
       st.floats(0.01, 5), st.floats(1, 8))
def test_length_stays_between_first_and_max(ops, first, factor):
    clock = FakeClock()
    b = Backoff(first, first * factor, clock=clock)
    for op in ops:
        if op == "fail":
            b.failed()
            assert first <= b.current_s <= first * factor and not b.up()
        elif op == "answer":
            b.answered()
            assert b.up() and not b.failing
        else:
            clock.advance(b.left_s())
            assert b.up()


# ---- its users ------------------------------------------------------------------------------------------------


def _dead():
    raise MasterTimeout("timeout", "no reply")


def test_master_backoff_reads_the_injected_clock():
    clock = FakeClock()
    calls: list[int] = []
    b = MasterBackoff("tcp://nowhere:1", first_s=0.5, max_s=2.0, clock=clock)

    def dead():
        calls.append(1)
        _dead()

    for want in (0.5, 1.0, 2.0, 2.0):
        with pytest.raises(PoolUnavailable) as first:
            b.call(dead, "locate")
        assert first.value.code == "master" and b.stats()["backoff_s"] == want
        clock.advance(want - 0.01)
        with pytest.raises(PoolUnavailable) as skipped:  # inside the back-off: fails without calling
            b.call(dead, "locate")
        assert skipped.value.code == "backoff" and b.stats()["backoff_left_s"] == pytest.approx(0.01)
        clock.advance(0.01)
    assert len(calls) == 4 and b.stats()["skipped"] == 4
    assert b.call(lambda: "ok", "locate") == "ok" and b.stats()["up"] and b.stats()["backoff_s"] == 0


def test_failover_orders_masters_by_their_backoff_on_the_injected_clock():
    clock = FakeClock()
    f = Failover(["a", "b", "c"], backoff_s=(1.0, 4.0), clock=clock)
    assert f.order() == [0, 1, 2]
    f.failed(0)
    assert f.order() == [1, 2]
    f.failed(1)
    f.failed(2)
    clock.advance(0.5)
    assert f.order() == [0]  # all in a back-off: the one whose back-off ends first
    clock.advance(0.5)
    assert f.order() == [0, 1, 2]
    f.failed(0)  # its second failure: 2 s
    clock.advance(1.0)
    assert f.order() == [1, 2]
    f.answered(1, first=1)
    assert f.order()[0] == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pool_endpoint_backoff_reads_the_injected_clock():
    # A real PoolTier against a port nothing listens on (connect is refused at once): its endpoint's back-off
    # runs on the test's clock, so "skipped while in its back-off" and "asked again after it" need no sleep.
    clock = FakeClock()
    endpoint = f"tcp://127.0.0.1:{_closed_port()}"
    tier = PoolTier(4096, PeerRoute([endpoint]), transport="stream", timeout_s=0.5, staging_bytes=0, clock=clock)
    try:
        def health():
            return tier.stats().extra["pools"][endpoint]

        assert tier.contains([b"k" * 16]) == [False]  # refused: the pool goes into its back-off
        first = tier._pools[endpoint].health
        assert not health()["up"] and first.current_s == BACKOFF_S[0]
        error = health()["last_error"]
        clock.advance(BACKOFF_S[0] - 0.01)
        assert tier.contains([b"k" * 16]) == [False]  # skipped: not asked, the back-off did not move
        assert first.current_s == BACKOFF_S[0] and "skipped" not in error
        clock.advance(0.01)
        assert health()["up"]
        assert tier.contains([b"k" * 16]) == [False]  # asked again, refused again: twice as long
        assert not health()["up"] and first.current_s == 2 * BACKOFF_S[0]
    finally:
        tier.close()


# ---- one call's walk over the masters (kvtier/client/failover.py), shared by both clients --------------------


def test_a_failover_call_goes_on_after_a_timeout_and_stops_at_an_error_every_master_gives():
    from kvtier import wire
    from kvtier.client.failover import FailoverCall, MasterError, MasterTimeout

    clock = [0.0]
    failover = Failover(["tcp://a:1", "tcp://b:2"], clock=lambda: clock[0])
    call = FailoverCall(failover, "lookup")
    assert call.order == [0, 1]
    assert call.settle(0, MasterTimeout("timeout", "a silent")) is None  # the next master may serve it
    assert call.settle(1, (True, {"hits": []})) == {"hits": []}
    assert failover.preferred == 1 and failover.failovers == 1
    call = FailoverCall(failover, "lookup")
    with pytest.raises(MasterError, match="bad keys"):  # another master would refuse it too
        call.settle(1, (False, {"code": wire.ERR_BAD_REQUEST, "message": "bad keys"}))
    assert FailoverCall(failover, "pin").order == [1], "a is in its back-off"
    clock[0] = 100.0  # past a's back-off
    call = FailoverCall(failover, "pin")
    assert call.order == [1, 0]
    for i in call.order:
        assert call.settle(i, (False, {"code": wire.ERR_UNAVAILABLE, "message": "read-only"})) is None
    e = call.exhausted()
    assert e.code == wire.ERR_UNAVAILABLE and "pin: no master served it" in e.message
