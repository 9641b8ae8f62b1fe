"""HiCache v2 (batch_exists_v2 / batch_get_v2 / batch_set_v2) for hybrid models: KV + Mamba state, KV + SWA window,
and a KV-derived indexer pool, through SGLang's own HybridCacheController and its storage threads over SGLang's
real host pools (tests/sglang_hybrid.py says exactly what is SGLang's and what the test does in the radix tree's
place), plus the backend's v2 calls on real host pools directly for the bad-input rules, and the hit policies
against SGLang's own reference backend (HiCacheFile.batch_exists_v2).
"""

from __future__ import annotations

import pytest
from sglang_harness import SKIP_REASON, sglang_available

if not sglang_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang_harness import device_pool, host_budget, host_pool, install, make_backend, storage_config  # noqa: E402
from sglang_hybrid import PS, HybridController, mamba_host, page_keys, read_pages, write_random  # noqa: E402
from sglang_hybrid_radix import DsaRadixServer, MambaRadixServer, RadixServer, SwaRadixServer  # noqa: E402

install()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from kvtier.config import ConfigError  # noqa: E402
from kvtier.connectors.sglang.hits import PoolQuery, span_hits  # noqa: E402
from kvtier.connectors.sglang.identity import StorageIdentity  # noqa: E402
from kvtier.connectors.sglang.pools import UnsupportedModel, pool_identity  # noqa: E402

TRAILING, ALL = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES


@pytest.fixture(autouse=True)
def host_memory_budget():
    """Every host pool these tests build (directly, or in SGLang's assembly) is booked against an explicit budget
    (sglang_harness.host_budget: SGLang's own scope), not free RAM less SGLang's 10 GiB reserve."""
    with host_budget():
        yield


def prompt(pages: int, start: int = 1000) -> list[int]:
    return list(range(start, start + pages * PS))


