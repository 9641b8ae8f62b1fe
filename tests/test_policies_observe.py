"""Policies that learn from observations (pnu, chain-lru), the session tracker, the guard and the registry's
``default``: behaviour on hand-made agent loops and property tests for the invariants (bounded memory, every
key evictable, batch order irrelevant, LRU without observations)."""

import logging
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies import Arrival, Completion, Hint, Observations, known_policies, make_policy, policy_class
from kvtier.policies.guard import GuardedPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.pnu import PredictedNextUse
from kvtier.policies.samples import Samples
from kvtier.policies.sessions import SessionTracker


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def chain(agent: int, n: int) -> list[bytes]:
    """Agent ``agent``'s chain of n blocks (keys distinct across agents)."""
    return [k(agent * 100_000 + d) for d in range(n)]


def arrive(p, request: str, session: str, keys, t: float) -> None:
    p.observe(Observations(arrivals=[Arrival(request, keys, t, session)]))


def complete(p, request: str, stop: str, t: float, session: str | None = None) -> None:
    p.observe(Observations(completions=[Completion(request, t, stop, session=session)]))


def turn(p, clock, request: str, session: str, keys, stop: str, took: float = 1.0) -> None:
    """One request of an agent: arrival, its new blocks stored, completion ``took`` s later."""
    arrive(p, request, session, keys, clock.t)
    p.insert([x for x in keys if x not in _tracked(p)])
    clock.t += took
    complete(p, request, stop, clock.t)


def _tracked(p) -> set:
    return set(p._where) | set(p._unknown())


def test_default_names_the_predictor():
    assert "default" in known_policies()
    assert policy_class("default") is PredictedNextUse
    assert isinstance(make_policy("default", 8), PredictedNextUse)


def test_samples_residual_median():
    s = Samples(window=4)
    assert s.median() is None and s.residual(1.0) is None
    for v in (10.0, 1.0, 5.0, 300.0):
        s.add(v)
    assert s.median() == 10.0
    assert s.residual(0.0) == 10.0  # median of all
    assert s.residual(6.0) == 300.0 - 6.0  # of the samples above 6 s: 10, 300 -> 300
    assert s.residual(400.0) == 400.0  # past every sample: as long again
    s.add(2.0)  # the window drops the oldest (10)
    assert sorted(s._sorted) == [1.0, 2.0, 5.0, 300.0]


def _learn(p, clock, loops: int = 4) -> None:
    """Agents 1-4 teach the policy that tool_use comes back in ~5 s and end_turn in ~600 s."""
    for a, (stop, gap) in enumerate((("tool_use", 5.0), ("end_turn", 600.0)) * 2, 1):
        keys = chain(a, 4)
        for i in range(loops):
            turn(p, clock, f"{a}.{i}", f"teach-{a}", keys, stop)
            clock.t += gap
    p.remove(list(_tracked(p)))  # the teachers' blocks are out of the way


def test_pnu_keeps_the_agent_back_in_seconds_over_the_one_waiting_for_a_human():
    clock = Clock()
    p = make_policy("pnu", 1000, clock=clock)
    _learn(p, clock)
    a, b = chain(10, 50), chain(11, 50)
    turn(p, clock, "a", "A", a, "tool_use")  # A ran a tool: back in seconds
    clock.t += 1
    turn(p, clock, "b", "B", b, "end_turn")  # B, more recent, waits for its human
    clock.t += 2
    out = p.victims(30, set())
    assert set(out) <= set(b), "the agent predicted back last goes first"
    assert out == b[::-1][:30], "deepest blocks first"
    lru = make_policy("lru", 1000)
    lru.insert(a)
    lru.insert(b)
    assert set(lru.victims(30, set())) <= set(a)  # the negative control: LRU drops the agent coming back


