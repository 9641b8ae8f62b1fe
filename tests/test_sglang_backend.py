"""KVTierHiCacheStorage built by SGLang's own StorageBackendFactory ("dynamic") on SGLang's real host pools
(MHATokenToKVPoolHost in 4 layouts, MLATokenToKVPoolHost in 3): the v1 calls bit-exact, partial hits, pages
missing mid-batch, failing tiers, every tier's path (DRAM slots, the node pool, SSD), the flat interface,
threads, the config's rules, KV events in SGLang's own format, metrics. Page bytes are checked against the
pool's own segment table (tests/sglang_harness.py).
"""

from __future__ import annotations

import threading

import pytest
from sglang_harness import MHA_LAYOUTS, MLA_LAYOUTS, SKIP_REASON, sglang_available

if not sglang_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
from bytecheck import assert_all_hits_exact, assert_no_wrong_bytes  # noqa: E402
from poolproc import PoolProcess  # noqa: E402
from sglang_harness import (  # noqa: E402
    device_pool,
    fill_pages,
    host_pool,
    install,
    make_backend,
    page_bytes,
    page_indices,
    storage_config,
)

install()

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from kvtier.config import ConfigError  # noqa: E402
from kvtier.connectors.sglang import KVTierHiCacheStorage  # noqa: E402
from kvtier.keys.hashers import SglangPageHasher  # noqa: E402

LAYOUTS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]
SEGMENTS = {("mha", "layer_first"): 6, ("mla", "layer_first"): 3, ("mla", "page_first"): 1,
            ("mla", "page_first_direct"): 1}  # the rest: 2 (K, V); 3 layers in these pools


def page_keys(n: int, start: int = 0) -> list[str]:
    """Real SGLang page keys (chained sha256) of a prompt."""
    return SglangPageHasher(4).hashes(list(range(1000 + start * 4, 1000 + (start + n) * 4)))


@pytest.fixture
def backends():
    made = []

    def make(kind: str = "mha", layout: str = "page_first", extra: dict | None = None, **config):
        host = host_pool(device_pool(kind), layout)
        backend = make_backend(host, {"dram_capacity": "4MiB", **(extra or {})}, **config)
        made.append(backend)
        return host, backend

    yield make
    for b in made:
        b.close()


# ---- the factory and the config ---------------------------------------------------------------------------


def test_the_factory_builds_it_and_sglangs_own_keys_pass():
    host = host_pool(device_pool("mha"), "page_first")
    cfg = storage_config({"dram_capacity": "1MiB", "prefetch_threshold": 4, "hicache_storage_pass_prefix_keys": True})
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert type(backend) is KVTierHiCacheStorage
    backend.close()


@pytest.mark.parametrize("extra, message", [
    ({"dram_capcity": "1GiB"}, "dram_capcity"),  # a typo of a store key: named, with the closest known key
    ({"staging_bytes": "lots"}, "staging_bytes"),
    ({"kv_events_endpoint": "5557"}, "kv_events_endpoint"),
    ({"mode": "sideways"}, "mode"),
])
def test_a_bad_key_stops_start_up_naming_it(extra, message):
    with pytest.raises(ConfigError, match=message):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)


def test_mla_with_tp_and_private_stores_is_refused_and_mla_keys_carry_no_tp_rank(backends, tmp_path):
    with pytest.raises(ConfigError, match="MLA model with TP 2 in mode 'embedded'"):
        StorageBackendFactory.create_backend("dynamic", storage_config({}, mla=True, tp_size=2, tp_rank=1), None)
    with PoolProcess(tmp_path, tcp=False, ipc=True, capacity="4MiB") as pool:
        shared = {"mode": "standalone", "pool": pool.ipc, "pool_timeout_ms": 2000}
        h0, r0 = backends("mla", "page_first", shared, tp_size=2, tp_rank=0)
        h1, r1 = backends("mla", "page_first", shared, tp_size=2, tp_rank=1)
        assert r0.page_store.keys(page_keys(3)) == r1.page_store.keys(page_keys(3))  # one copy for every rank
        data = fill_pages(h0, [1, 2, 3], seed=20)
        assert r0.batch_set_v1(page_keys(3), page_indices(h0, [1, 2, 3])) == [True] * 3  # the writer rank
        assert r1.batch_exists(page_keys(3)) == 3  # SGLang's MIN over the ranks is 3, not 0
        assert_all_hits_exact(r1.batch_get_v1(page_keys(3), page_indices(h1, [4, 5, 6])), page_bytes(h1, [4, 5, 6]),
                              data)
    _, m0 = backends("mha", "page_first", tp_size=2, tp_rank=0)
    _, m1 = backends("mha", "page_first", tp_size=2, tp_rank=1)
    _, solo = backends("mha", "page_first", tp_size=1)
    k0, k1, k = (b.page_store.keys(page_keys(3)) for b in (m0, m1, solo))
    assert not set(k0) & set(k1) and not set(k0) & set(k)  # MHA: per TP rank and per TP width