@pytest.fixture
def controllers():
    made: list[HybridController] = []

    def make(sidecar: str, **kwargs) -> HybridController:
        c = HybridController(sidecar, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# ---- through SGLang's HybridCacheController ----------------------------------------------------------------


@pytest.mark.parametrize("sidecar", ["mamba", "swa"])
def test_a_prefix_comes_back_with_the_state_of_its_own_checkpoint(controllers, sidecar):
    """Two radix nodes (pages 0-3, 4-7) backed up with their sidecar (Mamba: the state at each node's end; SWA: the
    window's last 2 pages). A request for the prompt and more loads 8 pages of KV and the sidecar saved at page 8,
    bit-exact; a request that diverges at page 6 loads 4 pages and the sidecar saved at page 4 (not page 8's, which
    belongs to another position: the negative control)."""
    c = controllers(sidecar)
    tokens = prompt(8)
    saved = c.save(tokens, [4, 8], seed=1)
    assert saved.sidecar[4] != saved.sidecar[8]
    whole = c.load(tokens + prompt(2, start=7000))
    assert (whole.hit_tokens, whole.completed_tokens) == (8 * PS, 8 * PS)
    assert whole.kv == saved.kv and whole.sidecar == saved.sidecar[8]
    assert whole.pool_hits == {str(c.name): len(saved.sidecar[8])}
    fork = c.load(tokens[:6 * PS] + prompt(3, start=5000))
    assert (fork.hit_tokens, fork.completed_tokens) == (4 * PS, 4 * PS)  # KV holds 6 pages; state only at 4
    assert fork.kv == saved.kv[:4] and fork.sidecar == saved.sidecar[4] != saved.sidecar[8]


@pytest.mark.parametrize("sidecar", ["mamba", "swa"])
def test_kv_without_its_state_is_never_restorable(controllers, sidecar):
    """The KV pages are in kvtier (the v1 exists finds all 8) but no sidecar was saved with them: the v2 query
    answers no restorable length, so SGLang loads nothing rather than KV without its state or window."""
    c = controllers(sidecar)
    tokens = prompt(8)
    saved = c.save(tokens, [4, 8], seed=2, with_sidecar=False)
    assert c.backend.batch_exists(saved.keys) == 8
    result = c.backend.batch_exists_v2(saved.keys, [PoolTransfer(name=c.name, keys=["__placeholder__"],
                                                                 hit_policy=TRAILING)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    assert c.load(tokens).hit_tokens == 0


def test_an_indexer_page_missing_cuts_the_prefix_where_it_is_missing(controllers):
    """KV + Mamba + a KV-derived indexer (all_pages; the controller loads it with the KV batches through
    batch_get_v2): all three bit-exact; a second prompt whose second node was saved without its indexer pages is
    restorable only up to page 4, though KV and the Mamba state at page 8 are there."""
    c = controllers("mamba", indexer=True)
    tokens = prompt(8)
    saved = c.save(tokens, [4, 8], seed=3)
    got = c.load(tokens)
    assert got.completed_tokens == 8 * PS and got.kv == saved.kv and got.indexer == saved.indexer
    assert got.sidecar == saved.sidecar[8]
    other = prompt(8, start=3000)
    c.save(other[:4 * PS], [4], seed=4)
    c.save(other, [4, 8], seed=5, with_indexer=False)
    cut = c.load(other)
    assert (cut.hit_tokens, cut.completed_tokens) == (4 * PS, 4 * PS)


def test_a_restarted_server_restores_kv_and_state_from_the_ssd(controllers, tmp_path):
    """Embedded mode with an SSD, written through: every pool's store has its own SSD directory; a new controller
    on the same ssd_path loads the KV and the Mamba state from the SSD, bit-exact."""
    extra = {"dram_capacity": "1MiB", "ssd_path": str(tmp_path), "ssd_capacity": "8MiB", "ssd_segment_bytes": "1MiB",
             "ssd_offload": "write_through"}
    a = controllers("mamba", extra=extra)
    tokens = prompt(8)
    saved = a.save(tokens, [4, 8], seed=6)
    a.close()
    controllers_made = controllers  # a second "server"
    b = controllers_made("mamba", extra=extra)
    got = b.load(tokens)
    assert got.completed_tokens == 8 * PS and got.kv == saved.kv and got.sidecar == saved.sidecar[8]
    assert b.backend.pools.pools["mamba"].store.stats()["tiers"]["ssd"]["hits"] >= 1


def test_a_corrupted_state_on_the_ssd_is_a_counted_miss_never_loaded(controllers, tmp_path):
    """Checksums hold per pool: after a restart the Mamba state of page 8 has one byte flipped in its pool's SSD
    segment file. SGLang's query still sees it (existence is not a read), the KV pages load, the state's load
    fails its checksum: the IO thread reports no Mamba page, the staging slot never receives the bad bytes, and
    the SSD tier of the Mamba pool counts the failure (the KV pool's counts none)."""
    import os

    extra = {"dram_capacity": "1MiB", "ssd_path": str(tmp_path), "ssd_capacity": "8MiB", "ssd_segment_bytes": "1MiB",
             "ssd_offload": "write_through"}
    a = controllers("mamba", extra=extra)
    tokens = prompt(8)
    saved = a.save(tokens, [4, 8], seed=8)
    a.close()
    b = controllers("mamba", extra=extra)
    mamba = b.backend.pools.pools["mamba"]
    disk = mamba.store.tiers[1]
    key = mamba.page_store.keys([saved.keys[7]])[0]
    segment, offset = disk._files.place(disk._slot_of[key])
    fd = os.open(disk._files.path(segment), os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset + 3)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), offset + 3)
    finally:
        os.close(fd)
    got = b.load(tokens)
    assert got.completed_tokens == 8 * PS and got.kv == saved.kv
    assert got.pool_hits == {} and got.sidecar != saved.sidecar[8]
    assert disk.stats().extra["checksum_failures"] == 1
    kv_disk = b.backend.store.tiers[1].stats()
    assert kv_disk.hits == 8 and kv_disk.extra.get("checksum_failures", 0) == 0  # read from the SSD, intact


@pytest.mark.parametrize("change, hit", [({}, True), ({"temporal_dtype": torch.float16}, False),
                                         ({"conv_dtype": torch.float16}, False),
                                         ({"temporal_dtype": torch.float32}, False)])
def test_a_state_of_another_dtype_is_a_miss(controllers, tmp_path, change, hit):
    """A server whose Mamba state has another dtype (float16 instead of bfloat16: the same bytes per slot; or
    float32: another size) finds the KV pages of the same model on the same SSD but none of the states: no
    restorable length. The same dtypes (the positive control) restore."""
    extra = {"dram_capacity": "1MiB", "ssd_path": str(tmp_path), "ssd_capacity": "8MiB", "ssd_segment_bytes": "1MiB",
             "ssd_offload": "write_through"}
    base = {"temporal_dtype": torch.bfloat16, "conv_dtype": torch.bfloat16}
    a = controllers("mamba", extra=extra, mamba=base)
    tokens = prompt(8)
    a.save(tokens, [4, 8], seed=7)
    a.close()
    b = controllers("mamba", extra=extra, mamba={**base, **change})
    assert b.backend.batch_exists(HybridController.keys(tokens)) == 8  # the KV pages are there either way
    assert b.load(tokens).hit_tokens == (8 * PS if hit else 0)


# ---- the backend's v2 calls on real host pools ----------------------------------------------------------------


def hybrid_backend(extra_pools: dict, extra: dict | None = None, **config):
    """kvtier built by SGLang's factory and attached in SGLang's order with a KV pool and ``extra_pools``."""
    kv = host_pool(device_pool("mha", page_size=PS), "page_first")
    cfg = storage_config({"dram_capacity": "4MiB", **(extra or {})}, **config)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, kv)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    for name, pool in extra_pools.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return kv, backend