def test_pnu_finished_agents_then_unknown_blocks_go_first():
    clock = Clock()
    p = make_policy("pnu", 1000, clock=clock)
    _learn(p, clock)
    done, soon = chain(20, 5), chain(21, 5)
    turn(p, clock, "d", "D", done, "tool_use")
    turn(p, clock, "s", "S", soon, "end_turn")
    p.observe(Observations(hints=[Hint(session="D", finished=True)]))
    p.insert([k(7), k(8)])  # no agent ever named these
    assert p.victims(5, set()) == done[::-1], "a finished agent is never coming back"
    assert p.victims(2, set()) == [k(7), k(8)], "then blocks of no known agent, LRU order"
    assert set(p.victims(3, set())) <= set(soon)


def test_pnu_admission_stores_the_root_most_part_that_does_not_hurt_an_agent_back_sooner():
    clock = Clock()
    p = make_policy("pnu", 1000, clock=clock)
    _learn(p, clock)
    late = chain(31, 10)
    turn(p, clock, "l0", "L", late[:2], "end_turn")  # L: 2 blocks stored, then it waits for its human
    clock.t += 1000
    soon = chain(30, 20)
    turn(p, clock, "s", "S", soon, "tool_use")  # S just ran a tool: back in ~5 s
    arrive(p, "l1", "L", late, clock.t)  # L is back, in flight: predicted back only after its next answer
    new = late[2:]
    order = p.admit(new[::-1], free=3)  # tail first, as the replay puts: the answer goes by depth
    assert [new[::-1][i] for i in order] == new[:3], "only what fits without evicting S, root-most first"
    p.observe(Observations(hints=[Hint(session="L", finished=True)]))
    assert p.admit(new, free=0) == [], "a finished agent's blocks are worth no eviction (free slots they may take)"
    # Room enough: everything, root first, whatever the batch order.
    arrive(p, "f", "F", chain(32, 4), clock.t)
    assert p.admit(chain(32, 4)[::-1], free=10) == [3, 2, 1, 0]
    # A policy with admission off only orders.
    q = make_policy("pnu", 1000, clock=clock, admission=False)
    arrive(q, "x", "X", chain(33, 4), clock.t)
    assert q.admit(chain(33, 4)[::-1], free=0) == [3, 2, 1, 0]


def test_pnu_blocks_handed_up_stay_the_agents_and_come_back_down_as_its_blocks():
    """A prefetch moved an agent's blocks up out of this tier (an SSD): when they come back down they are admitted
    as the agent's (ranked with it, deepest first), not as blocks of no known agent (which a full tier declines
    where a known agent's are at stake). The negative control: the same keys dropped by ``remove``."""
    clock = Clock()
    p = make_policy("pnu", 1000, clock=clock)
    _learn(p, clock)
    a = chain(40, 6)
    turn(p, clock, "a", "A", a, "tool_use")  # A ran a tool: back in ~5 s
    p.remove(a[3:])
    p.handed_up("A", a[3:], [3, 4, 5])
    p.insert(a[3:][::-1])
    assert {p._where.get(x) for x in a} == {p._agents["A"]}, "the blocks came back as A's"
    assert p.victims(3, set()) == a[::-1][:3], "and go deepest first, as A's"
    b = chain(41, 6)
    turn(p, clock, "b", "B", b, "tool_use")
    p.remove(b[3:])
    p.insert(b[3:])  # no hand-up: the policy has forgotten whose they were
    assert all(p._where.get(x) is None for x in b[3:]), "the negative control: unknown blocks"
    p.handed_up("nobody", [k(99)], [0])  # an agent the policy never saw: nothing remembered
    assert k(99) not in p._pending


def test_pnu_without_any_agent_coming_back_is_lru():
    """Recency until some agent was seen coming back: no completions, no learned gaps, LRU order."""
    rng = random.Random(5)
    p, lru = make_policy("pnu", 64), make_policy("lru", 64)
    tracked: list[bytes] = []
    for step in range(400):
        op = rng.random()
        if op < 0.5:
            new = [k(10_000 + step * 10 + j) for j in range(rng.randint(1, 5))]
            p.insert(new)
            lru.insert(new)
            tracked += new
        elif op < 0.8 and tracked:
            hit = rng.sample(tracked, min(3, len(tracked)))
            p.access(hit)
            lru.access(hit)
        elif tracked:
            protected = set(rng.sample(tracked, min(2, len(tracked))))
            n = rng.randint(1, 6)
            v = p.victims(n, protected)
            assert v == lru.victims(n, protected)
            tracked = [x for x in tracked if x not in v]


