"""The session-aware checkpoint rule (kvtier/policies/checkpoints.py): which hybrid-model checkpoints go first."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies.checkpoints import LIVE, SUPERSEDED, UNSEEN, CheckpointRule


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