def test_restorable_prefix_pages_is_the_set_of_checkpoints():
    """Mamba states at pages 2 and 4 (not 3): restorable {2, 4}, not 1..4; the KV hit is 4 pages."""
    mamba = mamba_host()
    kv, backend = hybrid_backend({PoolName.MAMBA: mamba})
    try:
        keys = HybridController.keys(prompt(5))
        kv_idx = kv.alloc(5 * PS)
        write_random(kv, kv_idx, 1)
        assert backend.batch_set_v1(keys, kv_idx) == [True] * 5
        slots = mamba.alloc(2)
        write_random(mamba, slots, 2)
        out = backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots,
                                                 keys=[keys[1], keys[3]], hit_policy=TRAILING)])
        assert out == {PoolName.MAMBA: [True, True]}
        result = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=TRAILING)])
        assert result.restorable_prefix_pages == [2, 4]
        assert result.kv_hit_pages == 4 and result.extra_pool_hit_pages == {"kv": 5, "mamba": 4}
        assert backend.stats()["pools"]["mamba"]["pages"]["saved_in_place"] == 2  # counted per pool
    finally:
        backend.close()


def test_a_pools_page_is_never_served_as_another_pools():
    """A page stored in the SWA pool is not the Mamba pool's (nor KV's); a Mamba state stored under a page key is
    not a KV page of that key: each is a miss, and the host memory asked for is left alone."""
    mamba = mamba_host()
    swa = host_pool(device_pool("mha", page_size=PS, layers=1, heads=1), "page_first")
    kv, backend = hybrid_backend({PoolName.MAMBA: mamba, PoolName.SWA: swa})
    try:
        keys = HybridController.keys(prompt(1))
        swa_idx = swa.alloc(PS)
        write_random(swa, swa_idx, 3)
        assert backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=swa_idx, keys=keys,
                                                  hit_policy=TRAILING)]) == {PoolName.SWA: [True]}
        slot = mamba.alloc(1)
        before = read_pages(mamba, slot)
        assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=keys)]) == {
            PoolName.MAMBA: [False]}
        assert read_pages(mamba, slot) == before
        assert backend.batch_exists(keys) == 0 and backend.batch_get_v1(keys, kv.alloc(PS)) == [False]
        write_random(mamba, slot, 4)
        backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=keys)])
        assert backend.batch_exists(keys) == 0  # still no KV page under that key
        got = backend.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=swa.alloc(PS), keys=keys),
                                    PoolTransfer(name=PoolName.MAMBA, host_indices=mamba.alloc(1), keys=keys)])
        assert got == {PoolName.SWA: [True], PoolName.MAMBA: [True]}
    finally:
        backend.close()