# ---- set / exists / get in every layout ---------------------------------------------------------------------


@pytest.mark.parametrize("kind, layout", LAYOUTS)
def test_pages_round_trip_bit_exact_in_every_layout(backends, kind, layout):
    host, backend = backends(kind, layout)
    assert backend.pages.segments == SEGMENTS.get((kind, layout), 2)
    keys = page_keys(5)
    data = fill_pages(host, [1, 2, 3, 4, 5], seed=1)
    assert backend.batch_set_v1(keys, page_indices(host, [1, 2, 3, 4, 5])) == [True] * 5
    fill_pages(host, [1, 2, 3, 4, 5], seed=2)  # SGLang reuses the host pages: the store kept its own copy
    assert backend.batch_exists(keys) == 5
    assert backend.batch_exists(keys + page_keys(2, start=50)) == 5
    hit = backend.batch_get_v1(keys, page_indices(host, [10, 11, 12, 13, 14]))
    assert_all_hits_exact(hit, page_bytes(host, [10, 11, 12, 13, 14]), data)
    # Another layout of the same model holds other bytes: a namespace of its own.
    other = "page_first" if layout != "page_first" else "layer_first"
    _, other_backend = backends(kind, other)
    assert not set(other_backend.page_store.keys(keys)) & set(backend.page_store.keys(keys))
    assert backend.stats()["pages"]["saved_in_place"] == 5


@pytest.mark.parametrize("kind, layout", [("mha", "layer_first"), ("mla", "page_first")])
def test_a_page_missing_mid_batch_gives_the_leading_count(backends, kind, layout):
    host, backend = backends(kind, layout)
    keys = page_keys(6)
    data = fill_pages(host, [1, 2, 3, 4, 5, 6], seed=3)
    backend.batch_set_v1(keys, page_indices(host, [1, 2, 3, 4, 5, 6]))
    backend.store.remove(backend.page_store.keys(keys[2:3]))  # page 2 evicted
    assert backend.batch_exists(keys) == 2
    hit = backend.batch_get_v1(keys, page_indices(host, [10, 11, 12, 13, 14, 15]))
    assert hit == [True, True, False, True, True, True]  # SGLang uses the leading run: 2 pages
    got = page_bytes(host, [10, 11, 13, 14, 15])
    assert got == [data[0], data[1], data[3], data[4], data[5]]
    assert backend.batch_exists([]) == 0 and backend.batch_get_v1([], page_indices(host, [])) == []


@pytest.mark.parametrize("kind, layout", [("mha", "layer_first"), ("mha", "page_first"), ("mla", "page_first")])
def test_pages_served_from_the_ssd_come_back_bit_exact(backends, tmp_path, kind, layout):
    host, backend = backends(kind, layout, {"dram_capacity": 8 * 768, "ssd_path": str(tmp_path),
                                            "ssd_capacity": "4MiB", "ssd_offload": "write_through"})
    keys = page_keys(20)
    data = fill_pages(host, list(range(1, 21)), seed=4)
    for lo in range(0, 20, 4):  # SGLang's batches are far smaller than DRAM; here DRAM holds 8 pages
        assert backend.batch_set_v1(keys[lo : lo + 4], page_indices(host, list(range(1 + lo, 5 + lo)))) == [True] * 4
    assert backend.store.flush(10)
    assert list(backend.store.tiers[0].contains(backend.page_store.keys(keys[:4]))) == [False] * 4  # evicted from DRAM
    assert backend.batch_exists(keys) == 20
    hit = backend.batch_get_v1(keys, page_indices(host, list(range(30, 50))))
    assert_all_hits_exact(hit, page_bytes(host, list(range(30, 50))), data)
    counts = backend.stats()["pages"]
    path = "loaded_direct" if backend.pages.contiguous else "loaded_staged"
    assert counts[path] >= 12 and counts["missed"] == 0  # the ones DRAM lost, read from the SSD


