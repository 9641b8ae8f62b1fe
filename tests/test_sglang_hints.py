"""SGLang's standard agent hints (``GenerateReqInput.kv_hints``) reaching kvtier's HiCache backend through kvtier's
SGLang plugin (connectors/sglang/hints.py), on SGLang 0.5.23's real code: the plugin is loaded by SGLang's own
``load_plugins`` (the entry point in pyproject.toml), a request goes the way an HTTP ``/generate`` body goes (parsed
into GenerateReqInput as FastAPI does, normalized, made a TokenizedGenerateReqInput, sent over a real zmq socket with
SGLang's own wire encoding, made a Req as the scheduler makes it), and its pages are stored by SGLang's own radix
cache and backup threads (tests/sglang_harness.py). Each action's outcome is counted; the effects: a Pin survives
pressure that evicts its unpinned twin, a Demote goes first (and without it the same prefix stays), a Prefetch
brings the request's prefix up from the SSD. And prefetch between turns with no hint: with an SSD under DRAM the
backend's store runs a Prefetcher that hears of every request through the same hooks, and an idle agent's prefix
comes back up into DRAM before its next turn (``prefetch`` off: it stays on the SSD).
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import Counter

import pytest
from conftest import blocks_for
from sglang_harness import SKIP_REASON, sglang_available

if not sglang_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

import zmq  # noqa: E402
from sglang_harness import RadixServer, install  # noqa: E402

install()

from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()  # what every SGLang scheduler process does first: finds kvtier's entry point, applies its hooks

from kvtier.connectors.sglang import hints  # noqa: E402

if not hints._loaded:  # kvtier installed before its entry point existed: the first test fails on that; the rest
    from sglang.srt.plugins.hook_registry import HookRegistry  # still test the hooks, registered as SGLang would

    hints.register()
    HookRegistry.apply_hooks()

from pydantic import TypeAdapter  # noqa: E402
from sglang.srt.managers.io_struct import (  # noqa: E402
    GenerateReqInput,
    TokenizedGenerateReqInput,
    sock_recv,
    sock_send,
)
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from kvtier.connectors.kv_hints import MAX_PIN_S  # noqa: E402

PS = 4
PAGE_BYTES = 768  # an MHA page_first page of the harness's pool: 4 tokens x 3 layers x 2 heads x 8 dims x bf16, K+V
DRAM_PAGES = 24
SSD = {"ssd_capacity": "1MiB", "ssd_direct_io": "false", "ssd_fsync": False}  # with an ssd_path: a tier below DRAM
# The agents' think time the policy learns: an agent idle much longer than its gaps is predicted never back (and
# gets no prefetch), so it must be well above the prefetch driver's tick (50 ms) on a loaded machine.
GAP_S = 0.4


def envelope(*actions: tuple[str, dict]) -> dict:
    """A kv_hints envelope as an HTTP body carries it (SGLang's field names; versions are strings)."""
    return {"protocol_version": "1", "message_id": "m", "actions": [
        {"action_id": str(i), "action_type": kind, "action_version": "1", "payload": payload}
        for i, (kind, payload) in enumerate(actions)]}


@pytest.fixture
def wire():
    """The tokenizer -> scheduler hop: a real zmq socket pair, SGLang's own sock_send / sock_recv."""
    ctx = zmq.Context()
    send, recv = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    recv.bind("inproc://kvtier-hints")
    send.connect("inproc://kvtier-hints")
    yield send, recv
    send.close(0)
    recv.close(0)
    ctx.term()


def submit(wire, tokens: list[int], kv_hints: dict | None, rid: str, **body) -> Req:
    """A ``/generate`` body the way SGLang's server takes it, up to the Req the scheduler makes of it."""
    obj = TypeAdapter(GenerateReqInput).validate_python(  # FastAPI's parse of the JSON body
        {"input_ids": tokens, "rid": rid, "sampling_params": {"max_new_tokens": 1}, "kv_hints": kv_hints, **body})
    obj.normalize_batch_and_arguments()  # TokenizerManager.generate_request: kv_hints -> KvHintsEnvelope
    sampling = SamplingParams(**obj.sampling_params)
    sampling.normalize(None)  # as the TokenizerManager does (no tokenizer needed without stop strings)
    tokenized = TokenizedGenerateReqInput(  # TokenizerManager._create_tokenized_object, the fields a Req needs
        input_text=None, input_ids=array("q", obj.input_ids), input_embeds=None, mm_inputs=None, token_type_ids=None,
        sampling_params=sampling, return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False, rid=obj.rid, session_id=obj.session_id,
        kv_hints=obj.kv_hints, extra_key=obj.extra_key, cache_salt=obj.cache_salt)
    send, recv = wire
    sock_send(send, tokenized)
    got = sock_recv(recv)
    # Scheduler._create_generation_req: Req(...) with these of the TokenizedGenerateReqInput's fields.
    return Req(got.rid, got.input_text, got.input_ids, got.sampling_params, kv_hints=got.kv_hints,
               extra_key=got.extra_key, cache_salt=got.cache_salt, session_id=got.session_id)


def prompt(pages: int, start: int) -> list[int]:
    return list(range(start, start + pages * PS))


@pytest.fixture
def server():
    made: list[RadixServer] = []

    def make(**extra) -> RadixServer:
        s = RadixServer(kind="mha", layout="page_first", extra={"dram_capacity": DRAM_PAGES * PAGE_BYTES, **extra},
                        tokens=2048)
        assert s.backend.pages.block_bytes == PAGE_BYTES
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def compute(s: RadixServer, tokens: list[int], seed: int) -> None:
    """The server computes ``tokens``; SGLang backs the pages up to host memory, then to kvtier."""
    s.insert(tokens, seed)
    assert s.pump(s.backed_up)


def stored(s: RadixServer, tokens: list[int]) -> int:
    return s.backend.batch_exists(s.backend_keys(tokens))


def test_sglang_loads_the_plugin_from_its_entry_point_and_this_sglang_has_what_it_reads():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("kvtier_hints") == "kvtier.connectors.sglang.hints:register", \
        "reinstall kvtier (pip install -e .): its sglang.srt.plugins entry point is missing"
    assert hints.check_sglang() == [] and hints._problem is None
    fn = Req.__init__  # the hook wraps Req.__init__ (HookRegistry keeps the original as __wrapped__)
    assert getattr(fn, "__wrapped__", None) is not None


def test_a_pin_sent_through_kv_hints_survives_pressure_that_evicts_its_unpinned_twin(server, wire):
    s = server()
    pinned, twin = prompt(4, 1000), prompt(4, 2000)
    submit(wire, pinned, envelope(("Pin", {"ttl_s": 60})), "agent-a")
    assert s.backend.stats()["hints"] == {"hint_Pin_deferred": 1}  # a first turn: nothing stored yet
    compute(s, pinned, 1)  # SGLang stores its pages: the Pin waiting for them leases them
    assert s.backend.stats()["hints"] == {"hint_Pin_accepted": 1}
    assert s.backend.store.leases.leased_keys == 4  # exactly the request's pages, in the backend's namespace
    compute(s, twin, 2)  # the same shape, stored later, no hint
    for i in range(6):  # 24 more pages into a 24-page DRAM
        compute(s, prompt(4, 10_000 + 100 * i), 3 + i)
    assert s.backend.store.tiers[0].stats().evictions >= 8
    assert stored(s, pinned) == 4
    assert stored(s, twin) == 0  # the negative control: the unpinned twin went


def finish(req: Req, token: int = 7) -> None:
    """The decode step that ends ``req`` (max_new_tokens 1): one output token, then SGLang's own finish check."""
    req.output_ids.append(token)
    req.update_finish_state()
    assert req.finished()


def _warm(wire) -> None:
    """Two agents come back after each turn, through SGLang: hinted requests that finish and return with their
    context extended. The default policy (pnu) learns from these completions that agents come back, and only then
    ranks agents (and so priorities); before, it evicts in LRU order."""
    for turn in range(4):
        for agent, start in (("w1", 50_000), ("w2", 60_000)):
            finish(submit(wire, prompt(1 + turn, start), envelope(("Share", {})), f"{agent}-{turn}"))


@pytest.mark.parametrize("demote", [True, False])
def test_a_demoted_prefix_goes_first(server, wire, demote):
    """B then A arrive and are stored; then other agents' prompts press on DRAM. With A demoted its pages go
    first, though A is the more recent; without the Demote (the control) B goes and A stays."""
    s = server()
    _warm(wire)
    a, b = prompt(4, 1000), prompt(4, 2000)
    submit(wire, b, envelope(("Share", {})), "agent-b")
    submit(wire, a, envelope(("Demote" if demote else "Share", {})), "agent-a")
    compute(s, b, 1)
    compute(s, a, 2)
    for i in range(5):  # 20 pages of other agents: 4 pages must go
        other = prompt(4, 10_000 + 100 * i)
        submit(wire, other, envelope(("Share", {})), f"agent-{i}")
        compute(s, other, 3 + i)
    counts = s.backend.stats()["hints"]
    assert counts.get("hint_Demote_accepted", 0) == (1 if demote else 0)
    assert counts["hint_Share_ignored"] == 8 + (6 if demote else 7)
    assert (stored(s, a), stored(s, b)) == ((0, 4) if demote else (4, 0))


def test_every_action_has_its_outcome_counted_and_logged(server, wire, caplog):
    s = server()
    turn = prompt(4, 1000)
    compute(s, turn, 1)  # an earlier turn stored the prefix
    caplog.set_level(logging.INFO, logger="kvtier.connectors.kv_hints")
    submit(wire, turn + prompt(1, 5000), envelope(
        ("Prefetch", {}), ("Pin", {"ttl_s": 10 * MAX_PIN_S}), ("Retain", {"priority": 2}), ("Demote", {}),
        ("Share", {}), ("Teleport", {}), ("Pin", {"ttl_s": "soon"})), "agent-a")
    assert s.backend.stats()["hints"] == {
        "hint_Prefetch_ignored": 1,  # no prefetcher: DRAM alone has nothing below it to bring up
        "hint_Pin_clipped": 1, "hint_Retain_accepted": 1, "hint_Demote_accepted": 1, "hint_Share_ignored": 1,
        "hint_other_rejected": 1, "hint_Pin_rejected": 1}
    events = [r.getMessage() for r in caplog.records if "kvtier hint event" in r.getMessage()]
    assert len(events) == 7 and all("request agent-a" in e for e in events)
    assert s.backend.store.leases.leased_keys == 4  # the stored pages; the 5th page is not stored yet
    compute(s, turn + prompt(1, 5000), 2)
    assert s.backend.store.leases.leased_keys == 5  # the Pin took the new page as SGLang stored it
    assert s.backend.stats()["hints"] == {}  # ... silently: its outcome was counted at arrival
    assert s.backend.hints.pending() == 0


def test_a_request_without_kv_hints_costs_nothing_and_a_salted_one_maps_to_sglangs_keys(server, wire):
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    s = server()
    submit(wire, prompt(4, 1000), None, "plain")
    assert s.backend.stats()["hints"] == {}
    tokens = prompt(3, 1000)
    req = submit(wire, tokens, envelope(("Share", {})), "salted", extra_key="tenant-1", cache_salt="s")
    request = hints.RequestHints(req.rid, req.kv_hints, req.origin_input_ids, req.extra_key, req.cache_salt)
    sglang_keys = get_storage_hash_str(RadixKey(array("q", tokens), extra_key="tenant-1", cache_salt="s"),
                                       None, page_size=PS)  # SGLang's own page keys of that request
    assert s.backend.hints.keys(request) == s.backend.page_store.keys(sglang_keys)
    assert sglang_keys != s.backend_keys(tokens)  # the namespace seed matters


def test_an_sglang_without_what_kvtier_reads_answers_every_action_ignored(server, wire, monkeypatch, caplog):
    from sglang.srt.managers import schedule_batch
    from sglang.srt.plugins.hook_registry import HookRegistry

    class OlderReq:  # a Req without the request namespace and session kvtier reads
        def __init__(self, rid, origin_input_text, origin_input_ids, sampling_params, kv_hints=None):
            pass

    registered = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, *a, **k: registered.append(a)))
    monkeypatch.setattr(hints, "_problem", None)
    monkeypatch.setattr(schedule_batch, "Req", OlderReq)
    caplog.set_level(logging.WARNING, logger="kvtier.connectors.sglang.hints")
    hints.register()
    monkeypatch.setattr(schedule_batch, "Req", Req)
    assert [r.getMessage() for r in caplog.records] == [
        f"kvtier: {hints._problem}: every agent hint (kv_hints) will be answered 'ignored'"]
    assert "lacks extra_key, cache_salt, session_id, Req.update_finish_state, Req.finished (" in hints._problem
    assert [r[0] for r in registered] == [hints.TARGET]  # no completion hook either
    s = server()
    submit(wire, prompt(4, 1000), envelope(("Pin", {"ttl_s": 60}), ("Demote", {})), "agent-a")
    assert s.backend.stats()["hints"] == {"hint_Pin_ignored": 1, "hint_Demote_ignored": 1}
    assert s.backend.store.leases.leased_keys == 0

    class NoHintsReq:  # a Req from before kv_hints: no hook at all
        def __init__(self, rid, origin_input_ids):
            pass

    caplog.clear()
    registered.clear()
    monkeypatch.setattr(schedule_batch, "Req", NoHintsReq)
    hints.register()
    monkeypatch.setattr(schedule_batch, "Req", Req)
    assert registered == [] and len(caplog.records) == 1
    assert "requests carry no agent hints" in caplog.records[0].getMessage()


