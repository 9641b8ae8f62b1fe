"""The vLLM connector's observation path against vLLM's real Scheduler (vllm_engine.py): each request's block
hashes, finish and kv_transfer_params hints go from the scheduler to every rank's store, whose policies then
know the same agents."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it from tests/requirements-vllm.txt)")

from kvtier.connectors.hints import RequestHints, read_hints  # noqa: E402
from kvtier.connectors.vllm.observe import Notebook, RequestNotes, stop_reason  # noqa: E402
from vllm_engine import (  # noqa: E402
    BLOCK,
    PREFIX,
    keys_of,
    make_request,
    worker_side,
)


def record(eng, rank: int) -> list:
    """Every resolved batch rank ``rank``'s DRAM tier hands its policy."""
    tier = worker_side(eng, rank).store.tiers[0]
    seen = []
    real = tier.observe

    def observe(batch):
        seen.append(batch)
        real(batch)

    tier.observe = observe
    return seen


def test_every_rank_learns_the_same_requests_chains_stops_and_hints(engine):
    eng = engine(tp=2)
    seen = [record(eng, 0), record(eng, 1)]
    a = make_request("A", PREFIX + [5, 6, 7], max_tokens=2 * BLOCK,
                     kvtier={"session": "agent-7", "subagents": 2, "ttl_s": 30})
    eng.add(a)
    eng.run([a])
    b = make_request("B", list(a.all_token_ids) + [9] * BLOCK, max_tokens=2)  # A's next turn, no session id
    eng.add(b)
    eng.run([b])
    c = make_request("C", [3] * (3 * BLOCK), max_tokens=2)  # someone else
    eng.add(c)
    eng.run([c])
    for rank in (0, 1):
        batches = seen[rank]
        arrivals = [x for batch in batches for x in batch.arrivals]
        completions = [x for batch in batches for x in batch.completions]
        hints = [x for batch in batches for x in batch.hints]
        assert [x.request for x in arrivals] == ["A", "B", "C"]
        n_a = len(PREFIX + [5, 6, 7]) // BLOCK
        assert list(arrivals[0].keys) == keys_of(eng, a, rank)[:n_a], "the full chain, root first, this rank's keys"
        assert arrivals[0].session == "agent-7"
        assert [x.request for x in completions] == ["A", "B", "C"]
        assert all(x.stop == "length" for x in completions)  # max_tokens ended them (ignore_eos)
        assert list(completions[0].keys) == keys_of(eng, a, rank)[n_a:], "the blocks A's output added"
        assert completions[0].time >= arrivals[0].time
        assert len(hints) == 1 and hints[0].session == "agent-7" and hints[0].subagents == 2
        assert hints[0].ttl_s == 30.0
        assert arrivals[1].session == "agent-7", "B extends A's chain (and its output): A's agent, inferred"
        assert arrivals[2].session not in ("agent-7", None)
    assert [x.session for batch in seen[0] for x in batch.arrivals] == \
        [x.session for batch in seen[1] for x in batch.arrivals], "both ranks infer the same agents"
    policy = worker_side(eng, 1).store.tiers[0]._policy.policy
    assert policy.agents() == 2


def test_bad_hints_are_ignored_not_fatal(caplog):
    bad = {"kvtier": {"session": 5, "finished": "yes", "subagents": -1, "ttl_s": float("inf"), "priority": 2}}
    assert read_hints(bad, "request r") == RequestHints(priority=2.0)
    assert sum("request r: ignoring hint" in r.getMessage() for r in caplog.records) == 4
    assert read_hints({"do_remote_prefill": True}, "request r") is None and read_hints(None, "r") is None


def test_notes_travel_as_ages_and_land_on_the_workers_clock(engine):
    eng = engine()
    t = [100.0]
    book = Notebook(clock=lambda: t[0])
    req = make_request("Z", [4] * (2 * BLOCK))
    book.arrived(req, req.block_hashes, None)
    t[0] = 103.0
    notes = book.take()
    assert notes.arrivals[0].age_s == 3.0 and not book.take()
    store = worker_side(eng).store
    seen = record(eng, 0)
    notes.apply(store, worker_side(eng).namespace)
    arrival = seen[0].arrivals[0]
    assert abs(arrival.time - (store.clock() - 3.0)) < 1.0
    assert isinstance(RequestNotes(), RequestNotes) and not RequestNotes()


def test_stop_reasons_name_the_stop_token():
    class Req:
        stop_reason = 128008

        @staticmethod
        def get_finished_reason():
            from vllm.v1.engine import FinishReason

            return FinishReason.STOP

    assert stop_reason(Req()) == "stop:128008"
    Req.stop_reason = None
    assert stop_reason(Req()) == "stop"
