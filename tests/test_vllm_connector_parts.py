"""The vLLM connector's parts that need no vLLM installed: the scheduler <-> worker lookup channel (real zmq
ipc sockets), kv_connector_extra_config parsing, and agent hints from kv_transfer_params."""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time
from types import SimpleNamespace

import msgpack
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvtier import wire
from kvtier.config import Config, ConfigError
from kvtier.connectors.vllm.hints import AgentHints, pin_of, request_hints
from kvtier.connectors.vllm.lookup import LookupClient, LookupServer, RankLookupReply, endpoint
from kvtier.connectors.vllm.paths import PER_WORKER_KEYS, model_dir, per_worker, rank_dir
from kvtier.connectors.vllm.settings import CONNECTOR_KEYS, split_extra_config


@pytest.fixture
def ipc_dir():
    path = tempfile.mkdtemp(prefix="kvt", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def held_prefix(n: int):
    """A handler holding the first ``n`` blocks of any lookup, all in DRAM; records what it was asked."""
    calls: list[tuple[int, int, float]] = []

    def handler(lease: int, hashes: list[bytes], ttl_s: float) -> RankLookupReply:
        calls.append((lease, len(hashes), ttl_s))
        length = min(n, len(hashes))
        return RankLookupReply(length, (("dram", length),) if length else ())

    handler.calls = calls  # type: ignore[attr-defined]
    return handler


def wait_result(client: LookupClient, lease: int, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        client.poll()
        result = client.result(lease)
        if result is not None:
            return result
        time.sleep(0.001)
    raise AssertionError(f"no answer to lookup {lease}")


def test_shortest_prefix_over_all_ranks(ipc_dir):
    servers = [LookupServer(endpoint(ipc_dir, "e", 0, r), held_prefix(n)) for r, n in enumerate((7, 3, 5))]
    client = LookupClient([s.address for s in servers], timeout_s=5)
    try:
        hashes = [bytes([i]) * 32 for i in range(10)]
        client.submit(42, hashes, ttl_s=9.5)
        result = wait_result(client, 42)
        assert result.length == 3 and result.reply.count("dram") == 3
        assert all(s._handler.calls == [(42, 10, 9.5)] for s in servers)  # type: ignore[attr-defined]
        assert not client.expired(42)
    finally:
        client.close()
        for s in servers:
            s.close()


def test_unanswered_lookup_expires(ipc_dir):
    live = LookupServer(endpoint(ipc_dir, "e", 0, 0), held_prefix(4))
    client = LookupClient([live.address, endpoint(ipc_dir, "e", 0, 1)], timeout_s=0.1)  # rank 1: nobody home
    try:
        client.submit(1, [b"h" * 32] * 4, ttl_s=1)
        time.sleep(0.15)
        client.poll()
        assert client.result(1) is None and client.expired(1)
        client.forget(1)
        assert not client.expired(1)
    finally:
        client.close()
        live.close()


def test_bad_requests_get_error_replies_and_the_server_keeps_serving(ipc_dir):
    def broken(lease, hashes, ttl_s):
        if lease == 13:
            raise RuntimeError("bug in the handler")
        return RankLookupReply(len(hashes))

    server = LookupServer(endpoint(ipc_dir, "e", 0, 0), broken)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(server.address)

    def ask(frame: bytes) -> tuple[bool, dict]:
        sock.send(frame)
        _, ok, body = wire.decode_reply(sock.recv())
        return ok, body

    try:
        cases = [
            (b"\xc1garbage", wire.ERR_BAD_MESSAGE),
            (msgpack.packb([99, 1, "kv_prefix", {}]), wire.ERR_BAD_VERSION),
            (wire.encode_request(2, "drop_everything", {}), wire.ERR_UNKNOWN_OP),
            (wire.encode_request(3, "kv_prefix", {"hashes": b"x" * 33, "width": 32, "ttl_s": 1.0}),
             wire.ERR_BAD_REQUEST),
            (wire.encode_request(4, "kv_prefix", {"hashes": b"x" * 32, "width": 32, "ttl_s": -1.0}),
             wire.ERR_BAD_REQUEST),
            (wire.encode_request(5, "kv_prefix", {"width": 32, "ttl_s": 1.0}), wire.ERR_BAD_REQUEST),
            (wire.encode_request(13, "kv_prefix", {"hashes": b"x" * 32, "width": 32, "ttl_s": 1.0}),
             wire.ERR_INTERNAL),
        ]
        for frame, code in cases:
            ok, body = ask(frame)
            assert not ok and body["code"] == code, (frame[:20], body)
        ok, body = ask(wire.encode_request(6, "kv_prefix", {"hashes": b"x" * 64, "width": 32, "ttl_s": 1.0}))
        assert ok and body["length"] == 2
        assert server.errors == len(cases) and server.served == 1
    finally:
        sock.close()
        ctx.term()
        server.close()


def test_a_rank_answering_an_error_holds_nothing(ipc_dir):
    good = LookupServer(endpoint(ipc_dir, "e", 0, 0), held_prefix(5))
    bad = LookupServer(endpoint(ipc_dir, "e", 0, 1), lambda *a: (_ for _ in ()).throw(OSError("disk on fire")))
    client = LookupClient([good.address, bad.address], timeout_s=5)
    try:
        client.submit(7, [b"k" * 16] * 5, ttl_s=1)
        assert wait_result(client, 7).length == 0
    finally:
        client.close()
        good.close()
        bad.close()


def test_idle_hook_runs(ipc_dir):
    ticks = threading.Event()
    server = LookupServer(endpoint(ipc_dir, "e", 0, 0), held_prefix(0), on_idle=ticks.set, idle_s=0.01)
    try:
        assert ticks.wait(2)
    finally:
        server.close()


def test_endpoint_refuses_paths_a_unix_socket_cannot_hold():
    assert endpoint("/tmp", "x" * 500, 3, 1).startswith("ipc:///tmp/kvtier-")  # the engine id is hashed
    with pytest.raises(ValueError, match="ipc_dir .* too long"):
        endpoint("/tmp/" + "d" * 100, "e", 0, 0)


def test_reply_counts_by_tier():
    reply = RankLookupReply(6, (("dram", 2), ("ssd", 3), ("dram", 1)))
    assert reply.count("dram") == 3 and reply.count("ssd") == 3 and reply.count("ssd", upto=4) == 2


# ---- kv_connector_extra_config ------------------------------------------------------------------------------


def test_extra_config_splits_connector_and_store_keys():
    settings, store = split_extra_config({"dram_capacity": "8GiB", "ssd_path": "/nvme/x", "load_mode": "layerwise",
                                          "staging_bytes": "32MiB", "save_decode": "false", "lookup_timeout_s": 2})
    assert (store.dram_capacity, store.ssd_path) == (8 << 30, "/nvme/x")
    assert settings.load_mode == "layerwise" and not settings.load_async
    assert settings.staging_bytes == 32 << 20 and settings.save_decode is False and settings.lookup_timeout_s == 2.0
    assert set(CONNECTOR_KEYS) >= {"load_mode", "save_decode", "lease_ttl_s", "ipc_dir"}


@pytest.mark.parametrize("extra, message", [
    ({"dram_capasity": "1GiB"}, "unknown config key 'dram_capasity'; did you mean dram_capacity"),
    ({"load_mode": "eager"}, "load_mode: 'eager' is not one of async, layerwise"),
    ({"lease_ttl_s": 0}, "lease_ttl_s must be > 0"),
    ({"save_decode": "maybe"}, "save_decode: expected a boolean"),
    ({"hint_max_fraction": 2}, "hint_max_fraction must be in"),
    ({"dram_capacity": "lots"}, "dram_capacity"),
])
def test_bad_extra_config_is_named(extra, message):
    with pytest.raises(ConfigError, match=message):
        split_extra_config(extra)


def test_extra_config_is_merged_with_the_environment_before_it_is_validated(monkeypatch):
    """The pool from KVTIER_POOL and the mode from kv_connector_extra_config are one valid config (the dict alone
    was validated before, and failed: standalone without a pool)."""
    monkeypatch.setenv("KVTIER_POOL", "ipc:///run/kvtier/pool.sock")
    _, config = split_extra_config({"mode": "standalone", "load_mode": "async"})
    assert (config.mode, config.pool) == ("standalone", "ipc:///run/kvtier/pool.sock")
    monkeypatch.delenv("KVTIER_POOL")
    with pytest.raises(ConfigError, match="kv_connector_extra_config: mode 'standalone' needs exactly one 'pool'"):
        split_extra_config({"mode": "standalone"})


# ---- agent hints ------------------------------------------------------------------------------------------


def _req(params, session_id=None):
    return SimpleNamespace(request_id="r1", kv_transfer_params=params, session_id=session_id)


def hints_of(request):
    return pin_of(request, request_hints(request))


def test_hints_from_kv_transfer_params():
    assert hints_of(_req({"kvtier": {"ttl_s": 600, "session": "s", "priority": 2}})) == AgentHints("s", 600.0, 2.0)
    assert hints_of(_req({"kvtier": {"ttl_s": 5}}, session_id="vllm-session")) == AgentHints("vllm-session", 5.0, 0.0)
    assert hints_of(_req({"kvtier": {"ttl_s": 5}})) == AgentHints("r1", 5.0, 0.0)
    assert hints_of(_req(None)) is None and hints_of(_req({"do_remote_prefill": True})) is None
    # hints for the policy only (no ttl_s): no pin, and nothing to complain about
    assert hints_of(_req({"kvtier": {"session": "s", "finished": True}})) is None


@pytest.mark.parametrize("raw, pin", [
    ({"ttl_s": -1}, None), ({"ttl_s": "soon"}, None),
    ({"ttl_s": 5, "priority": float("nan")}, AgentHints("r1", 5.0, 0.0)),  # the bad value dropped, the rest kept
    ({"ttl_s": 5, "session": 7}, AgentHints("r1", 5.0, 0.0)),
])
def test_bad_hints_are_dropped_and_logged_not_fatal(raw, pin, caplog):
    assert hints_of(_req({"kvtier": raw})) == pin
    assert "request r1: ignoring hint" in caplog.text


def test_each_hint_is_checked_once_for_the_pin_and_the_policy(caplog):
    """One reading of a request's hints serves its pin, the policy's notes and the envelope's note: a bad value
    is logged once (the scheduler read the dict three times, with two validators that disagreed, before)."""
    from kvtier.connectors.vllm.observe import Notebook

    req = _req({"kvtier": {"ttl_s": 30, "session": "agent-1", "subagents": -1, "finished": True}})
    hints = request_hints(req)
    book = Notebook(clock=lambda: 1.0)
    book.arrived(req, [b"h" * 16], hints)
    notes = book.take()
    assert pin_of(req, hints) == AgentHints("agent-1", 30.0, 0.0)
    assert notes.arrivals[0].session == "agent-1"
    assert [(h.finished, h.subagents, h.ttl_s) for h in notes.hints] == [(True, 0, 30.0)]
    assert caplog.text.count("ignoring hint subagents=-1") == 1


# ---- the benchmark --------------------------------------------------------------------------------------------


@pytest.mark.slow  # a benchmark
def test_bench_vllm_writes_rows_beside_memcpy(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "vllm.json"
    r = subprocess.run([sys.executable, "-m", "kvtier", "bench", "vllm", "--bytes", "8MiB", "--staging", "4MiB",
                        "--rounds", "1", "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert [x["op"] for x in rows] == ["save", "load"]
    for x in rows:
        assert x["blocks"] == 4 and x["gbps"] > 0 and x["baseline_gbps"] > 0
        assert abs(x["ratio"] - x["gbps"] / x["baseline_gbps"]) < 0.01
    assert "np.copyto" in r.stdout


# ---- per-worker paths (paths.py) ------------------------------------------------------------------------


@given(tp=st.integers(1, 8), pcp=st.integers(1, 3), pp=st.integers(1, 4), dp_size=st.integers(1, 4))
def test_every_worker_of_a_deployment_gets_its_own_directory(tp, pcp, pp, dp_size):
    names = [rank_dir(r, tp=tp, pcp=pcp, pp=pp, dp_rank=d, dp_size=dp_size)
             for d in range(dp_size) for r in range(tp * pcp * pp)]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[a-z0-9-]+", n) for n in names)


def test_rank_dir_names_tp_pcp_pp_and_dp_in_vllms_rank_order():
    assert rank_dir(0, tp=1) == "tp0of1"
    assert rank_dir(3, tp=2, pp=2) == "tp1of2-pp1of2"  # vLLM: rank = pp_rank * tp + tp_rank
    assert rank_dir(5, tp=2, pcp=3) == "tp1of2-pcp2of3"
    assert rank_dir(1, tp=2, dp_rank=3, dp_size=4) == "tp1of2-dp3"
    with pytest.raises(ValueError, match="rank 4 is outside tp 2 x pcp 1 x pp 2"):
        rank_dir(4, tp=2, pp=2)


def test_model_dir_is_readable_safe_and_tells_models_and_revisions_apart():
    name = model_dir("meta-llama/Llama-3.1-8B")
    assert re.fullmatch(r"Llama-3\.1-8B-[0-9a-f]{8}", name)
    assert name == model_dir("meta-llama/Llama-3.1-8B")  # stable: a restart finds its directories
    assert name != model_dir("other-org/Llama-3.1-8B") != model_dir("meta-llama/Llama-3.1-8B", "v2")
    assert "/" not in model_dir("/models/../llama 8b/") and model_dir("").startswith("model-")


def test_per_worker_moves_only_the_paths_that_are_set():
    config = Config.from_dict({"ssd_path": "/nvme/kvtier"})
    moved = per_worker(config, "m-1234", "tp1of2")
    assert moved.ssd_path == "/nvme/kvtier/m-1234/tp1of2" and moved.dram_shm_path == ""
    assert config.ssd_path == "/nvme/kvtier"  # the caller's config is not changed
    both = per_worker(Config.from_dict({"ssd_path": "/a", "dram_shm_path": "/dev/shm/k"}), "m", "tp0of1")
    assert (both.ssd_path, both.dram_shm_path) == ("/a/m/tp0of1", "/dev/shm/k/m/tp0of1")
    assert set(PER_WORKER_KEYS) <= {f for f in Config.__dataclass_fields__}


def test_a_rank_store_names_the_rank_when_another_server_holds_its_ssd_and_bounds_hint_leases(tmp_path):
    from kvtier.connectors.rank_store import open_rank_store
    from kvtier.tiers.ssd import DirectoryInUse

    config = per_worker(Config.from_dict({"dram_capacity": 64 * 4096, "ssd_path": str(tmp_path)}), "m", "tp0of1")
    first = open_rank_store(config, 4096, rank="tp0of1", engine="vLLM", hint_max_fraction=0.25)
    try:
        assert first.leases.max_keys == 16  # a quarter of DRAM's 64 blocks
        with pytest.raises(DirectoryInUse, match=r"kvtier vLLM rank tp0of1: .*in use.*is another vLLM server of "
                                                 r"this model on this host using the same ssd_path"):
            open_rank_store(config, 4096, rank="tp0of1", engine="vLLM", hint_max_fraction=0.25)
    finally:
        first.close()


def test_per_worker_refuses_a_path_that_is_a_file_naming_it(tmp_path):
    old = tmp_path / "kvtier"
    old.write_bytes(b"")  # e.g. the DRAM file of an embedded store that took dram_shm_path as its file
    with pytest.raises(ConfigError, match=f"dram_shm_path {old} is a file"):
        per_worker(Config.from_dict({"dram_shm_path": str(old)}), "m", "tp0of1")
