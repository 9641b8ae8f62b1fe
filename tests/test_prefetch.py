"""Prefetch between turns (kvtier/prefetch/): a real store (DRAM over a real SSD tier), the session-aware policy
on a hand-moved clock. The idle agent's prefix comes up into DRAM before it returns, with the right bytes; a
prefetch never evicts a block predicted to be needed sooner (hypothesis); a prefetch that loses the race to its
agent's return is cancelled and its blocks are loaded once, never twice, never wrong."""

from __future__ import annotations

import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import blocks_for
from kvtier.policies import Arrival, Completion, Hint
from kvtier.prefetch import Prefetcher
from kvtier.tools.replay.replayer import VirtualClock  # a settable clock the store's policy reads
from kvtier.store import TieredStore

BB = 4096


def k(agent: int, depth: int) -> bytes:
    return (agent * 100_000 + depth).to_bytes(16, "little")


def chain(agent: int, n: int) -> list[bytes]:
    return [k(agent, d) for d in range(n)]


def make_store(path: str, clock: VirtualClock, dram_blocks: int, ssd_blocks: int = 512, **cfg) -> TieredStore:
    # dram_admission "last": running agents' puts evict the idle agent's blocks down to the SSD (the premise of
    # these scenarios); with "auto" above an SSD, DRAM's policy may decline the running agents' blocks instead.
    return TieredStore.from_config({"dram_capacity": dram_blocks * BB, "ssd_path": path, "ssd_capacity": ssd_blocks * BB,
                                    "ssd_direct_io": "false", "ssd_fsync": False, "ssd_staging_bytes": 0,
                                    "dram_admission": "last", **cfg}, BB, clock=clock)


class Agents:
    """Drives agents' turns through the store: arrival, the chain's new blocks put, completion."""

    def __init__(self, store: TieredStore, clock: VirtualClock) -> None:
        self.store, self.clock, self.n = store, clock, 0

    def turn(self, agent: int, keys: list[bytes], stop: str = "tool_use", took: float = 1.0) -> None:
        self.n += 1
        rid = f"r{self.n}"
        self.store.observe(arrivals=[Arrival(rid, keys, self.clock.now, f"a{agent}")])
        self.store.put(keys[::-1], blocks_for(keys[::-1], BB))  # tail first, as the replay and connectors do
        self.clock.now += took
        self.store.observe(completions=[Completion(rid, self.clock.now, stop)])

    def arrive(self, agent: int, keys: list[bytes]) -> None:
        self.n += 1
        self.store.observe(arrivals=[Arrival(f"r{self.n}", keys, self.clock.now, f"a{agent}")])

    def teach(self, agent: int, stop: str, gap: float, n: int = 2, loops: int = 4) -> None:
        """The agent comes back ``gap`` s after each ``stop``: the policy learns to predict (ReturnModel)."""
        for _ in range(loops):
            self.turn(agent, chain(agent, n), stop=stop)
            self.clock.now += gap

    def teach_two(self) -> None:
        """tool_use comes back in 5 s, end_turn in 60 s."""
        self.teach(1, "tool_use", 5.0)
        self.teach(2, "end_turn", 60.0)
        self.store.observe(hints=[Hint(session=f"a{a}", time=self.clock.now, finished=True) for a in (1, 2)])

    def push_out(self, agent: int) -> None:
        """``agent`` answered a human (back in ~60 s); four agents calling tools (back in ~5 s) push its
        blocks down to the SSD, then say they are finished (their blocks are the first to go from then on)."""
        self.turn(agent, chain(agent, 8), stop="end_turn")
        for a in range(10, 14):
            self.turn(a, chain(a, 4), stop="tool_use")
        self.store.observe(hints=[Hint(session=f"a{a}", time=self.clock.now, finished=True) for a in range(10, 14)])


def idle_agent_on_the_ssd(store: TieredStore, clock: VirtualClock) -> tuple[Prefetcher, Agents]:
    """A Prefetcher watching ``store`` from the start; the policy taught (teach_two), then agent 9's 8 blocks pushed
    down to the SSD by agents calling tools (push_out): a job to bring them up."""
    pf = Prefetcher(store)
    agents = Agents(store, clock)
    agents.teach_two()
    agents.push_out(9)
    return pf, agents


def where(store: TieredStore, keys: list[bytes]) -> list[str]:
    found = store.lookup_prefix(keys)
    return [t for t, n in found.runs for _ in range(n)] + ["none"] * (len(keys) - found.length)


def read_back(store: TieredStore, keys: list[bytes]) -> None:
    out = blocks_for(keys, BB).clone().zero_()
    assert store.get(keys, out) == [True] * len(keys)
    assert (out == blocks_for(keys, BB)).all(), "a prefetched block came back with other bytes"


