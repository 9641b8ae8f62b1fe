"""The DRAM tier and the store with observing policies: observations reach the policy through
TieredStore.observe, admission and the root-first order of a short batch, the guard, and property tests of
the tier's invariants under random traffic (capacity, pins, admission never drops a stored block)."""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pins import PinTable
from kvtier.policies import Arrival, Completion, Hint
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.observations import Observations
from kvtier.store import TieredStore
from kvtier.tiers.dram import DramTier

BB = 64


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def chain(agent: int, n: int) -> list[bytes]:
    return [k(agent * 100_000 + d) for d in range(n)]


def rows(n: int) -> torch.Tensor:
    return torch.zeros(n, BB, dtype=torch.uint8)


def dram(blocks: int, policy: str = "default", clock=None, admission: bool = True, evicted=None) -> DramTier:
    t = DramTier(blocks * BB, BB, policy=policy, clock=clock or Clock(), admission=admission)
    t.attach(PinTable(), (lambda keys, views: evicted.extend(keys)) if evicted is not None else None)
    return t


@pytest.mark.parametrize("policy", ["chain-lru", "pnu"])
def test_short_of_victims_the_tail_most_keys_are_refused_not_the_last_ones(policy):
    """Bug: with every other block pinned, reserve refused the last keys of a batch, which for a tail-first
    put (the replay's order) are the root-most, the ones a next turn needs first."""
    t = dram(6, policy)
    pins = PinTable()
    t.attach(pins, None)
    t.put(chain(9, 3), rows(3))
    pins.pin(chain(9, 3))  # 3 slots left, nothing evictable
    keys = chain(1, 5)
    t.observe(Observations(arrivals=[Arrival("r", keys, 0.0, "A")]))
    held = t.put(keys[::-1], rows(5))  # tail first
    assert held == [False, False, True, True, True]  # positions of the 3 root-most keys in that batch
    assert list(t.contains(keys)) == [True, True, True, False, False]


def test_store_observe_reaches_the_policy_with_sessions_and_times_filled_in():
    clock = Clock()
    clock.t = 42.0
    store = TieredStore([dram(100, clock=clock)], clock=clock)
    seen = []
    policy = store.tiers[0]._policy.policy
    real = policy.observe
    policy.observe = lambda batch: (seen.append(batch), real(batch))
    keys = chain(1, 4)
    store.observe(arrivals=[Arrival("r1", keys)])
    store.observe(completions=[Completion("r1", stop="tool_use")], hints=[Hint(request="r1", subagents=2)])
    store.observe()  # nothing: not forwarded
    assert len(seen) == 2
    a = seen[0].arrivals[0]
    assert a.session is not None and a.time == 42.0 and list(a.keys) == keys
    assert seen[1].completions[0].session == a.session == seen[1].hints[0].session
    lru_store = TieredStore([dram(10, "lru")])
    lru_store.observe(arrivals=[Arrival("r1", keys)])  # a keys-only policy: nothing to forward, no error
    assert lru_store._observers == []


class Broken(LRUPolicy):
    name = "broken"
    observes = True

    def insert(self, keys):
        raise ValueError("insert bug")


def test_a_policy_that_raises_never_fails_a_put_or_get(caplog):
    store = TieredStore([DramTier(4 * BB, BB, policy=f"{__name__}:Broken")])
    with caplog.at_level(logging.ERROR):
        for i in range(10):
            assert store.put(chain(i, 2), rows(2)).stored == 2
            store.observe(arrivals=[Arrival(str(i), chain(i, 2))])
    out = rows(2)
    assert store.get(chain(9, 2), out) == [True, True]
    assert store.tiers[0].stats().blocks == 4
    assert "insert bug" in store.stats()["tiers"]["dram"]["extra"]["policy_failed"]
    assert sum("raised in insert" in r.getMessage() for r in caplog.records) == 1


# ---- invariants of the tier under random traffic ----------------------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["turn", "turn", "put", "get", "pin", "unpin", "remove", "done", "tick"]),
                         st.integers(0, 6), st.integers(1, 14), st.booleans()), max_size=60)