@pytest.mark.parametrize("prefetcher", [False, True])
def test_a_hinted_requests_completion_reaches_the_policy_once_with_sglangs_stop_reason(server, wire, tmp_path,
                                                                                        prefetcher):
    """Without a Prefetcher only hinted requests are reported; with one (an SSD under DRAM) every request is, so
    the Prefetcher learns the idle agents of clients that send no hints."""
    s = server(ssd_path=str(tmp_path / "ssd"), **SSD) if prefetcher else server()
    assert (s.backend.prefetch is not None) == prefetcher
    seen = []
    s.backend.store.add_watcher(seen.append)
    req = submit(wire, prompt(2, 1000), envelope(("Share", {})), "agent-a")
    plain = submit(wire, prompt(2, 3000), None, "plain")
    finish(req)
    req.update_finish_state()  # a finished request's later steps: no second completion
    finish(plain)  # no hints: observed only for a Prefetcher
    plain.update_finish_state()
    arrivals = [a.request for batch in seen for a in batch.arrivals]
    completions = [(c.request, c.stop) for batch in seen for c in batch.completions]
    if prefetcher:
        assert arrivals == ["agent-a", "plain"] and completions == [("agent-a", "length"), ("plain", "length")]
    else:
        assert arrivals == ["agent-a"] and completions == [("agent-a", "length")]
    assert s.backend.stats()["hints"] == {"hint_Share_ignored": 1}  # the plain request has no outcome
    assert hints.stop_reason({"type": "stop", "matched": 128008}) == "stop:128008"
    assert hints.stop_reason({"type": "abort", "message": "x"}) == "abort"
    assert hints.stop_reason(None) is None


