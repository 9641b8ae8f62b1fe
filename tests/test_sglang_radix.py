"""SGLang's own UnifiedRadixCache + HybridCacheController (and its prefetch, IO and backup threads) driving
kvtier as the L3 backend, end to end: insert -> device->host backup -> L3 write -> a cache that lacks the
prefix prefetches it from kvtier and loads it back to the device pool, bit-exact, in every host layout.
Only the GPU-only device<->host copy ops are replaced (tests/sglang_harness.py); nothing of kvtier's is.
"""

from __future__ import annotations

import pytest
from sglang_harness import MHA_LAYOUTS, MLA_LAYOUTS, SKIP_REASON, sglang_available

if not sglang_available():
    pytest.skip(SKIP_REASON, allow_module_level=True)

import torch  # noqa: E402
from sglang_harness import RadixServer, install  # noqa: E402

install()

from kvtier.connectors.paths import model_dir  # noqa: E402
from kvtier.connectors.sglang.pages import HostPages  # noqa: E402

LAYOUTS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]
PS = 4


def prompt(pages: int, start: int = 1000) -> list[int]:
    return list(range(start, start + pages * PS))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def servers():
    made: list[RadixServer] = []

    def make(**kwargs) -> RadixServer:
        server = RadixServer(**kwargs)
        made.append(server)
        return server

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("kind, layout", LAYOUTS)
def test_a_restarted_server_prefetches_yesterdays_prefix_from_the_ssd(servers, tmp_path, kind, layout):
    """Embedded mode with an SSD: server A computes a prompt, SGLang backs it up to L3 (kvtier DRAM, written
    through to the SSD); A stops; server B, started on the same ssd_path, has nothing in L1/L2, prefetches the
    prefix from kvtier's SSD and loads it to the device, bit-exact."""
    extra = {"dram_capacity": "1MiB", "ssd_path": str(tmp_path), "ssd_capacity": "8MiB",
             "ssd_segment_bytes": "1MiB", "ssd_offload": "write_through"}
    a = servers(kind=kind, layout=layout, extra=extra)
    tokens = prompt(10)
    ref = a.insert(tokens, seed=1)
    assert a.pump(a.backed_up)
    assert a.backend.batch_exists(a.backend_keys(tokens)) == 10
    a.close()
    b = servers(kind=kind, layout=layout, extra=extra)
    assert b.backend.store.tiers[1].path == tmp_path / model_dir("test/model") / "tp0of1"
    assert b.prefetch(tokens + [7]) == 40  # a trailing partial page is never stored
    assert same(b.load_back(tokens), ref)
    assert b.backend.store.stats()["tiers"]["ssd"]["hits"] == 10


@pytest.mark.parametrize("kind, layout", [("mha", "layer_first"), ("mha", "page_first"), ("mla", "page_first")])
def test_prefixes_evicted_from_device_and_host_come_back_from_kvtier_dram(servers, kind, layout):
    """One server, more than SGLang's 128-page storage batch: the prompt leaves L1 and L2 (evicted), and the
    next request's prefix comes back from kvtier's DRAM slots (borrowed, one copy)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s = servers(kind=kind, layout=layout, extra={"dram_capacity": "2MiB"}, tokens=1024)
    tokens = prompt(150)
    ref = s.insert(tokens, seed=2)
    assert s.pump(s.backed_up)
    s.cache.evict(EvictParams(num_tokens=len(tokens)))
    assert s.cache.evict_host(len(tokens)) == len(tokens)
    assert all(x.numel() == 0 for x in s.load_back(tokens))  # nothing on the device or host any more
    s.backend.stats()  # reset the page counters
    assert s.prefetch(tokens) == len(tokens)
    assert same(s.load_back(tokens), ref)
    counts = s.backend.stats()["pages"]
    assert counts["loaded_direct"] == 150 and counts["loaded_staged"] == 0


def test_a_page_missing_mid_prefix_stops_the_prefetch_there(servers):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    s = servers(kind="mha", layout="page_first", extra={"dram_capacity": "2MiB"}, tokens=1024)
    tokens = prompt(12)
    ref = s.insert(tokens, seed=3)
    assert s.pump(s.backed_up)
    s.cache.evict(EvictParams(num_tokens=len(tokens)))
    s.cache.evict_host(len(tokens))
    s.backend.store.remove(s.backend.page_store.keys(s.backend_keys(tokens)[5:6]))  # page 5 left L3
    assert s.prefetch(tokens) == 5 * PS
    assert same(s.load_back(tokens), [layer[: 5 * PS] for layer in ref])


def test_the_flat_interface_round_trips_through_the_controller(servers, tmp_path):
    extra = {"dram_capacity": "1MiB", "ssd_path": str(tmp_path), "ssd_capacity": "4MiB",
             "ssd_segment_bytes": "1MiB", "ssd_offload": "write_through"}
    a = servers(kind="mha", layout="layer_first", extra=extra, interface_v1=0)
    tokens = prompt(6)
    ref = a.insert(tokens, seed=4)
    assert a.pump(a.backed_up)
    a.close()
    b = servers(kind="mha", layout="layer_first", extra=extra, interface_v1=0)
    assert b.prefetch(tokens) == len(tokens)
    assert same(b.load_back(tokens), ref)


def test_negative_controls_another_model_finds_nothing_and_a_wrong_segment_order_is_caught(servers, tmp_path,
                                                                                          monkeypatch):
    extra = {"dram_capacity": "1MiB", "ssd_path": str(tmp_path), "ssd_capacity": "4MiB",
             "ssd_segment_bytes": "1MiB", "ssd_offload": "write_through"}
    a = servers(kind="mha", layout="layer_first", extra=extra)
    tokens = prompt(6)
    ref = a.insert(tokens, seed=5)
    assert a.pump(a.backed_up)
    a.close()
    stranger = servers(kind="mha", layout="layer_first", extra={**extra, "model": "another/model"})
    assert stranger.prefetch(tokens) == 0  # the namespace keeps models apart
    stranger.close()
    wrong = servers(kind="mha", layout="layer_first", extra=extra)
    real = HostPages.from_blocks

    def v_before_k(self, blocks, segments):  # a backend that scatters the right bytes to the wrong segments
        real(self, blocks, segments[:, [1, 0, 3, 2, 5, 4]])

    monkeypatch.setattr(HostPages, "from_blocks", v_before_k)
    assert wrong.prefetch(tokens) == len(tokens)
    assert not same(wrong.load_back(tokens), ref)  # the comparison the other tests rely on does fail