@pytest.mark.parametrize("kind, layout", [("mha", "page_first"), ("mla", "page_first")])
def test_standalone_pages_go_through_the_node_pool(backends, tmp_path, kind, layout):
    with PoolProcess(tmp_path, tcp=False, ipc=True, capacity="4MiB") as pool:
        shared = {"mode": "standalone", "pool": pool.ipc, "pool_timeout_ms": 2000}
        host, writer = backends(kind, layout, shared)
        reader_host, reader = backends(kind, layout, shared)  # another server of this host
        keys = page_keys(4)
        data = fill_pages(host, [1, 2, 3, 4], seed=5)
        assert writer.batch_set_v1(keys, page_indices(host, [1, 2, 3, 4])) == [True] * 4
        assert reader.batch_exists(keys) == 4
        hit = reader.batch_get_v1(keys, page_indices(reader_host, [8, 9, 10, 11]))
        assert_all_hits_exact(hit, page_bytes(reader_host, [8, 9, 10, 11]), data)
        staged = writer.stats()["pages"]["saved_staged"]
        assert staged == (0 if writer.pages.contiguous else 4)  # no DRAM slots to gather into: staging rows


# ---- failures are misses -------------------------------------------------------------------------------------


def test_a_dead_pool_is_a_miss_and_false_never_an_exception(backends, tmp_path):
    pool = PoolProcess(tmp_path, tcp=False, ipc=True, capacity="4MiB").start()
    host, backend = backends("mha", "layer_first", {"mode": "standalone", "pool": pool.ipc, "pool_timeout_ms": 300})
    keys = page_keys(3)
    fill_pages(host, [1, 2, 3], seed=6)
    assert backend.batch_set_v1(keys, page_indices(host, [1, 2, 3])) == [True] * 3
    pool.kill()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, page_indices(host, [5, 6, 7])) == [False] * 3
    assert backend.batch_set_v1(page_keys(2, start=9), page_indices(host, [1, 2])) == [False] * 2


def test_a_raising_tier_and_bad_arguments_are_misses(backends, monkeypatch):
    host, backend = backends("mha", "page_first")
    keys = page_keys(3)
    fill_pages(host, [1, 2, 3], seed=7)
    assert backend.batch_get_v1(keys, page_indices(host, [1, 2])) == [False] * 3  # 3 keys, 2 pages of indices
    assert backend.batch_set_v1(keys, page_indices(host, [1, 2])) == [False] * 3
    assert backend.batch_exists([None, 3]) == 0  # type: ignore[list-item]
    assert backend.batch_set_v1(keys, page_indices(host, [1, 2, 3])) == [True] * 3
    dram = backend.store.tiers[0]

    def broken(*args, **kwargs):
        raise OSError("injected DRAM tier failure")

    monkeypatch.setattr(dram, "acquire", broken)
    monkeypatch.setattr(dram, "contains", broken)
    monkeypatch.setattr(dram, "reserve", broken)
    assert backend.batch_get_v1(keys, page_indices(host, [5, 6, 7])) == [False] * 3
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(page_keys(2, start=5), page_indices(host, [1, 2])) == [False] * 2
    assert backend.batch_get(keys, [torch.zeros(10)] * 3) == [None] * 3
    monkeypatch.undo()
    assert backend.batch_get_v1(keys, page_indices(host, [5, 6, 7])) == [True] * 3  # the store itself is fine


