"""The replay drives what an engine and an agent harness know: arrivals with chains, completions with the
traces' stop reasons, sessions on or off, hints; the traces keep ``stop`` and ``api_time``; the DRAM-only OPT;
and the session-aware default against LRU on agent loops, with a control where no agent comes back."""

import pytest

from kvtier.policies.lru import LRUPolicy
from kvtier.tools.replay.opt import belady_hits
from kvtier.tools.replay.traces import TraceError, parse_agentic
from replaykit import BT, replay, req, sub, sweep, trace


class Recorder(LRUPolicy):
    """LRU that keeps every observation it is given (class-level: the store builds it by import path)."""

    name = "recorder"
    observes = True
    seen: list = []

    def observe(self, batch):
        Recorder.seen.append(batch)


def recorded(**kw):
    Recorder.seen = []
    tr = trace("t", [req([1, 2, 3], stop="tool_use"), req([1, 2, 3, 4, 5], think=2.0, stop="tool_use"),
                     sub([req([9, 10], stop="end_turn")], t=30.0, duration=3.0),
                     req([1, 2, 3, 4, 5, 6], stop="end_turn")])
    sw = sweep([tr], **kw)
    run = replay(sw, f"{__name__}:Recorder", 4, 8)
    return sw, run, Recorder.seen


def test_traces_keep_stop_and_api_time():
    t = trace("t", [req([1, 2], stop="tool_use", api=3.5), req([1, 2, 3], api=None)])
    first, second = t.steps
    assert (first.stop, first.api_time) == ("tool_use", 3.5) and (second.stop, second.api_time) == (None, None)
    with pytest.raises(TraceError, match="'stop' must be a string"):
        parse_agentic({"requests": [{**req([1]), "stop": 7}]})


def test_arrivals_and_completions_reach_the_policy_in_order():
    sw, run, seen = recorded()
    arrivals = [a for b in seen for a in b.arrivals]
    completions = [c for b in seen for c in b.completions]
    assert len(arrivals) == len(completions) == 4
    keys = sw.workload.keys(sw.workload.replays[0], sw.namespace)
    assert [len(a.keys) for a in arrivals] == [3, 5, 2, 6]
    # Dense ids are assigned in sorted order of the trace's ids: 1..6 -> 0..5, 9, 10 -> 6, 7.
    assert list(arrivals[1].keys) == keys[:5], "full chain, root first"
    assert [c.stop for c in completions] == ["tool_use", "tool_use", "end_turn", "end_turn"]
    assert all(a.session is not None for a in arrivals)  # filled in by the store (inferred)
    assert arrivals[1].session == arrivals[0].session == arrivals[3].session != arrivals[2].session
    for a, c in zip(sorted(arrivals, key=lambda x: x.request), sorted(completions, key=lambda x: x.request)):
        assert a.request == c.request and c.time >= a.time
    assert not any(b.hints for b in seen)


def test_sessions_and_hints_as_a_harness_sends_them():
    _, _, seen = recorded(sessions=True, hints=True)
    arrivals = [a for b in seen for a in b.arrivals]
    hints = {h.request: h for b in seen for h in b.hints}
    parent, child = arrivals[0].session, arrivals[2].session
    assert parent != child and not parent.startswith("~"), "the harness's ids, not inferred ones"
    by_request = {a.request: a for a in arrivals}
    spawning = [r for r, h in hints.items() if h.subagents == 1]
    assert len(spawning) == 1 and by_request[spawning[0]].session == parent
    finished = sorted(by_request[r].session for r, h in hints.items() if h.finished)
    assert finished == sorted([parent, child]), "each agent's last request says it is finished"


def agent_loops(n_agents: int, turns: int, back_in: float) -> list:
    """Agents whose chains grow each turn; each comes back ``back_in`` s after its answer."""
    out = []
    for a in range(n_agents):
        base = a * 10_000
        out.append(trace(f"a{a}", [req(list(range(base, base + 8 + 2 * i)), think=back_in, stop="tool_use")
                                   for i in range(turns)]))
    return out


def test_default_keeps_the_agents_that_come_back_and_is_lru_when_none_does():
    """Agents in lanes come back after their tools while others wait: LRU keeps whoever ran last, the default
    keeps those predicted back first. The negative control: one request per trace, nobody comes back."""
    loops = sweep(agent_loops(12, 8, 5.0) + agent_loops(1, 1, 0.0), lanes=6, prefill=2000.0)
    lru, default = (replay(loops, p, 0, 40).result.hit_rate for p in ("lru", "default"))
    assert default > lru + 0.05
    once = sweep([trace(f"o{i}", [req(list(range(i * 100, i * 100 + 10)))]) for i in range(30)], lanes=4)
    a, b = (replay(once, p, 0, 25) for p in ("lru", "default"))
    assert a.result.hit_rate == b.result.hit_rate and a.result.bytes_stored == b.result.bytes_stored


def test_dram_only_opt_is_belady_at_the_store_capacity():
    sw = sweep(agent_loops(3, 4, 1.0), lanes=2)
    calls = []
    real = sw.limits.limits
    sw.limits.limits = lambda stream, capacity: (calls.append((stream.copy(), capacity)), real(stream, capacity))[1]
    run = replay(sw, "lru", 4, 10)
    (stream, total), (same, store) = calls
    assert (total, store) == (14, 10) and (same == stream).all()
    assert run.store_limits.opt == belady_hits(stream, 10) < run.limits.opt == belady_hits(stream, 14)
    assert run.opt_dram_only_hit_rate == pytest.approx(belady_hits(stream, 10) * BT / run.result.input_tokens)
    assert replay(sw, "lru", 4, 0).store_limits is None  # no store: no DRAM-only bound
