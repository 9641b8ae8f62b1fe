"""The session-aware checkpoint rule (kvtier/policies/checkpoints.py): which hybrid-model checkpoints go first."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvtier.policies.checkpoints import LIVE, MAX_AGENTS, SUPERSEDED, UNSEEN, CheckpointRule
from kvtier.tools.replay.replayer import VirtualClock  # a settable clock the store's policy reads


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def test_superseded_first_then_unseen_then_live_back_last_first():
    rule = CheckpointRule()
    rule.add(key(1), "a", 1000)  # a's turn 1
    rule.add(key(2), "a", 1400)  # a's turn 2: supersedes turn 1
    rule.add(key(3), "b", 900)  # b, finished
    rule.add(key(4), "c", 700)  # c, back later than a
    back = {"a": 10.0, "c": 50.0}.get
    order = rule.order([key(i) for i in (4, 2, 3, 1)], alive={"a", "c"}, back_at=lambda x: back(x, math.inf))
    assert order == [key(1), key(3), key(4), key(2)]


def test_a_fork_junction_is_kept_while_any_of_its_agents_is_alive():
    rule = CheckpointRule()
    rule.add(key(1), "parent", 2000)  # the junction the sub-agents fork at
    rule.add(key(1), "sub1", 2000)
    rule.add(key(2), "parent", 2600)  # the parent moves on: not a supersession of a shared junction
    rule.add(key(3), "sub1", 2300)
    assert rule.eviction_class(key(1), alive={"sub1"}) == LIVE
    assert rule.eviction_class(key(1), alive=set()) == UNSEEN
    order = rule.order([key(1), key(3)], alive={"sub1"}, back_at=lambda a: 5.0)
    assert order[-1] in (key(1), key(3)) and rule.eviction_class(key(1), {"sub1"}) != SUPERSEDED


def test_memory_is_bounded_oldest_forgotten_first():
    rule = CheckpointRule(max_checkpoints=3)
    for i in range(5):
        rule.add(key(i), "a", i)
    assert len(rule) == 3
    assert rule.eviction_class(key(0), {"a"}) == UNSEEN  # forgotten: no live agent's as far as the rule knows
    for i in range(MAX_AGENTS + 10):  # a junction every agent passes through keeps a bounded set of them
        rule.add(key(9), f"agent-{i}", 5)
    assert len(rule._points[key(9)].agents) == MAX_AGENTS and "agent-73" in rule._points[key(9)].agents
    with pytest.raises(ValueError):
        CheckpointRule(max_checkpoints=0)


checkpoints = st.lists(st.tuples(st.integers(0, 30), st.sampled_from("abcd"), st.integers(0, 5000)),
                       min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(checkpoints, st.sets(st.sampled_from("abcd")), st.dictionaries(st.sampled_from("abcd"), st.floats(0, 100)))
def test_order_invariants(adds, alive, back):
    rule = CheckpointRule()
    for k, agent, pos in adds:
        rule.add(key(k), agent, pos)
    keys = list(dict.fromkeys(key(k) for k, _, _ in adds))
    order = rule.order(keys, alive, lambda a: back.get(a, math.inf))
    assert sorted(order) == sorted(keys)  # a permutation
    where = {k: i for i, k in enumerate(order)}
    cls = {k: rule.eviction_class(k, alive) for k in keys}
    # Classes in order: every superseded checkpoint before every unseen one, before every live one.
    assert [cls[k] for k in order] == sorted(cls[k] for k in order)
    for k in keys:
        point = rule._points[k]
        live = [a for a in point.agents if a in alive]
        if len(point.agents) > 1 and live:
            assert cls[k] == LIVE  # a junction a live agent saw is never dropped as superseded or unseen
        if len(point.agents) == 1 and live and cls[k] == LIVE:
            # the newest checkpoint of a live agent outlasts every older one of the same agent
            (agent,) = point.agents
            for other in keys:
                p2 = rule._points[other]
                if p2.agents == {agent} and p2.position < point.position:
                    assert where[other] < where[k]
    # Among live checkpoints, one whose agents are back sooner is evicted later.
    lives = [k for k in order if cls[k] == LIVE]
    soonest = [min(back.get(a, math.inf) for a in rule._points[k].agents if a in alive) for k in lives]
    assert soonest == sorted(soonest, reverse=True)


# ---- the default policy keeps checkpoints on the real store (pnu.py, Arrival.checkpoints) ---------------

BB = 64


def skey(i: int) -> bytes:
    return i.to_bytes(16, "little")  # a store's keys are 16 bytes


def _store(clock: VirtualClock):
    import torch

    from kvtier.pins import PinTable
    from kvtier.store import TieredStore
    from kvtier.tiers.dram import DramTier

    tier = DramTier(120 * BB, BB, policy="default", clock=clock)
    tier.attach(PinTable(), None)
    store = TieredStore([tier], clock=clock)

    def put(keys: list[bytes]) -> None:
        store.put(keys, torch.zeros(len(keys), BB, dtype=torch.uint8))

    return store, put


def _turn(store, put, clock, rid, session, keys, checkpoints, declare, stop="tool_use"):
    """A request: its arrival (with its checkpoints when ``declare``), its new blocks and objects stored
    (write-through, tail first), its completion a second later."""
    from kvtier.policies import Arrival, Completion

    store.observe(arrivals=[Arrival(rid, keys, clock.now, session, checkpoints if declare else ())])
    new = [x for x in keys + [o for _, objs in checkpoints for o in objs] if not store.contains([x])[0]]
    put(new[::-1])
    clock.now += 1.0
    store.observe(completions=[Completion(rid, clock.now, stop)])


def _scenario(declare: bool):
    """Teachers make the policy predictive and finish; agent A's second turn supersedes its first checkpoint;
    parent P's subagents S1 and S2 fork at a junction J (S1 makes it, S2 restores from it), then S2 finishes."""
    from kvtier.policies import Hint

    clock = VirtualClock()
    store, put = _store(clock)
    for t in range(4):  # 4 teachers x 3 turns, back in 5 s after tool_use
        for i in range(3):
            _turn(store, put, clock, f"t{t}.{i}", f"T{t}", [skey(1000 + 10 * t + j) for j in range(2)], [], declare)
            clock.now += 5.0
        store.observe(hints=[Hint(session=f"T{t}", finished=True)])
    a = [skey(2000 + i) for i in range(16)]
    sa1, sa2 = [skey(2100 + i) for i in range(3)], [skey(2200 + i) for i in range(3)]
    _turn(store, put, clock, "a1", "A", a[:10], [(10, sa1)], declare)
    _turn(store, put, clock, "a2", "A", a, [(10, sa1), (16, sa2)], declare)
    p = [skey(3000 + i) for i in range(12)]
    u1, u2 = [skey(3100 + i) for i in range(4)], [skey(3200 + i) for i in range(4)]
    sp, j = [skey(3300 + i) for i in range(3)], [skey(3400 + i) for i in range(3)]
    su1, su2 = [skey(3500 + i) for i in range(3)], [skey(3600 + i) for i in range(3)]
    _turn(store, put, clock, "p", "P", p, [(12, sp)], declare)
    store.observe(hints=[Hint(session="P", subagents=2)])
    _turn(store, put, clock, "s1", "S1", p[:8] + u1, [(8, j), (12, su1)], declare)
    _turn(store, put, clock, "s2", "S2", p[:8] + u2, [(8, j), (12, su2)], declare)
    store.observe(hints=[Hint(session="S2", finished=True)])
    return store, put, clock, dict(sa1=sa1, sa2=sa2, j=j, su2=su2, u2=u2, p=p, a=a, su1=su1)