def test_mamba_state_is_per_tp_rank_where_the_kv_is_rank_replicated():
    """An MLA model with Kimi-style state (KV the same on every TP rank, Mamba state sharded): the KV keys are the
    same on both ranks, the Mamba keys are each rank's own (SGLang backs the state up on every rank); an MHA
    model's pools are per rank anyway."""
    def namespaces(name: str, mla: bool) -> list[bytes]:
        ids = [StorageIdentity.from_storage_config(storage_config({}, mla=mla, tp_size=2, tp_rank=r)) for r in (0, 1)]
        return [pool_identity(i, name).namespace("fp").digest for i in ids]

    kv0, kv1 = namespaces("kv", mla=True)
    m0, m1 = namespaces("mamba", mla=True)
    assert kv0 == kv1 and m0 != m1
    s0, s1 = namespaces("swa", mla=False)
    assert s0 != s1


def test_a_draft_pool_is_stored_like_any_other():
    """A draft model's KV pool (MTP/EAGLE: PoolName.DRAFT, all pages) round-trips through the v2 calls and gates
    the hit like the indexer: a missing draft page cuts the restorable prefix."""
    draft = host_pool(device_pool("mha", page_size=PS, layers=1), "page_first")
    kv, backend = hybrid_backend({PoolName.DRAFT: draft})
    try:
        keys = HybridController.keys(prompt(3))
        kv_idx = kv.alloc(3 * PS)
        write_random(kv, kv_idx, 9)
        backend.batch_set_v1(keys, kv_idx)
        idx = draft.alloc(3 * PS)
        saved = write_random(draft, idx, 10)
        assert backend.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=idx[:2 * PS], keys=keys[:2])]) == {
            PoolName.DRAFT: [True, True]}
        query = [PoolTransfer(name=PoolName.DRAFT, hit_policy=ALL)]
        assert backend.batch_exists_v2(keys, query).restorable_prefix_pages == [1, 2]
        target = draft.alloc(2 * PS)
        assert backend.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=target, keys=keys[:2])]) == {
            PoolName.DRAFT: [True, True]}
        assert read_pages(draft, target) == saved[:2]
    finally:
        backend.close()


def test_bad_v2_requests_fail_their_pool_only():
    """An unregistered pool, host indices of the wrong length, no host indices, bad keys: that transfer answers
    all False (nothing raised into SGLang), the other transfers of the call still load."""
    mamba = mamba_host()
    kv, backend = hybrid_backend({PoolName.MAMBA: mamba})
    try:
        keys = HybridController.keys(prompt(2))
        slots = mamba.alloc(2)
        saved = write_random(mamba, slots, 5)
        backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots, keys=keys)])
        target = mamba.alloc(2)
        out = backend.batch_get_v2([
            PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(PS), keys=keys[:1]),  # not registered
            PoolTransfer(name=PoolName.INDEXER, host_indices=None, keys=keys),
            PoolTransfer(name=PoolName.MAMBA, host_indices=target, keys=keys)])
        assert out == {PoolName.SWA: [False], PoolName.INDEXER: [False, False], PoolName.MAMBA: [True, True]}
        pools = backend.stats()["pools"]  # each refusal counted under the pool SGLang named
        assert pools["swa"] == {"store": None, "pages": {"refused": 1}} and pools["indexer"]["pages"] == {"refused": 1}
        assert pools["mamba"]["pages"]["refused"] == 0 and pools["mamba"]["pages"]["loaded_direct"] == 2
        assert read_pages(mamba, target) == saved
        assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=target[:1], keys=keys)]) == {
            PoolName.MAMBA: [False, False]}  # 2 keys, 1 slot
        assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=target, keys=["", 7])]) == {
            PoolName.MAMBA: [False, False]}
        bad = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=["x"],
                                                          hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
        assert bad.kv_hit_pages == 0  # block_groups without its geometry: refused, answered as no hit
    finally:
        backend.close()