def test_a_backend_started_without_the_plugin_says_hints_are_not_seen(server, monkeypatch, caplog):
    monkeypatch.setattr(hints, "_loaded", False)
    caplog.set_level(logging.WARNING, logger="kvtier.connectors.sglang.hints")
    server()
    assert [r.getMessage() for r in caplog.records if "kv_hints are not seen" in r.getMessage()]


def test_pins_waiting_for_their_pages_are_bounded(server, wire, monkeypatch):
    monkeypatch.setattr(hints, "MAX_PENDING", 3)
    s = server()
    for i in range(5):
        submit(wire, prompt(2, 1000 + 100 * i), envelope(("Pin", {"ttl_s": 60})), f"r{i}")
    assert s.backend.hints.pending() == 3
    compute(s, prompt(2, 1000), 1)  # r0 was forgotten: its pages stored, nothing leased
    assert s.backend.store.leases.leased_keys == 0
    compute(s, prompt(2, 1400), 2)  # r4 waits: leased
    assert s.backend.store.leases.leased_keys == 2 and s.backend.hints.pending() == 2



def tiers(s: RadixServer, tokens: list[int]) -> tuple[int, int]:
    """How many of the prompt's pages kvtier's DRAM and SSD hold."""
    keys = s.backend.page_store.keys(s.backend_keys(tokens))
    dram, ssd = s.backend.store.tiers
    return sum(dram.contains(keys)), sum(ssd.contains(keys))