def _fill(put, start: int, n: int) -> None:
    put([skey(9000 + start + i) for i in range(n)])  # blocks of no agent: stored whatever the policy predicts


def test_a_superseded_checkpoint_goes_first_on_the_store():
    store, put, _, ks = _scenario(declare=True)
    held = store.tiers[0].stats().blocks
    _fill(put, 0, 120 - held + 3)  # three slots to make: the superseded checkpoint's three objects
    assert store.contains(ks["sa1"]) == [False] * 3
    for name in ("sa2", "a", "j", "su1", "su2"):  # everything else, the finished teachers' blocks included
        assert all(store.contains(ks[name])), name
    # Negative control: the same traffic without checkpoints declared keeps them as blocks of no agent,
    # evicted after finished agents' blocks: the superseded state is still there.
    store, put, _, ks = _scenario(declare=False)
    _fill(put, 0, 120 - store.tiers[0].stats().blocks + 3)
    assert all(store.contains(ks["sa1"]))


def test_a_fork_junction_survives_its_finished_agent_while_another_is_alive():
    from kvtier.policies import Hint

    store, put, _, ks = _scenario(declare=True)
    _fill(put, 0, 120 - store.tiers[0].stats().blocks + 3)  # the superseded checkpoint
    _fill(put, 100, 9)  # then S2, finished: its end checkpoint and its own blocks, deepest first, then its roots
    assert not any(store.contains(ks["su2"] + ks["u2"]))
    assert not any(store.contains(ks["p"][6:8]))  # S2's deepest shared blocks went past the junction ...
    assert all(store.contains(ks["j"])), "... the junction S1 and P still need was handed on, not evicted"
    assert all(store.contains(ks["su1"] + ks["sa2"]))
    # Once every agent that saw it is finished, the junction is nobody's: it goes with its last owner.
    store.observe(hints=[Hint(session=s, finished=True) for s in ("S1", "P")])
    _fill(put, 200, 40)
    assert not any(store.contains(ks["j"]))
    assert all(store.contains(ks["sa2"]))  # A, still expected, keeps its newest checkpoint