def test_each_pool_has_a_bounded_store_of_its_own():
    """dram_capacity is split: KV keeps 1 - sidecar_share, the other pools share sidecar_share evenly; a share
    too small for one page of a pool is a start-up error naming the pool."""
    mamba, swa = mamba_host(), host_pool(device_pool("mha", page_size=PS, layers=1, heads=1), "page_first")
    kv, backend = hybrid_backend({PoolName.MAMBA: mamba, PoolName.SWA: swa}, {"dram_capacity": "4MiB",
                                                                                "sidecar_share": 0.5})
    try:
        share = {"kv": 2 << 20, "mamba": 1 << 20, "swa": 1 << 20}
        for name, pool in backend.pools.pools.items():  # each DRAM tier holds whole pages of its pool
            held = pool.store.tiers[0].stats().capacity_bytes
            assert share[name] - pool.store.block_bytes < held <= share[name]
        assert backend.pools.pools["mamba"].store.block_bytes == mamba.get_size_per_token()
    finally:
        backend.close()
    with pytest.raises(ConfigError, match="host pool 'mamba'"):
        hybrid_backend({PoolName.MAMBA: mamba}, {"dram_capacity": "20KiB", "sidecar_share": 0.01})


def test_a_state_larger_than_its_share_of_the_ssd_staging_still_gets_staging(tmp_path):
    """A large model's Mamba slot can be bigger than its pool's share of ssd_staging_bytes: the pool's SSD tier
    still stages two of its pages (the SSD tier's own floor), start-up succeeds and the state round-trips via the
    SSD alone."""
    mamba = mamba_host()
    slot = mamba.get_size_per_token()
    extra = {"ssd_path": str(tmp_path), "ssd_capacity": "8MiB", "ssd_segment_bytes": "1MiB",
             "ssd_staging_bytes": slot, "ssd_offload": "write_through", "sidecar_share": 0.25}
    kv, backend = hybrid_backend({PoolName.MAMBA: mamba}, extra)
    try:
        store = backend.pools.pools["mamba"].store
        keys = HybridController.keys(prompt(1))
        slots = mamba.alloc(1)
        saved = write_random(mamba, slots, 11)
        assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slots, keys=keys)]) == {
            PoolName.MAMBA: [True]}
        assert store.flush(10)
        store.tiers[0].remove(backend.pools.pools["mamba"].page_store.keys(keys))  # only the SSD has it now
        target = mamba.alloc(1)
        assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=target, keys=keys)]) == {
            PoolName.MAMBA: [True]}
        assert read_pages(mamba, target) == saved
    finally:
        backend.close()


def test_a_pool_kvtier_cannot_store_is_refused_at_start_up():
    """A Mamba pool with registered per-slot side state has no fixed segment table (SGLang's get_page_buffer_meta
    refuses it): start-up fails naming the pool and what to do, and nothing is left open. A hybrid model in a
    mode whose node pool holds one block size is refused the same way."""
    kv = host_pool(device_pool("mha", page_size=PS), "page_first")
    backend = StorageBackendFactory.create_backend("dynamic", storage_config({"dram_capacity": "1MiB"}), kv)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba_host(side_state=True), PoolName.MAMBA)
    with pytest.raises(UnsupportedModel, match=r"'mamba' \(MambaPoolHost\).*side states.*without "
                                               r"--hicache-storage-backend"):
        backend.on_host_pools_registered()
    assert backend.store is None and backend.pools is None
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(1), keys=["k"])]) == {
        PoolName.MAMBA: [False]}
    standalone = storage_config({"mode": "standalone", "pool": "ipc:///nonexistent/kvtier-pool"})
    backend = StorageBackendFactory.create_backend("dynamic", standalone, kv)
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba_host(), PoolName.MAMBA)
    with pytest.raises(UnsupportedModel, match=r"\['mamba'\].*'embedded' only"):
        backend.on_host_pools_registered()
    assert backend.store is None