def test_pnu_clock_going_backwards_and_unknown_observations_raise_nothing():
    clock = Clock(1000.0)
    p = make_policy("pnu", 100, clock=clock)
    complete(p, "never-arrived", "stop", 5.0)
    p.observe(Observations(hints=[Hint(request="nope", finished=True), Hint(session="nobody", ttl_s=5)]))
    turn(p, clock, "a", "A", chain(1, 5), "tool_use")
    clock.t = 10.0  # backwards
    turn(p, clock, "a2", "A", chain(1, 6), "tool_use")
    clock.t = -5.0
    assert len(p.victims(3, set())) == 3
    arrive(p, "a3", "A", chain(1, 9), clock.t)
    assert p.admit(chain(1, 9)[6:], 0) is not None  # a known chain, whatever the clock says
    assert len(p) == 3


@settings(max_examples=40, deadline=None)
@given(agents=st.integers(100, 3000), max_agents=st.integers(1, 64))
def test_pnu_memory_is_bounded_under_a_flood_of_sessions(agents, max_agents):
    clock = Clock()
    p = make_policy("pnu", 256, clock=clock, max_agents=max_agents, max_pending=512)
    tracker = SessionTracker(clock, max_agents=max_agents, max_requests=128)
    for a in range(agents):
        clock.t += 0.1
        keys = chain(a, 8)
        p.observe(tracker.resolve(Observations(arrivals=[Arrival(str(a), keys)])))  # inferred sessions
        if a % 3 == 0:
            p.insert(keys[:2])
        if len(p) > 256:
            p.victims(len(p) - 256, set())
        if a % 2:
            p.observe(tracker.resolve(Observations(completions=[Completion(str(a), stop="end_turn")])))
    assert p.agents() <= max_agents
    assert p.pending() <= 512
    assert len(p._requests) <= p.max_requests
    assert len(tracker) <= max_agents and tracker.requests <= 128
    assert len(p) <= 256
    before = len(p)
    assert len(p.victims(before + 1, set())) == before and len(p) == 0  # every tracked key evictable


# ---- property tests over random observation streams ----------------------------------------------------

OBS = st.lists(st.tuples(
    st.sampled_from(["arrive", "insert", "access", "remove", "evict", "complete", "hint", "clock"]),
    st.integers(0, 5),  # agent
    st.integers(1, 12),  # chain length / n
    st.integers(0, 3),  # stop / hint kind
), max_size=80)
STOPS = ["tool_use", "end_turn", "stop", None]


