"""The engines' standard hint envelope through the vLLM connector: vLLM's own msgspec ``KvHintsEnvelope`` /
``KvHintAction`` on a real ``Request.kv_hints``, read by the scheduler half when the request is admitted, applied
by every worker's store (vllm_engine.py: vLLM's scheduler and allocator, a fake forward). Each action's outcome
is counted in the connector stats and logged; a Pin keeps the blocks through pressure (without it they go); a
Demote reaches the policy as the request's agent's priority; a bad action or envelope is rejected, counted, and
the request is served all the same (its KV checked bit-exact by the harness)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it from tests/requirements-vllm.txt)")

from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402

from conftest import blocks_for  # noqa: E402
from kvtier.connectors.kv_hints import MAX_PIN_S  # noqa: E402
from kvtier.connectors.vllm.transfer import session_lease  # noqa: E402
from vllm_engine import PREFIX, make_request, save_a_then_drop_hbm, worker_side  # noqa: E402


def envelope(*actions: tuple[str, dict], version: str = "1", action_version: str = "1") -> KvHintsEnvelope:
    return KvHintsEnvelope(protocol_version=version, message_id="m1", actions=[
        KvHintAction(action_id=f"a{i}", action_type=kind, action_version=action_version, payload=payload)
        for i, (kind, payload) in enumerate(actions)])


def turn(eng, req_id: str, hints: KvHintsEnvelope | None, **params):
    """A next turn of A's agent (A's prefix plus a block), sent with ``hints``; run to its end."""
    req = make_request(req_id, PREFIX + [9] * 20, **params)
    req.kv_hints = hints
    eng.add(req)
    eng.run([req])
    return req


def test_each_action_gets_its_outcome_counted_and_logged_and_the_request_is_served(engine, caplog):
    eng = engine(tp=2)
    save_a_then_drop_hbm(eng)
    caplog.set_level("INFO", logger="kvtier.connectors.kv_hints")
    hints = envelope(("Pin", {"ttl_s": 600}), ("Pin", {"ttl_s": MAX_PIN_S * 10}), ("Retain", {"priority": 2}),
                     ("Demote", {}), ("Share", {}), ("Prefetch", {}), ("Teleport", {}), ("Pin", {"ttl_s": "x"}))
    b = turn(eng, "B", hints, kvtier={"session": "agent-7"})
    assert b.is_finished() and eng.load_errors == set()
    assert eng.verified_tokens > 0
    for rank in (0, 1):
        side = worker_side(eng, rank)
        a_keys = side.namespace.keys(make_request("x", PREFIX).block_hashes)
        assert side.store.leases.keys_of(session_lease("agent-7")) >= set(a_keys), "the Pin leased A's prefix"
    data = eng.stats.data
    assert {k: v for k, v in data.items() if k.startswith("hint_")} == {  # each counted on both ranks
        "hint_Pin_accepted": 2, "hint_Pin_clipped": 2, "hint_Retain_accepted": 2, "hint_Demote_accepted": 2,
        "hint_Share_ignored": 2, "hint_Prefetch_ignored": 2, "hint_other_rejected": 2, "hint_Pin_rejected": 2}
    events = [r.getMessage() for r in caplog.records if "kvtier hint event" in r.getMessage()]
    assert sum("request B Teleport rejected (unknown action" in e for e in events) == 2
    assert sum("request B Pin rejected (payload ttl_s" in e for e in events) == 2


@pytest.mark.parametrize("bad", [envelope(("Pin", {"ttl_s": 60}), version="2"),
                                 envelope(("Pin", {"ttl_s": 60}), action_version="7")])
def test_a_malformed_envelope_or_action_is_rejected_counted_and_the_request_served(engine, bad):
    eng = engine()
    save_a_then_drop_hbm(eng)
    b = turn(eng, "B", bad, kvtier={"session": "agent-7"})
    assert b.is_finished() and eng.load_errors == set()
    assert worker_side(eng).store.stats()["get_hits"] == 5, "B still loaded A's prefix"
    assert session_lease("agent-7") not in worker_side(eng).store.leases, "nothing was pinned"
    assert sum(v for k, v in eng.stats.data.items() if k.endswith("_rejected")) == 1
    assert not any(k.startswith("hint_") and not k.endswith("_rejected") for k in eng.stats.data)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pin_keeps_the_prefix_through_pressure(engine, pinned):
    """Negative control (``pinned=False``: the same turn with a Share only): the pressure evicts the prefix."""
    eng = engine(dram_capacity="96KiB")
    save_a_then_drop_hbm(eng)
    hints = envelope(("Pin", {"ttl_s": 600})) if pinned else envelope(("Share", {}))
    turn(eng, "B", hints)
    eng.wait_idle_transfers()
    side = worker_side(eng)
    a_keys = side.namespace.keys(make_request("x", PREFIX).block_hashes)
    assert side.store.contains(a_keys) == [True] * 5
    bb = side.store.block_bytes
    other = [bytes([7, i]) * 8 for i in range(2 * (96 << 10) // bb)]  # twice the DRAM
    for k in other:
        side.store.put([k], blocks_for([k], bb))
    assert side.store.contains(a_keys) == [pinned] * 5


def test_a_demote_reaches_the_policy_as_the_requests_agents_priority(engine):
    eng = engine()
    save_a_then_drop_hbm(eng)
    tier = worker_side(eng).store.tiers[0]
    seen = []
    real = tier.observe

    def observe(batch):
        seen.append(batch)
        real(batch)

    tier.observe = observe
    turn(eng, "B", envelope(("Demote", {})))  # no session named: the policy infers B's agent (A's) by its chain
    arrivals = [a for batch in seen for a in batch.arrivals if a.request == "B"]
    hints = [h for batch in seen for h in batch.hints if h.priority is not None]
    assert len(arrivals) == 1 and arrivals[0].session is not None
    assert [(h.session, h.priority) for h in hints] == [(arrivals[0].session, -1.0)]


def test_requests_without_an_envelope_send_none():
    """The common case costs nothing: no note, no metadata entry."""
    from kvtier.connectors.vllm.hints import kv_hints_note

    req = make_request("R", PREFIX)
    assert req.kv_hints is None and kv_hints_note(req, (), None) is None
    req.kv_hints = envelope(("Share", {}))
    note = kv_hints_note(req, (b"h",), None)
    assert note is not None and note.req_id == "R" and note.session is None and note.envelope is req.kv_hints


def test_a_first_turns_pin_is_deferred_then_leases_its_blocks_once_they_are_saved(engine):
    """A first turn's blocks are not stored when it arrives: the Pin is deferred, then applied when the request's
    saves are done, and the blocks survive pressure."""
    eng = engine(dram_capacity="96KiB")
    a = make_request("A", PREFIX + [5, 6, 7])
    a.kv_hints = envelope(("Pin", {"ttl_s": 600}))
    eng.add(a)
    eng.run([a])
    eng.wait_idle_transfers()
    side = worker_side(eng)
    a_keys = side.namespace.keys(make_request("x", PREFIX).block_hashes)
    assert side.store.leases.keys_of(session_lease("A")) == set(a_keys), "leased under the request's id"
    data = eng.stats.data
    assert data["hint_Pin_deferred"] == 1 and data["hint_Pin_accepted"] == 1
    bb = side.store.block_bytes
    for k in [bytes([8, i]) * 8 for i in range(2 * (96 << 10) // bb)]:
        side.store.put([k], blocks_for([k], bb))
    assert side.store.contains(a_keys) == [True] * 5


def _in(tier, keys) -> int:
    return sum(tier.contains(keys))


@pytest.mark.parametrize("hinted", [True, False])
def test_a_prefetch_brings_the_agents_prefix_up_from_the_ssd(engine, tmp_path, hinted):
    """With an SSD under DRAM the worker's store runs a Prefetcher: B's Prefetch (B's prefix is in vLLM's own
    cache, so no load of B's brings it) copies A's prefix from the SSD back into DRAM. Negative control
    (``hinted=False``: a Share instead): it stays on the SSD."""
    eng = engine(dram_capacity="96KiB", ssd_path=str(tmp_path / "ssd"), ssd_capacity="4MiB")
    a = make_request("A", PREFIX + [5, 6, 7])
    eng.add(a)
    eng.run([a])
    eng.wait_idle_transfers()
    side = worker_side(eng)
    store, prefetch = side.store, side.prefetch
    assert prefetch is not None
    dram, ssd = store.tiers
    a_keys = side.namespace.keys(make_request("x", PREFIX).block_hashes)
    bb = store.block_bytes
    other = [bytes([7, i]) * 8 for i in range(2 * (96 << 10) // bb)]  # twice the DRAM: A's prefix goes down
    for k in other:
        store.put([k], blocks_for([k], bb))
    assert store.flush(10)
    store.remove(other)  # DRAM has room again; A's prefix is on the SSD alone
    assert (_in(dram, a_keys), _in(ssd, a_keys)) == (0, 5)
    b = make_request("B", PREFIX + [9] * 20, kvtier={"session": "agent-7"})
    b.kv_hints = envelope(("Prefetch", {}) if hinted else ("Share", {}))
    eng.add(b)
    while not b.is_finished():
        eng.step()
        # B's completion would replace the asked-for job with an idle agent's (predicted nothing yet: dropped),
        # so the driver thread gets the time to move it first.
        deadline = time.monotonic() + 10
        while prefetch.prefetcher.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
    eng.wait_idle_transfers()
    data = eng.stats.data
    if hinted:
        assert data["hint_Prefetch_accepted"] == 1
        assert _in(dram, a_keys) == 5, "A's prefix was brought up into DRAM"
        assert data["prefetch_blocks"] == 5 and data["prefetch_from_ssd_blocks"] == 5
    else:
        assert data["hint_Share_ignored"] == 1 and "hint_Prefetch_accepted" not in data
        assert _in(dram, a_keys) == 0 and not data.get("prefetch_blocks")


@pytest.mark.parametrize("extra", [{}, {"prefetch": False}])
def test_no_prefetcher_without_a_tier_below_dram_or_with_prefetch_off(engine, tmp_path, extra):
    """DRAM alone has nothing below to bring up, and ``prefetch: false`` turns it off: a Prefetch is ignored."""
    ssd = {"ssd_path": str(tmp_path / "ssd"), "ssd_capacity": "4MiB"} if extra else {}
    eng = engine(**ssd, **extra)
    save_a_then_drop_hbm(eng)
    assert worker_side(eng).prefetch is None
    turn(eng, "B", envelope(("Prefetch", {})))
    assert eng.stats.data["hint_Prefetch_ignored"] == 1


def test_a_prefetch_of_a_prefix_longer_than_dram_is_clipped(engine, tmp_path):
    eng = engine(dram_capacity="96KiB", ssd_path=str(tmp_path / "ssd"), ssd_capacity="4MiB")
    dram_blocks = (96 << 10) // worker_side(eng).store.block_bytes
    c = make_request("C", list(range(300, 300 + (dram_blocks + 2) * 16)) + [1])
    c.kv_hints = envelope(("Prefetch", {}))
    eng.add(c)
    eng.run([c])
    assert eng.stats.data["hint_Prefetch_clipped"] == 1 and "hint_Prefetch_accepted" not in eng.stats.data