def test_a_kv_only_model_keeps_its_v1_namespace_and_capacity():
    """Without extra pools nothing changes: the KV store has the whole dram_capacity and v2 calls naming KV find
    the pages v1 saved."""
    kv = host_pool(device_pool("mha", page_size=PS), "page_first")
    backend = make_backend(kv, {"dram_capacity": "4MiB"})
    try:
        assert (4 << 20) - backend.store.block_bytes < backend.store.tiers[0].stats().capacity_bytes <= 4 << 20
        assert backend.pools.extra == []
        keys = HybridController.keys(prompt(3))
        idx = kv.alloc(3 * PS)
        saved = write_random(kv, idx, 6)
        assert backend.batch_set_v1(keys, idx) == [True] * 3
        assert backend.batch_exists_v2(keys).kv_hit_pages == 3
        target = kv.alloc(3 * PS)
        assert backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=target, keys=keys)]) == {
            PoolName.KV: [True] * 3}
        assert read_pages(kv, target) == saved
    finally:
        backend.close()


# ---- the hit policies against SGLang's own reference backend ---------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kv=st.lists(st.booleans(), min_size=1, max_size=10),
       pools=st.lists(st.tuples(st.sampled_from([ALL, TRAILING]), st.integers(1, 4),
                                st.lists(st.booleans(), min_size=10, max_size=10)), max_size=3))
def test_hit_policies_agree_with_sglangs_file_backend(tmp_path_factory, kv, pools):
    """For any presence pattern of KV pages and of up to three pools' pages (all_pages or trailing_pages with a
    window of 1-4), hits.span_hits answers what SGLang's HiCacheFile.batch_exists_v2 answers (kv_hit_pages, each
    pool's pages, restorable_prefix_pages), its files made present or absent to match."""
    root = tmp_path_factory.mktemp("hicache-file")
    cfg = storage_config({"file_storage_path": str(root)})
    reference = HiCacheFile(cfg, file_path=str(root))
    keys = [f"{i:064x}" for i in range(len(kv))]
    names = [PoolName.MAMBA, PoolName.SWA, PoolName.INDEXER][:len(pools)]
    for i, k in enumerate(keys):
        if kv[i]:
            (root / f"{reference._get_component_key(k)}.bin").touch()
        for name, (_, _, present) in zip(names, pools):
            if present[i]:
                (root / f"{reference._get_component_key(k, name)}.bin").touch()
    transfers = [PoolTransfer(name=name, keys=["x"] * window, hit_policy=policy)
                 for name, (policy, window, _) in zip(names, pools)]
    want = reference.batch_exists_v2(keys, transfers)
    kv_pages = next((i for i, p in enumerate(kv) if not p), len(kv))
    got = span_hits(kv_pages, [PoolQuery(str(name), policy.value, present[:kv_pages], window=window)
                               for name, (policy, window, present) in zip(names, pools)])
    assert got.final == want.kv_hit_pages and got.restorable == want.restorable_prefix_pages
    if got.restorable:  # HiCacheFile stops asking pools once nothing is restorable
        assert got.pool_pages == {str(k): v for k, v in want.extra_pool_hit_pages.items()}