@pytest.mark.parametrize("policy", ["pnu", "chain-lru", "lru", "s3fifo", "arc"])
@settings(max_examples=120, deadline=None)
@given(ops=OPS, capacity=st.integers(4, 24))
def test_tier_invariants(policy, ops, capacity):
    """Capacity never exceeded; a pinned block is never evicted; a put drops no block it did not report
    evicted (admission only decides about new blocks); every block is evictable once nothing is pinned."""
    clock = Clock()
    evicted: list[bytes] = []
    t = dram(capacity, policy, clock=clock, evicted=evicted)
    pins = PinTable()
    t.attach(pins, lambda keys, views: evicted.extend(keys))
    pinned: dict[bytes, int] = {}
    reqs: dict[int, str] = {}
    for n_op, (op, agent, n, flag) in enumerate(ops):
        keys = chain(agent, n)
        before = {x for x in keys + [y for a in range(7) for y in chain(a, 14)] if t.contains([x])[0]}
        evicted.clear()
        if op in ("turn", "put"):
            if op == "turn":
                reqs[agent] = f"{agent}.{n_op}"
                t.observe(Observations(arrivals=[Arrival(reqs[agent], keys, clock.t, f"s{agent}")]))
            held = t.put(keys[::-1] if flag else keys, rows(n))
            assert all(h for x, h in zip(keys[::-1] if flag else keys, held) if x in before)
        elif op == "get":
            t.get(keys, rows(n))
        elif op == "pin":
            for x in keys[:3]:
                if t.contains([x])[0]:
                    pins.pin([x])
                    pinned[x] = pinned.get(x, 0) + 1
        elif op == "unpin":
            for x in list(pinned)[:3]:
                pins.unpin([x])
                pinned[x] -= 1
                if not pinned[x]:
                    del pinned[x]
        elif op == "remove":
            t.remove(keys[-2:])
            before -= set(keys[-2:])
        elif op == "done" and agent in reqs:
            t.observe(Observations(completions=[Completion(reqs[agent], clock.t, "tool_use" if flag else "end_turn",
                                                           session=f"s{agent}")]))
        else:
            clock.t += 7.0 if flag else 400.0
        after = {x for x in before if t.contains([x])[0]}
        assert before - after <= set(evicted), "a block vanished without an eviction"
        assert not set(evicted) & set(pinned), "a pinned block was evicted"
        st_ = t.stats()
        assert st_.blocks <= capacity and st_.used_bytes <= capacity * BB
        assert len(t._policy) == st_.blocks
    for x, c in list(pinned.items()):
        pins.unpin([x] * c)
    held = st_.blocks if ops else 0
    assert len(t._policy.victims(capacity + 1, set())) == held  # every tracked key evictable


def test_a_flood_of_sessions_keeps_the_store_bounded():
    """20,000 agents that each come once (a million would take minutes here; the bounds are the same code)."""
    clock = Clock()
    store = TieredStore([dram(512, clock=clock)], clock=clock)
    store.sessions.max_agents = store.sessions.max_requests = 1000
    policy = store.tiers[0]._policy.policy
    policy.max_agents = 800
    for a in range(20_000):
        clock.t += 0.01
        keys = chain(a, 3)
        store.observe(arrivals=[Arrival(f"r{a}", keys, session=None if a % 2 else f"client-{a}")])
        if a % 10 == 0:
            store.put(keys, rows(3))
        store.observe(completions=[Completion(f"r{a}", stop="end_turn")])
    assert len(store.sessions) <= 1000 and store.sessions.requests <= 1000
    assert policy.agents() <= 800 and policy.pending() <= policy.max_pending
    assert len(policy._requests) <= policy.max_requests and len(policy.model._pending) <= policy.model.max_pending
    assert store.tiers[0].stats().blocks == 512 == len(policy)


def test_the_ssd_tier_learns_the_same_observations(tmp_path):
    """DRAM and the SSD under it both get the store's observations (the replay shows the SSD gains from them:
    docs/eviction.md, Eviction policies); an SSD policy that ignores them gets none."""
    clock = Clock()
    cfg = {"dram_capacity": 8 * BB, "ssd_path": str(tmp_path / "a"), "ssd_capacity": 64 * 4096, "ssd_direct_io": "false",
           "ssd_fsync": False, "ssd_staging_bytes": 0}
    store = TieredStore.from_config(cfg, BB, clock=clock)
    lru_ssd = TieredStore.from_config({**cfg, "ssd_path": str(tmp_path / "b"), "ssd_eviction": "lru"}, BB, clock=clock)
    try:
        assert [t.name for t in store._observers] == ["dram", "ssd"]
        assert [t.name for t in lru_ssd._observers] == ["dram"]
        ssd_policy = store.tiers[1]._policy.policy
        keys = chain(1, 20)
        clock.t = 5.0
        store.observe(arrivals=[Arrival("r", keys, session="A")])
        for lo, hi in ((0, 8), (8, 16), (16, 20)):  # DRAM holds 8: what it evicts goes to the SSD (on_evict)
            store.put(keys[lo:hi], rows(hi - lo))
        assert len(ssd_policy) == 12 and ssd_policy.agents() == 1
        assert not ssd_policy._unknown(), "every block the SSD took is known as agent A's, at its depth"
        assert sum(store.contains(keys)) == 20
    finally:
        store.close()
        lru_ssd.close()


class BadAdmission(LRUPolicy):
    name = "bad-admission"

    def admit(self, keys, free):
        return [0, 0, 99]  # repeats a position, names one out of range


def test_a_policy_answering_nonsense_to_admit_stores_the_batch(caplog):
    t = DramTier(4 * BB, BB, policy=f"{__name__}:BadAdmission")
    t.attach(PinTable(), None)
    t.put(chain(1, 4), rows(4))
    with caplog.at_level(logging.ERROR):
        assert t.put(chain(2, 3), rows(3)) == [True] * 3  # full tier: admit is asked, its answer ignored
        t.put(chain(3, 2), rows(2))
    assert sum("storing whole batches" in r.getMessage() for r in caplog.records) == 1
    assert t.stats().blocks == 4


def test_store_stats_report_what_was_observed():
    store = TieredStore([dram(16)])
    store.observe(arrivals=[Arrival("a1", chain(1, 3), session="agent-9")])
    store.observe(arrivals=[Arrival("a2", chain(1, 5), session="agent-9"), Arrival("b1", chain(2, 2))],
                  completions=[Completion("a1", stop="tool_use")])
    obs = store.stats()["observations"]
    assert (obs["arrivals"], obs["completions"], obs["hints"]) == (3, 1, 0)
    assert obs["sessions"] == {"agent-9": {"turns": 2, "branch": "agent-9"}} and obs["agents"] == 2