CP_OPS = st.lists(st.tuples(
    st.sampled_from(["arrive", "insert", "evict", "remove", "complete", "finish", "clock"]),
    st.integers(0, 4),  # agent
    st.integers(1, 10),  # chain length / n
    st.integers(0, 4),  # blocks shared with every agent (a fork junction) / kind
), max_size=60)


def _chain(agent: int, n: int, shared: int) -> list[bytes]:
    return [skey(d) for d in range(min(shared, n))] + [skey(1000 * (agent + 1) + d) for d in range(shared, n)]


def _objects(block: bytes, units: int = 2) -> list[bytes]:
    return [skey(int.from_bytes(block, "little") + 100_000 * (i + 1)) for i in range(units)]


@settings(max_examples=300, deadline=None)
@given(ops=CP_OPS, teach=st.booleans(), protected=st.sets(st.integers(0, 10), max_size=3))
# Found by hypothesis: a victims call handed the shared root's checkpoint objects to their heir (agent 0, back
# sooner) and stopped short of n, though nothing was protected (now: another pass takes the heir's turn).
@example(ops=[("arrive", 0, 1, 1), ("arrive", 1, 1, 1), ("arrive", 1, 1, 1), ("insert", 0, 1, 1)], teach=True,
         protected=set())
def test_pnu_with_checkpoints_keeps_its_invariants(ops, teach, protected):
    """Random arrivals with checkpoints (an agent's end of chain, and the fork junction it shares with the
    others), puts, evictions, removals, completions and finished agents: victims are tracked, distinct,
    unprotected, at most n, fewer only if the rest is protected; every key is counted once (its agent's, of no
    agent, or a superseded checkpoint's); at the end every key is evictable."""
    from kvtier.policies import Arrival, Completion, Hint, Observations, make_policy

    clock = VirtualClock()
    p = make_policy("default", 64, clock=clock)
    if teach:  # make it predictive: tool_use is followed by a return every time
        for i in range(4):
            p.observe(Observations(arrivals=[Arrival(f"t{i}", [skey(999_000)], clock.now, "T")]))
            clock.now += 1
            p.observe(Observations(completions=[Completion(f"t{i}", clock.now, "tool_use")]))
            clock.now += 2
    tracked: set = set()
    prot = {skey(1000 + i) for i in protected}
    req: dict[int, str] = {}
    for n_op, (op, agent, n, kind) in enumerate(ops):
        keys = _chain(agent, n, kind)
        cps = [(n, _objects(keys[n - 1]))] + ([(kind, _objects(keys[kind - 1]))] if 0 < kind < n else [])
        if op == "arrive":
            req[agent] = f"{agent}.{n_op}"
            p.observe(Observations(arrivals=[Arrival(req[agent], keys, clock.now, f"s{agent}", cps)]))
        elif op == "insert":
            new = [x for x in keys + [o for _, objs in cps for o in objs] if x not in tracked]
            p.insert(new)
            tracked |= set(new)
        elif op == "evict":
            v = p.victims(n, prot)
            assert len(v) == len(set(v)) <= n
            assert set(v) <= tracked and not set(v) & prot
            if len(v) < n:
                assert tracked - set(v) <= prot
            tracked -= set(v)
        elif op == "remove":
            gone = keys[n // 2:] + cps[0][1][:1]
            p.remove(gone)
            tracked -= set(gone)
        elif op == "complete" and agent in req:
            p.observe(Observations(completions=[Completion(req[agent], clock.now, "tool_use", session=f"s{agent}")]))
        elif op == "finish":
            p.observe(Observations(hints=[Hint(session=f"s{agent}", time=clock.now, finished=True)]))
        elif op == "clock":
            clock.now += [0.5, 3.0, 30.0, -5.0, 500.0][kind]
        assert len(p) == len(tracked)
        if p._orphans_map is not None:  # told of an arrival: every key is an agent's, of none, or dead
            owned = sum(a.count for a in p._agents.values() if a.alive)
            assert owned + len(p._orphans_map) + len(p._dead) == len(tracked)
    assert set(p.victims(len(tracked) + 1, set())) == tracked
    assert len(p) == 0