def test_block_groups_report_their_own_pages_and_never_gate_kv():
    """block_groups: 2 keys per group, 4 FULL pages per group; the leading complete groups' pages are the pool's
    verdict (capped at the KV hit), the KV hit is not cut by a missing group."""
    present = [True, True, True, False, True, True]  # groups 0 (complete), 1 (incomplete), 2
    query = PoolQuery("deepseek_v4_c4", "block_groups", present, block_pages=4, group_pages=2)
    assert span_hits(10, [query]).pool_pages == {"kv": 10, "deepseek_v4_c4": 4}
    assert span_hits(10, [query]).final == 10
    assert span_hits(3, [query]).pool_pages["deepseek_v4_c4"] == 3


# ---- the whole live path: UnifiedRadixCache with FULL + SWA components -----------------------------------------


@pytest.fixture
def radix_servers():
    made: list[RadixServer] = []

    def make(cls: type[RadixServer], **kwargs) -> RadixServer:
        server = cls(**kwargs)
        made.append(server)
        return server

    yield make
    for s in made:
        s.close()


def test_a_sliding_window_model_comes_back_from_kvtier_through_sglangs_radix_cache(radix_servers):
    """SGLang's UnifiedRadixCache (FULL + SWA components, window 8 tokens) writes the prompt through to kvtier
    (the SWA pages with batch_set_v2, the full pages with batch_set_v1); after the prompt leaves the device and
    the host, a new request prefetches it (batch_exists_v2 with the window's trailing policy, batch_get_v1,
    batch_get_v2) and loads it back: the full layers' KV of the whole prefix and the SWA layers' KV of its
    window are bit-exact."""
    s = radix_servers(SwaRadixServer)
    tokens = prompt(8)
    ref_full, ref_swa = s.insert(tokens, seed=11)
    assert s.pump(s.backed_up)
    saved = s.backend.stats()["pools"]["swa"]["pages"]["saved_in_place"]
    assert saved >= s.window // s.page_size  # the window's pages went through the v2 calls
    s.forget(tokens, swa_num_tokens=len(tokens))
    assert s.prefetch(tokens + [7]) == len(tokens)
    full, swa = s.load_back(tokens)
    assert len(full[0]) == len(tokens)
    assert all(torch.equal(a, b) for a, b in zip(full, ref_full))
    assert all(torch.equal(a, b[-s.window:]) for a, b in zip(swa, ref_swa))
    assert s.backend.stats()["pools"]["swa"]["pages"]["loaded_direct"] == s.window // s.page_size


def test_without_its_window_in_kvtier_a_sliding_window_prefix_is_not_loaded(radix_servers):
    """The negative control: the same prompt backed up, then the SWA pool's pages dropped from kvtier (the full
    pages stay: the v1 query finds all 8). kvtier's query answers no restorable length, so SGLang reads no KV page
    at all (rather than loading KV and then finding the window missing) and loads nothing."""
    s = radix_servers(SwaRadixServer)
    tokens = prompt(8)
    s.insert(tokens, seed=12)
    assert s.pump(s.backed_up)
    s.forget(tokens, swa_num_tokens=len(tokens))
    assert s.backend.pools.pools["swa"].page_store.clear() > 0
    assert s.backend.batch_exists(HybridController.keys(tokens)) == 8
    s.backend.stats()  # resets the page counters
    assert s.prefetch(tokens + [7]) == 0
    kv = s.backend.stats()["pages"]
    assert kv["loaded_direct"] + kv["loaded_staged"] + kv["missed"] == 0


# ---- the whole live path: UnifiedRadixCache with FULL + MAMBA components ---------------------------------------