def test_an_idle_agents_prefix_comes_up_from_the_ssd_before_it_returns(tmp_path):
    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16) as store:
        pf, agents = idle_agent_on_the_ssd(store, clock)
        assert "dram" not in where(store, chain(9, 8)) and where(store, chain(9, 8)) == ["ssd"] * 8
        assert pf.sessions() == ["a9"]
        moved = pf.step({"ssd": 3})  # a budget of 3 blocks from the SSD this step
        assert moved == {"ssd": 3} and where(store, chain(9, 8))[:3] == ["dram"] * 3
        pf.step({"ssd": 100})
        assert where(store, chain(9, 8)) == ["dram"] * 8 and pf.pending() == 0
        read_back(store, chain(9, 8))
        agents.arrive(9, chain(9, 9))
        assert pf.counts.prefetched == 8 and pf.counts.used == 8 and pf.counts.wasted == 0
        assert pf.counts.from_tier == {"ssd": 8}


def test_a_prefix_pushed_down_again_after_it_came_up_comes_up_again(tmp_path):
    """An agent that thinks for a minute: its prefix is up, then running agents push it down again (it is the one
    predicted back last); the parked job is queued again and brings it back before the agent returns."""
    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16) as store:
        pf, agents = idle_agent_on_the_ssd(store, clock)
        pf.step({"ssd": 100})
        assert where(store, chain(9, 8)) == ["dram"] * 8 and pf.pending() == 0
        for a in range(20, 24):  # agents calling tools: their blocks push agent 9's down to the SSD again
            agents.turn(a, chain(a, 4), stop="tool_use")
        store.observe(hints=[Hint(session=f"a{a}", time=clock.now, finished=True) for a in range(20, 24)])
        assert "ssd" in where(store, chain(9, 8))
        assert pf.sessions() == ["a9"], "the parked job was not queued again when its chain went down"
        pf.step({"ssd": 100})
        assert where(store, chain(9, 8)) == ["dram"] * 8 and pf.pending() == 0
        read_back(store, chain(9, 8))
        assert pf.counts.wasted > 0  # the first copies were evicted unused
        agents.arrive(9, chain(9, 9))
        assert pf.counts.used == 8 and pf.sessions() == []
        for a in range(30, 34):  # back (in flight): its chain is no longer watched, pushed down or not
            agents.turn(a, chain(a, 4), stop="tool_use")
        assert "a9" not in pf.sessions()


def test_parked_chains_hold_at_most_max_parked_keys(tmp_path):
    """A chain past the bound is not watched: pushed down again, it is not queued again (the test above, bounded)."""
    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16) as store:
        pf, agents = idle_agent_on_the_ssd(store, clock)
        pf.max_parked_keys = 7  # agent 9's chain is 8 keys: too many to watch
        pf.step({"ssd": 100})
        assert where(store, chain(9, 8)) == ["dram"] * 8 and pf.pending() == 0
        for a in range(20, 24):
            agents.turn(a, chain(a, 4), stop="tool_use")
        assert "ssd" in where(store, chain(9, 8)) and "a9" not in pf.sessions()


def test_without_a_prediction_a_prefetch_only_takes_free_slots(tmp_path):
    """LRU predicts nothing: DRAM full, nothing moves (negative control of the room rule)."""
    clock = VirtualClock()
    with TieredStore.from_config({"dram_capacity": 8 * BB, "ssd_path": str(tmp_path), "ssd_capacity": 64 * BB,
                                  "ssd_direct_io": "false", "ssd_staging_bytes": 0, "eviction": "lru"}, BB,
                                 clock=clock) as store:
        pf = Prefetcher(store)
        agents = Agents(store, clock)
        agents.turn(1, chain(1, 4))
        agents.turn(2, chain(2, 8))
        assert pf.step({"ssd": 100}) == {}
        assert where(store, chain(1, 4)) == ["ssd"] * 4


def test_an_explicit_prefetch_for_an_agent_the_policy_never_saw_takes_free_slots_only(tmp_path):
    """An operator's prefetch (Prefetcher.request) of keys no arrival named: the policy cannot rank the agent,
    so it gets DRAM's free slots (they evict nothing) and no more; the bytes are right."""
    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16) as store:
        agents = Agents(store, clock)
        agents.teach_two()
        keys = chain(7, 20)
        store.put(keys[::-1], blocks_for(keys[::-1], BB))  # no arrival: the blocks of no known agent
        store.put(chain(8, 12)[::-1], blocks_for(chain(8, 12)[::-1], BB))  # 12 more: 7's root-most go down
        store.remove(chain(8, 12))  # DRAM has free slots again
        below = where(store, keys).count("ssd")
        free = store.tiers[0].stats().capacity_bytes // BB - store.tiers[0].stats().blocks
        assert below > 0 and free > 0
        pf = Prefetcher(store)
        pf.request("operator-asked", keys)
        moved = pf.step({"ssd": 100})
        assert moved.get("ssd", 0) == min(free, below) > 0
        read_back(store, [key for key, t in zip(keys, where(store, keys)) if t == "dram"])


