"""The engines' standard hint envelope (vLLM's Request.kv_hints, SGLang's GenerateReqInput.kv_hints) applied to a
real store (DRAM over a real SSD tier, the session-aware policy on a hand-moved clock): each action's outcome,
and its effect: a Pin survives pressure (without it the same blocks go), a Demote goes first."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conftest import blocks_for
from kvtier.connectors.kv_hints import MAX_PIN_S, HintOutcomes, apply_kv_hints
from kvtier.policies import Arrival, Completion
from kvtier.prefetch import Prefetcher
from kvtier.tools.replay.replayer import VirtualClock  # a settable clock the store's policy reads
from kvtier.store import TieredStore

BB = 4096


@dataclass(frozen=True)
class Action:  # the shape of vLLM's msgspec KvHintAction, read by attribute
    action_id: str
    action_type: str
    action_version: int = 1
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Envelope:
    protocol_version: int
    message_id: str
    actions: list[Action]


def chain(agent: int, n: int) -> list[bytes]:
    return [(agent * 100_000 + d).to_bytes(16, "little") for d in range(n)]


def run(tmp_path, hints: dict[int, Envelope | dict], gap_after: int = 0) -> tuple[TieredStore, list, VirtualClock]:
    """Agents 1 and 2 (same stop reason, 4 blocks each) then agents 3..6 fill an 12-block DRAM; ``hints``
    (agent -> envelope) are applied right after that agent's turn. ``gap_after``: 120 s pass after that agent's
    turn, so DRAM's admission takes the agents after it in place of the overdue ones (without the gap it declines
    the newcomers, predicted back later). Returns the store (open), the outcomes."""
    clock = VirtualClock()
    store = TieredStore.from_config({"dram_capacity": 12 * BB, "ssd_path": str(tmp_path), "ssd_capacity": 256 * BB,
                                     "ssd_direct_io": "false", "ssd_staging_bytes": 0}, BB, clock=clock)
    outcomes = []
    n = 0
    for _ in range(4):  # the policy learns: tool_use is back in 5 s
        for a in (7, 8):
            n += 1
            store.observe(arrivals=[Arrival(f"r{n}", chain(a, 1), clock.now, f"a{a}")])
            store.put(chain(a, 1), blocks_for(chain(a, 1), BB))
            clock.now += 1
            store.observe(completions=[Completion(f"r{n}", clock.now, "tool_use")])
        clock.now += 5
    for a in range(1, 7):
        n += 1
        keys = chain(a, 4)
        store.observe(arrivals=[Arrival(f"r{n}", keys, clock.now, f"a{a}")])
        store.put(keys[::-1], blocks_for(keys[::-1], BB))
        clock.now += 0.5
        store.observe(completions=[Completion(f"r{n}", clock.now, "tool_use")])
        if a in hints:
            outcomes += apply_kv_hints(hints[a], store, f"a{a}", keys, now=clock.now)
        if a == gap_after:
            clock.now += 120  # the agents so far long overdue: the policy expects the newcomers back sooner
    return store, outcomes, clock


def in_dram(store: TieredStore, keys: list[bytes]) -> int:
    found = store.lookup_prefix(keys)
    return found.count("dram")


def test_a_pin_survives_pressure_and_without_it_the_same_blocks_go(tmp_path):
    pin = Envelope(1, "m1", [Action("p", "Pin", payload={"ttl_s": 60})])
    store, outcomes, _ = run(tmp_path / "a", {3: pin}, gap_after=3)
    try:
        assert [o.outcome for o in outcomes] == ["accepted"]
        assert in_dram(store, chain(3, 4)) == 4
    finally:
        store.close()
    store, _, _ = run(tmp_path / "b", {}, gap_after=3)
    try:
        assert in_dram(store, chain(3, 4)) < 4  # the negative control: unpinned, agent 3 lost DRAM blocks
    finally:
        store.close()


def test_a_demote_goes_first(tmp_path):
    demote = {"protocol_version": 1, "message_id": "m", "actions": [  # SGLang's over HTTP: plain dicts
        {"action_id": "d", "action_type": "Demote", "action_version": 1, "payload": {}}]}
    store, outcomes, _ = run(tmp_path / "a", {1: demote})
    try:
        assert [o.outcome for o in outcomes] == ["accepted"]
        assert in_dram(store, chain(1, 4)) == 0  # demoted: the first to go, though predicted back first
    finally:
        store.close()
    store, _, _ = run(tmp_path / "b", {})
    try:
        assert in_dram(store, chain(1, 4)) == 4
    finally:
        store.close()


def test_each_outcome_is_counted_and_bad_hints_are_rejected(tmp_path):
    envelope = Envelope(1, "m", [
        Action("1", "Pin", payload={"ttl_s": 10 * MAX_PIN_S}), Action("2", "Share"), Action("3", "Retain", payload={"priority": 2}),
        Action("4", "Teleport"), Action("5", "Pin", action_version=9), Action("6", "Pin", payload={"ttl_s": "x"}),
        Action("7", "Prefetch")])
    store, outcomes, _ = run(tmp_path, {6: envelope})
    try:
        assert [o.outcome for o in outcomes] == ["clipped", "ignored", "accepted", "rejected", "rejected", "rejected",
                                                 "ignored"]
        assert apply_kv_hints({"protocol_version": 7, "actions": []}, store, "a6", chain(6, 4))[0].outcome == "rejected"
        pf = Prefetcher(store)
        got = apply_kv_hints(Envelope(1, "m", [Action("8", "Prefetch")]), store, "a6", chain(6, 4), prefetcher=pf)
        assert got[0].outcome == "accepted" and pf.sessions() == ["a6"]
        counter = HintOutcomes()
        counter.record("request r", outcomes)
        assert counter.counts[("Pin", "rejected")] == 2 and counter.counts[("other", "rejected")] == 1
    finally:
        store.close()