def push_down(s: RadixServer) -> None:
    """Other blocks, twice DRAM, put straight into the store, then removed: what DRAM held goes down to the SSD
    (``ssd_offload`` on_evict, the default), and DRAM has room again."""
    store = s.backend.store
    other = [bytes([7, i]) * 8 for i in range(2 * DRAM_PAGES)]
    for k in other:
        store.put([k], blocks_for([k], store.block_bytes))
    assert store.flush(10)
    store.remove(other)


def wait_for(done, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("prefetch", [True, False])
def test_an_idle_agents_prefix_comes_up_from_the_ssd_before_its_next_turn_with_no_hint(server, wire, tmp_path,
                                                                                         prefetch):
    """No request carries kv_hints. Agent A's turn is stored, its pages pushed down to the SSD while it runs; other
    agents meanwhile come back after each of their turns (the policy learns to predict returns). When A's turn
    ends, the backend's Prefetcher brings its pages up into DRAM before A's next turn arrives. With ``prefetch`` off
    (the negative control) the backend runs no Prefetcher and the pages stay on the SSD."""
    s = server(ssd_path=str(tmp_path / "ssd"), prefetch=prefetch, **SSD)
    assert (s.backend.prefetch is not None) == prefetch
    a = prompt(6, 1000)
    req = submit(wire, a, None, "a-0")
    compute(s, a, 1)
    assert tiers(s, a) == (6, 0)
    push_down(s)
    assert tiers(s, a) == (0, 6)
    for turn in range(4):  # two agents whose turns extend their context, back GAP_S after each completion
        if turn:
            time.sleep(GAP_S)
        for agent, start in (("w1", 50_000), ("w2", 60_000)):
            finish(submit(wire, prompt(1 + turn, start), None, f"{agent}-{turn}"))
    finish(req)  # A is idle now (a tool call): predicted back in about GAP_S
    if prefetch:
        assert wait_for(lambda: tiers(s, a)[0] == 6), f"A's pages were not brought up: {tiers(s, a)}"
    else:
        time.sleep(0.5)  # ten ticks of a driver, had there been one
        assert tiers(s, a) == (0, 6)
    submit(wire, a + prompt(1, 5000), None, "a-1")  # A's next turn
    counts = s.backend.stats()["prefetch"]
    if prefetch:
        assert counts["prefetch_blocks"] == 6 and counts["prefetch_from_ssd_blocks"] == 6
        assert counts["prefetch_used_blocks"] == 6 and counts["prefetch_wasted_blocks"] == 0
    else:
        assert counts == {}
    assert s.backend.stats()["hints"] == {}  # no hint was sent, none counted


@pytest.mark.parametrize("hinted", [True, False])
def test_a_prefetch_sent_through_kv_hints_brings_the_prefix_up_from_the_ssd(server, wire, tmp_path, hinted):
    """A's prefix was stored, then pushed down to the SSD; A's next turn carries a Prefetch: accepted, and its
    prefix comes up into DRAM (SGLang would find it there when it prefetches the turn's prefix from L3). The
    negative control sends a Share instead: the prefix stays on the SSD."""
    s = server(ssd_path=str(tmp_path / "ssd"), **SSD)
    a = prompt(6, 1000)
    compute(s, a, 1)
    push_down(s)
    assert tiers(s, a) == (0, 6)
    submit(wire, a + prompt(2, 5000), envelope(("Prefetch", {}) if hinted else ("Share", {})), "a-1")
    if hinted:
        counts: Counter[str] = Counter()  # stats() gives the counts since its last call: summed over the calls

        def took(field: str) -> dict[str, int]:
            got = s.backend.stats()
            counts.update(got["prefetch"])
            return got[field]

        assert took("hints") == {"hint_Prefetch_accepted": 1}
        assert wait_for(lambda: tiers(s, a)[0] == 6), f"A's pages were not brought up: {tiers(s, a)}"
        # the prefetcher counts a step's blocks just after they land in DRAM
        assert wait_for(lambda: took("prefetch") is not None and counts["prefetch_blocks"] >= 6), counts
        assert counts["prefetch_blocks"] == 6 and counts["prefetch_from_ssd_blocks"] == 6
    else:
        assert s.backend.stats()["hints"] == {"hint_Share_ignored": 1}
        time.sleep(0.5)
        assert tiers(s, a) == (0, 6) and not s.backend.stats()["prefetch"].get("prefetch_blocks")


def test_a_prefetch_of_a_prefix_longer_than_dram_is_clipped(server, wire, tmp_path):
    s = server(ssd_path=str(tmp_path / "ssd"), **SSD)
    submit(wire, prompt(DRAM_PAGES + 4, 1000), envelope(("Prefetch", {})), "a-1")
    assert s.backend.stats()["hints"] == {"hint_Prefetch_clipped": 1}