def test_a_prefetch_that_loses_the_race_is_a_normal_load(tmp_path):
    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16, ssd_promote=True) as store:  # the load promotes
        pf, agents = idle_agent_on_the_ssd(store, clock)
        pf.step({"ssd": 2})  # under way: 2 of 8 up
        cancelled = pf.counts.cancelled
        agents.arrive(9, chain(9, 8))  # the agent is back before the rest: the job is cancelled
        assert pf.pending() == 0 and pf.counts.cancelled - cancelled == 6
        assert pf.step({"ssd": 100}) == {}
        puts = store.tiers[0].stats().puts
        read_back(store, chain(9, 8))  # the demand load reads the rest from the SSD (promoted), right bytes
        assert store.tiers[0].stats().puts - puts == 6, "a block the prefetch brought up was copied again"
        assert where(store, chain(9, 8)) == ["dram"] * 8


def test_blocks_a_step_brought_up_count_though_their_agent_came_back_during_the_step(tmp_path):
    """The agent arrives while a step copies its blocks up (here: right after the store brought them up, before
    the step's bookkeeping): the job is cancelled, and what the step brought up is counted as prefetched, and as
    used once the agent reads it (it was counted nowhere before: the counts showed 0 for blocks in DRAM)."""
    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16) as store:
        pf, agents = idle_agent_on_the_ssd(store, clock)
        bring_up = store.bring_up

        def agent_back_meanwhile(*args, **kwargs):  # the real copy, then the arrival the step races with
            got = bring_up(*args, **kwargs)
            agents.arrive(9, chain(9, 9))
            return got

        store.bring_up = agent_back_meanwhile  # type: ignore[method-assign]
        assert pf.step({"ssd": 3}) == {"ssd": 3}
        assert pf.pending() == 0 and where(store, chain(9, 8))[:3] == ["dram"] * 3
        assert pf.counts.prefetched == 3 and pf.counts.from_tier == {"ssd": 3}
        read_back(store, chain(9, 3))
        assert pf.counts.used == 3 and pf.counts.wasted == 0


def test_a_finished_hint_cancels_the_prefetch(tmp_path):
    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16) as store:
        pf, agents = idle_agent_on_the_ssd(store, clock)  # its 8 blocks on the SSD, a job to bring them up
        assert pf.sessions() == ["a9"]
        cancelled = pf.counts.cancelled
        store.observe(hints=[Hint(session="a9", time=clock.now, finished=True)])
        assert pf.pending() == 0 and pf.counts.cancelled - cancelled == 8


def test_no_room_when_dram_holds_only_agents_needed_sooner(tmp_path):
    """DRAM is full of agents calling tools (back in ~5 s); the idle agent answered a human (back in ~60 s):
    its prefix stays on the SSD, and theirs in DRAM."""
    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16) as store:
        agents = Agents(store, clock)
        agents.teach_two()
        agents.turn(9, chain(9, 8), stop="end_turn")
        for a in range(10, 14):
            agents.turn(a, chain(a, 4), stop="tool_use")
        sooner = [key for a in range(10, 14) for key in chain(a, 4)]
        assert where(store, sooner) == ["dram"] * 16 and "dram" not in where(store, chain(9, 8))
        got = store.bring_up(chain(9, 8), "a9", 0, {"ssd": 100})
        assert got.why == "room" and got.keys == [] and got.done == 0
        assert where(store, sooner) == ["dram"] * 16


@settings(max_examples=20, deadline=None)
@given(gaps=st.lists(st.sampled_from([2.0, 5.0, 30.0, 120.0]), min_size=3, max_size=6),
       target=st.integers(0, 5), budget=st.integers(1, 40))