def _drive(p, ops, protected_ids, shuffle_seed=None):
    """Run ops against policy p; return the victims lists. ``shuffle_seed`` permutes every insert batch."""
    clock = p.clock
    rng = random.Random(shuffle_seed)
    tracked: set = set()
    out = []
    prot = {k(i) for i in protected_ids}
    req = {}
    for n_op, (op, agent, n, kind) in enumerate(ops):
        keys = chain(agent, n)
        if op == "arrive":
            req[agent] = f"{agent}.{n_op}"
            p.observe(Observations(arrivals=[Arrival(req[agent], keys, clock.t, f"s{agent}")]))
        elif op == "insert":
            new = [x for x in keys if x not in tracked]
            if shuffle_seed is not None:
                rng.shuffle(new)
            p.insert(new)
            tracked |= set(new)
        elif op == "access":
            p.access(keys)
        elif op == "remove":
            p.remove(keys[n // 2:])
            tracked -= set(keys[n // 2:])
        elif op == "evict":
            v = p.victims(n, prot)
            assert len(v) == len(set(v)) <= n
            assert set(v) <= tracked and not set(v) & prot
            if len(v) < n:
                assert tracked - set(v) <= prot
            tracked -= set(v)
            out.append(v)
        elif op == "complete" and agent in req:
            p.observe(Observations(completions=[Completion(req[agent], clock.t, STOPS[kind],
                                                           keys=chain(agent + 50, 1), session=f"s{agent}")]))
        elif op == "hint":
            p.observe(Observations(hints=[Hint(session=f"s{agent}", time=clock.t, finished=kind == 0,
                                               subagents=kind, ttl_s=5.0 if kind == 2 else None,
                                               priority=1.0 if kind == 3 else None)]))
        elif op == "clock":
            clock.t += [0.5, 30.0, -10.0, 500.0][kind]  # backwards too
        assert len(p) == len(tracked)
    return out, tracked


@pytest.mark.parametrize("name", ["pnu", "chain-lru"])
@settings(max_examples=250, deadline=None)
@given(ops=OBS, protected=st.sets(st.integers(0, 600_000), max_size=6))
def test_observing_policy_invariants(name, ops, protected):
    """Victims tracked, unprotected, distinct, at most n, fewer only if the rest is protected; len exact;
    and at the end every tracked key is evictable."""
    p = make_policy(name, 32, clock=Clock())
    _, tracked = _drive(p, ops, protected)
    assert set(p.victims(len(tracked) + 1, set())) == tracked
    assert len(p) == 0


@pytest.mark.parametrize("name", ["pnu", "chain-lru"])
@settings(max_examples=150, deadline=None)
@given(ops=OBS, seed=st.integers(0, 1000))
def test_eviction_order_does_not_depend_on_batch_order(name, ops, seed):
    """Keys of a chain the policy was told about (a put follows its request's arrival) are evicted by depth,
    however the put listed them: root first (vLLM) or tail first (the replay) give the same victims."""
    told = []
    for op in ops:
        if op[0] == "insert":
            told.append(("arrive", *op[1:]))
        told.append(op)
    a, _ = _drive(make_policy(name, 32, clock=Clock()), told, ())
    b, _ = _drive(make_policy(name, 32, clock=Clock()), told, (), shuffle_seed=seed)
    assert a == b


@pytest.mark.parametrize("name", ["pnu", "chain-lru"])
def test_root_first_and_tail_first_puts_evict_the_same_tail(name):
    ops = [("arrive", 1, 6, 0), ("insert", 1, 6, 0), ("evict", 0, 2, 0)]
    root_first, _ = _drive(make_policy(name, 32, clock=Clock()), ops, ())
    assert root_first == [[chain(1, 6)[5], chain(1, 6)[4]]]
    lru, _ = _drive(make_policy("lru", 32, clock=Clock()), ops, ())
    assert lru == [chain(1, 6)[:2]], "the negative control: root-first puts make LRU drop the root"


# ---- the session tracker -------------------------------------------------------------------------------

def test_tracker_infers_agents_from_chains_and_keeps_client_ids_apart():
    clock = Clock(7.0)
    t = SessionTracker(clock)
    r = t.resolve(Observations(arrivals=[Arrival("1", chain(1, 3)), Arrival("2", chain(2, 3)),
                                         Arrival("3", chain(1, 5)), Arrival("4", chain(1, 2)),
                                         Arrival("5", chain(1, 4), session="~1")]))
    a1, a2, a3, a4, a5 = (x.session for x in r.arrivals)
    assert a1 != a2 and a3 == a1, "a chain extending request 1's chain is request 1's agent"
    assert a4 not in (a1, a2), "a shorter chain does not pass through the agent's last block: a new agent"
    assert a5 == "~~1" and a5 not in (a1, a2, a4), "a client id never collides with an inferred one"
    assert all(x.time == 7.0 for x in r.arrivals)
    done = t.resolve(Observations(completions=[Completion("3", stop="tool_use", keys=chain(1, 7)[5:])],
                                  hints=[Hint(request="3", finished=True)]))
    assert done.completions[0].session == a1 and done.hints[0].session == a1
    nxt = t.resolve(Observations(arrivals=[Arrival("6", chain(1, 9))]))
    assert nxt.arrivals[0].session == a1, "the output blocks a completion added continue the chain"


# ---- the guard -------------------------------------------------------------------------------------------

class Exploding(LRUPolicy):
    name = "exploding"
    observes = True
    calls = 0

    def victims(self, n, protected):
        Exploding.calls += 1
        raise RuntimeError("policy bug")

    def observe(self, batch):
        raise KeyError("observe bug")


def test_guard_logs_once_and_goes_on_in_lru_order(caplog):
    held = {k(i): None for i in range(4)}
    g = GuardedPolicy(Exploding(8), held.keys, "test tier")
    g.insert(list(held))
    with caplog.at_level(logging.ERROR, logger="kvtier.policies.guard"):
        assert g.victims(2, set()) == [k(0), k(1)]  # LRU over what the tier holds, in its map's order
        g.observe(Observations(arrivals=[Arrival("r", [k(1)], 0.0, "s")]))
        assert g.victims(1, {k(2)}) == [k(3)]
    assert len(caplog.records) == 1 and "exploding" in caplog.text and "victims" in caplog.text
    assert "policy bug" in g.failed and Exploding.calls == 1 and not g.observes


class OldStyle:
    """A user's policy written before observations existed: keys only, no Policy base."""

    def __init__(self, capacity):
        self.keys = []

    def insert(self, keys):
        self.keys += keys

    def access(self, keys):
        pass

    def remove(self, keys):
        self.keys = [x for x in self.keys if x not in keys]

    def victims(self, n, protected):
        out = [x for x in self.keys if x not in protected][:n]
        self.remove(out)
        return out

    def __len__(self):
        return len(self.keys)


def test_keys_only_policies_by_import_path_still_work():
    p = make_policy(f"{__name__}:OldStyle", 4)
    p.insert([k(1), k(2)])
    p.observe(Observations(arrivals=[Arrival("r", [k(1)], 0.0, "s")]))
    assert p.admit([k(3)], 0) is None
    assert p.victims(1, set()) == [k(1)] and len(p) == 1


def test_a_session_that_drops_its_chain_starts_a_branch():
    """Bug (found on the replay with session ids: 0.372 instead of 0.481 at DRAM 5%): a session whose context
    was compacted kept its old chain's blocks under the agent that comes back, as if it would read them."""
    t = SessionTracker(Clock())
    first = t.resolve(Observations(arrivals=[Arrival("1", chain(1, 4), session="s")])).arrivals[0].session
    more = t.resolve(Observations(arrivals=[Arrival("2", chain(1, 6), session="s")])).arrivals[0].session
    compacted = t.resolve(Observations(arrivals=[Arrival("3", chain(2, 3), session="s")])).arrivals[0].session
    after = t.resolve(Observations(arrivals=[Arrival("4", chain(2, 5), session="s")])).arrivals[0].session
    assert first == more == "s" and compacted == after != "s" and compacted.startswith("s#")
    hint = t.resolve(Observations(hints=[Hint(session="s", finished=True)])).hints[0]
    assert hint.session == compacted, "a hint for the session names its current branch"
    clock = Clock()
    p = make_policy("pnu", 100, clock=clock)
    _learn(p, clock)
    tracker = SessionTracker(clock)
    for i, keys in enumerate((chain(1, 6), chain(1, 8), chain(2, 4))):  # the third: a compacted context
        p.observe(tracker.resolve(Observations(arrivals=[Arrival(f"r{i}", keys, clock.t, "s")])))
        p.insert([x for x in keys if x not in _tracked(p)])
        clock.t += 1
        p.observe(tracker.resolve(Observations(completions=[Completion(f"r{i}", clock.t, "tool_use")])))
        clock.t += 5
    clock.t += 100  # the abandoned branch is never coming back: it goes before the live one
    assert set(p.victims(8, set())) == set(chain(1, 8))