def test_a_failed_gather_publishes_nothing(backends, monkeypatch):
    """put_in_place's fill raising (a page's segment table that lies) leaves no half-written page behind."""
    host, backend = backends("mha", "layer_first")
    keys = page_keys(2)
    fill_pages(host, [1, 2], seed=8)

    def fail(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(backend.pages, "to_blocks", fail)
    assert backend.batch_set_v1(keys, page_indices(host, [1, 2])) == [False] * 2
    assert backend.batch_exists(keys) == 0 and backend.store.stats()["tiers"]["dram"]["blocks"] == 0


# ---- the flat interface, threads, clear, hints, stats, events ------------------------------------------------


@pytest.mark.parametrize("kind, layout", [("mha", "layer_first"), ("mla", "page_first")])
def test_the_flat_interface_round_trips_and_keeps_its_own_namespace(backends, kind, layout):
    host, flat = backends(kind, layout, {"interface_v1": 0})
    _, v1 = backends(kind, layout)
    keys = page_keys(3)
    fill_pages(host, [1, 2, 3], seed=9)
    pages = [host.get_data_page(p * host.page_size, flat=True) for p in (1, 2, 3)]  # what SGLang hands over
    assert flat.batch_set(keys, pages) is True
    targets = [host.get_dummy_flat_data_page() for _ in keys]
    got = flat.batch_get(keys, targets)
    assert all(g is t for g, t in zip(got, targets))
    assert all(torch.equal(g.view(torch.uint8), p.view(torch.uint8)) for g, p in zip(got, pages))  # bytes: NaNs
    assert flat.exists(keys[0]) and flat.get(page_keys(1, start=40)[0], host.get_dummy_flat_data_page()) is None
    assert v1.batch_exists(keys) == 0  # SGLang's flat page order is not the v1 segment order


def test_concurrent_calls_from_sglangs_threads_stay_bit_exact(backends):
    host, backend = backends("mha", "layer_first", {"dram_capacity": 64 * 768})
    batches = [(page_keys(8, start=8 * b), list(range(1 + 8 * b, 9 + 8 * b))) for b in range(4)]
    data = {b: fill_pages(host, pages, seed=100 + b) for b, (_, pages) in enumerate(batches)}
    errors: list[BaseException] = []
    out_pages = {t: list(range(40 + 8 * t, 48 + 8 * t)) for t in range(4)}

    def worker(t: int) -> None:
        try:
            for i in range(30):
                b = (t + i) % 4
                keys, pages = batches[b]
                backend.batch_set_v1(keys, page_indices(host, pages))
                backend.batch_exists(keys)
                hit = backend.batch_get_v1(keys, page_indices(host, out_pages[t]))
                assert_no_wrong_bytes(hit, page_bytes(host, out_pages[t]), data[b])  # every hit, not all-or-none
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert backend.store.stats()["put_stored"] == 32  # every page stored once, whatever the races


def test_clear_drops_dram_and_ssd_pages(backends, tmp_path):
    host, backend = backends("mha", "page_first", {"dram_capacity": 4 * 768, "ssd_path": str(tmp_path),
                                                   "ssd_capacity": "1MiB", "ssd_offload": "write_through"})
    keys = page_keys(8)
    fill_pages(host, list(range(1, 9)), seed=10)
    for lo in range(0, 8, 2):
        backend.batch_set_v1(keys[lo : lo + 2], page_indices(host, [1 + lo, 2 + lo]))
    assert backend.store.flush(10) and backend.batch_exists(keys) == 8
    assert list(backend.store.tiers[0].contains(backend.page_store.keys(keys[:4]))) == [False] * 4  # on the SSD only
    assert backend.clear() is True
    assert backend.store.contains(backend.page_store.keys(keys)) == [False] * 8


def test_hints_in_extra_info_lease_the_pages(backends):
    host, backend = backends("mha", "page_first")
    keys = page_keys(3)
    fill_pages(host, [1, 2, 3], seed=11)
    info = HiCacheStorageExtraInfo(extra_info={"kvtier": {"session": "agent-7", "ttl_s": 60}})
    assert backend.batch_set_v1(keys, page_indices(host, [1, 2, 3]), info) == [True] * 3
    assert backend.store.pins.count(backend.page_store.keys(keys)[0]) >= 1


def test_get_stats_returns_storage_metrics_drained_on_read(backends):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    host, backend = backends("mha", "page_first", metrics=True)
    keys = page_keys(3)
    fill_pages(host, [1, 2, 3], seed=12)
    backend.batch_set_v1(keys, page_indices(host, [1, 2, 3]))
    backend.batch_get_v1(keys, page_indices(host, [4, 5, 6]))
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []


def test_l3_kv_events_carry_sglangs_own_block_hashes(backends, tmp_path):
    import msgspec
    from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    endpoint = f"ipc://{tmp_path}/events.sock"
    host, backend = backends("mha", "page_first", {"dram_capacity": 4 * 768, "ssd_path": str(tmp_path / "ssd"),
                                                   "ssd_capacity": "1MiB", "kv_events_endpoint": endpoint})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    keys = page_keys(6)
    fill_pages(host, list(range(1, 7)), seed=13)
    events: list = []
    deadline = 50
    while deadline and not any(isinstance(e, BlockStored) for e in events):  # PUB/SUB: the first batches race
        backend.batch_set_v1(keys[:1], page_indices(host, [1]))  # (a held page stores nothing new)
        backend.store.remove(backend.page_store.keys(keys[:1]))
        try:
            events += decoder.decode(sub.recv_multipart()[-1]).events
        except zmq.Again:
            pass
        deadline -= 1
    for lo in range(0, 6, 2):  # 6 pages, DRAM holds 4: 2 go to the SSD
        backend.batch_set_v1(keys[lo : lo + 2], page_indices(host, [1 + lo, 2 + lo]))
    assert backend.store.flush(10)
    backend.batch_exists(keys)  # publishes what the write-behind reported meanwhile
    want = {hash_str_to_int64(k) for k in keys}  # what SGLang's own BlockStored carries for these pages
    stored: dict[str, set] = {"EXTERNAL": set(), "DISK": set()}
    removed: set = set()
    while not stored["DISK"] or not want <= stored["EXTERNAL"]:
        for e in decoder.decode(sub.recv_multipart()[-1]).events:
            if isinstance(e, BlockStored):
                stored[e.medium].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                removed.update(e.block_hashes)
    assert want <= stored["EXTERNAL"] and stored["DISK"] <= want and removed <= want
    sub.close(0)


def test_segment_tables_follow_the_pools_own_meta(backends):
    """The copy tables address exactly what get_page_buffer_meta says (a negative control for the layouts: the
    same bytes through the wrong segment order fail the comparison)."""
    host, backend = backends("mha", "layer_first")
    data = fill_pages(host, [3], seed=14)
    seg = backend.pages.segment_ptrs(page_indices(host, [3]), 1)
    block = torch.empty(backend.pages.block_bytes, dtype=torch.uint8)
    backend.pages.to_blocks(seg, np.array([block.data_ptr()], dtype=np.uint64))
    assert block.numpy().tobytes() == data[0]
    swapped = seg[:, [1, 0, 3, 2, 5, 4]]  # V before K: the same bytes in another order
    backend.pages.to_blocks(swapped, np.array([block.data_ptr()], dtype=np.uint64))
    assert block.numpy().tobytes() != data[0]


def test_a_router_computes_the_backends_keys_from_token_ids(backends):
    """kvtier.keys.hashers: SglangPageHasher gives SGLang's own page keys (salted too), and sglang_namespace with the
    fingerprint the backend logs folds them into the keys the backend stores."""
    from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

    from kvtier.keys.hashers import sglang_namespace

    tokens = list(range(7, 7 + 4 * 5)) + [2**33] * 4
    assert SglangPageHasher(4).hashes(tokens) == get_hash_str(tokens, None, page_size=4)
    salted = get_hash_str(tokens, storage_namespace_seed("lora-7", "tenant"), page_size=4)
    assert SglangPageHasher(4, extra_key="lora-7", cache_salt="tenant").hashes(tokens) == salted
    _, backend = backends("mha", "page_first", tp_size=2, tp_rank=1)
    ns = sglang_namespace("test/model", backend.pages.fingerprint, tp_rank=1, tp_size=2)
    assert ns.keys(salted) == backend.page_store.keys(salted)
    assert sglang_namespace("test/model", backend.pages.fingerprint).keys(salted) != backend.page_store.keys(salted)