def test_a_prefetch_never_evicts_a_block_predicted_to_be_needed_sooner(gaps, target, budget):
    """Agents with learned gaps of different lengths fill DRAM; one idle agent's prefix comes up. Every block
    DRAM lost meanwhile belongs to an agent predicted back no sooner than that one (or to none)."""
    clock = VirtualClock()
    with tempfile.TemporaryDirectory() as d, make_store(d, clock, dram_blocks=24) as store:
        agents = Agents(store, clock)
        n = len(gaps)
        for a, gap in enumerate(gaps):  # each agent's stop reason comes back after its own gap
            agents.teach(a, f"s{gap}", gap, n=6, loops=3)
        # The last turns, then the chosen agent's prefix goes below DRAM behind the others'.
        x = target % n
        agents.turn(x, chain(x, 10), stop=f"s{gaps[x]}")
        for a in range(n):
            if a != x:
                agents.turn(a, chain(a, 6), stop=f"s{gaps[a]}")
        dram = store.tiers[0]
        backs = dict(zip(range(n), dram.predicted_back([f"a{a}" for a in range(n)])))
        before = {key for a in range(n) for key, t in zip(chain(a, 10), where(store, chain(a, 10))) if t == "dram"}
        got = store.bring_up(chain(x, 10), f"a{x}", 0, {"ssd": budget})  # what Prefetcher.step does per job
        after = {key for a in range(n) for key, t in zip(chain(a, 10), where(store, chain(a, 10))) if t == "dram"}
        assert sum(got.moved.values()) == len(got.keys) <= budget and set(got.keys) <= after
        mine = backs[x]
        for key in before - after:
            owner = int.from_bytes(key, "little") // 100_000
            other = backs[owner]
            assert mine is not None and owner != x and (other is None or other >= mine), (
                f"agent {owner} (back at {other}) lost a block to agent {x}'s prefetch (back at {mine})")
        read_back(store, [key for key in chain(x, 10) if key in after])


def test_the_driver_moves_jobs_in_real_time_and_prometheus_counts_bytes(tmp_path):
    """A PrefetchDriver thread brings the prefix up at a measured rate; the collector's exposition (checked by
    promtool where installed) counts it in bytes."""
    import shutil
    import subprocess
    import time

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.prefetch import PrefetchCollector, PrefetchDriver

    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16) as store:
        pf, agents = idle_agent_on_the_ssd(store, clock)
        registry = CollectorRegistry()
        registry.register(PrefetchCollector(pf))
        driver = PrefetchDriver(pf, tick_s=0.01, probe_blocks=2)
        try:
            deadline = time.monotonic() + 20
            while pf.pending() and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            driver.close()
        assert where(store, chain(9, 8)) == ["dram"] * 8
        read_back(store, chain(9, 8))
        agents.arrive(9, chain(9, 9))
        text = generate_latest(registry).decode()
        got = {s.labels.get("outcome", s.name): s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert got["prefetched"] == got["used"] == 8 * BB and got["wasted"] == 0
        assert got["kvtier_prefetch_jobs"] == 0
        promtool = shutil.which("promtool")
        if promtool:
            check = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True)
            assert check.returncode == 0, check.stderr.decode() + check.stdout.decode()


def ssd_holds(store: TieredStore, keys: list[bytes]) -> list[bool]:
    return list(store.tiers[1].contains(keys))


def test_a_prefetch_moves_blocks_up_out_of_the_ssd_and_evicting_them_writes_them_down_again(tmp_path):
    """on_evict (the SSD's default): DRAM and SSD hold distinct blocks, so a prefetched block leaves the SSD (no slot
    spent on a copy); when DRAM evicts it, it is written down again with its bytes: nothing is lost either way."""
    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16) as store:
        pf, agents = idle_agent_on_the_ssd(store, clock)
        assert ssd_holds(store, chain(9, 8)) == [True] * 8
        events = []
        store.add_listener(events.append)
        pf.step({"ssd": 100})
        assert where(store, chain(9, 8)) == ["dram"] * 8
        assert ssd_holds(store, chain(9, 8)) == [False] * 8, "a prefetched block stayed on the SSD too"
        assert sorted(k for e in events if (e.kind, e.tier) == ("removed", "ssd") for k in e.keys) == chain(9, 8)
        assert store.stats()["offloads"]["ssd"]["moved_up"] == 8
        read_back(store, chain(9, 8))
        for a in range(20, 26):  # agents back sooner than 9 fill DRAM: 9's blocks go down again
            agents.turn(a, chain(a, 4), stop="tool_use")
        assert ssd_holds(store, chain(9, 8)) == [True] * 8 and "none" not in where(store, chain(9, 8))
        read_back(store, chain(9, 8))


def test_with_write_through_a_prefetch_leaves_the_ssds_copy(tmp_path):
    """Negative control: write_through keeps every block on the SSD, so a prefetch copies (nothing moves)."""
    clock = VirtualClock()
    with make_store(str(tmp_path), clock, dram_blocks=16, ssd_offload="write_through") as store:
        pf, agents = idle_agent_on_the_ssd(store, clock)
        assert where(store, chain(9, 8)) == ["ssd"] * 8
        pf.step({"ssd": 100})
        assert where(store, chain(9, 8)) == ["dram"] * 8 and ssd_holds(store, chain(9, 8)) == [True] * 8
        assert store.stats()["offloads"]["ssd"].get("moved_up", 0) == 0