def test_a_mamba_model_comes_back_from_kvtier_through_sglangs_radix_cache(radix_servers):
    """SGLang's UnifiedRadixCache (FULL + MAMBA) writes a finished prompt through to kvtier (its state with
    batch_set_v2, keyed by the last page's key; its KV with batch_set_v1); after both leave the device and the
    host, a new request prefetches them (batch_exists_v2 answers the one restorable length, 24) and loads them
    back: the KV and the recurrent state are bit-exact."""
    s = radix_servers(MambaRadixServer)
    tokens = list(range(1000, 1024))
    ref_kv, ref_state = s.insert(tokens, seed=21)
    assert s.pump(s.backed_up)
    s.forget(tokens, mamba_num=1)
    assert s.prefetch(tokens + [7]) == len(tokens)
    kv, state = s.load_back(tokens)
    assert len(kv[0]) == len(tokens) and all(torch.equal(a, b) for a, b in zip(kv, ref_kv))
    assert state and all(torch.equal(a, b) for a, b in zip(state, ref_state))
    pages = s.backend.stats()["pools"]["mamba"]["pages"]
    assert pages["saved_in_place"] == 1 and pages["loaded_direct"] == 1


def test_a_mamba_prefix_is_restored_only_where_its_state_was_taken(radix_servers):
    """The negative controls: a request sharing the first 18 tokens of a stored 24-token prompt finds 18 KV pages
    in kvtier but no state at 18 (states exist only at 24): no restorable length, nothing loaded, no KV page
    read. The same prompt with its Mamba pages dropped from kvtier: nothing loaded either."""
    s = radix_servers(MambaRadixServer)
    tokens = list(range(1000, 1024))
    s.insert(tokens, seed=22)
    assert s.pump(s.backed_up)
    s.forget(tokens, mamba_num=1)
    fork = tokens[:18] + [9, 9, 9]
    assert s.backend.batch_exists(page_keys(fork[:18], 1)) == 18  # the KV pages are there
    s.backend.stats()  # resets the page counters
    assert s.prefetch(fork, rid="fork") == 0
    kv = s.backend.stats()["pages"]
    assert kv["loaded_direct"] + kv["loaded_staged"] + kv["missed"] == 0
    assert s.backend.pools.pools["mamba"].page_store.clear() == 1
    assert s.prefetch(tokens + [7], rid="whole") == 0


# ---- the whole live path: a DSA model (MLA + indexer: not hybrid, but its indexer pages move through v2) -------


def test_a_dsa_models_indexer_pages_come_back_through_sglangs_radix_cache(radix_servers):
    """SGLang's UnifiedRadixCache over a DSATokenToKVPool: the indexer pages go to kvtier with batch_set_v2 (a
    KV-derived sidecar: the KV pages' keys and host indices), come back with batch_get_v2 beside each KV batch,
    and load back bit-exact with the MLA KV."""
    s = radix_servers(DsaRadixServer)
    tokens = list(range(1000, 1000 + 3 * s.page_size))
    ref_kv, ref_index = s.insert(tokens, seed=31)
    assert s.pump(s.backed_up)
    s.forget(tokens)
    assert s.prefetch(tokens + [7]) == len(tokens)
    kv, index = s.load_back(tokens)
    assert len(kv[0]) == len(tokens) and all(torch.equal(a, b) for a, b in zip(kv, ref_kv))
    assert all(torch.equal(a, b) for a, b in zip(index, ref_index))
    assert s.backend.stats()["pools"]["indexer"]["pages"]["loaded_direct"] == 3


def test_without_its_indexer_pages_a_dsa_prefix_is_not_loaded(radix_servers):
    """The negative control: the indexer pages dropped from kvtier, the MLA pages kept (the v1 query finds 3):
    the all_pages policy leaves no restorable length, so no KV page is read and nothing is loaded."""
    s = radix_servers(DsaRadixServer)
    tokens = list(range(1000, 1000 + 3 * s.page_size))
    s.insert(tokens, seed=32)
    assert s.pump(s.backed_up)
    s.forget(tokens)
    assert s.backend.pools.pools["indexer"].page_store.clear() == 3
    assert s.backend.batch_exists(page_keys(tokens, s.page_size)) == 3
    s.backend.stats()  # resets the page counters
    assert s.prefetch(tokens + [7]) == 0
    kv = s.backend.stats()["pages"]
    assert kv["loaded_direct"] + kv["loaded_staged"] + kv["missed"] == 0
