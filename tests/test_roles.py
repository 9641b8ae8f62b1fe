"""Roles, with a real kvtier-master and kvtier-pool started with --auth-dir and real CurveZMQ keys of each role
(kvtier/auth/roles.py): an engine key moves blocks, looks up and sets hints but cannot register a node, clear
a pool or forget a node; a daemon key (the pool reporting to the master) registers but moves no blocks; an
operator key clears and forgets; a key straight in authorized/ (the layout before roles) is an engine.

Without keys a node id still belongs to the registration that holds it: a stranger who reads ``nodes`` can
neither say goodbye for a live pool nor register over it, so route_put keeps sending blocks to the real one.
And a daemon bound beyond loopback without keys needs --insecure-bind, and says so in its log."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier import wire
from kvtier.auth import ClientKeys, generate
from kvtier.client import MasterClient, MasterError, api
from kvtier.transport import connect
from kvtier.transport.base import PoolRefused
from kvtier.transport.channel import Channel
from masterproc import MasterProcess
from poolproc import PoolProcess, until

BB = 16 << 10


def rows_of(t: torch.Tensor) -> np.ndarray:
    return np.uint64(t.data_ptr()) + np.arange(t.shape[0], dtype=np.uint64) * np.uint64(t.shape[1])


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """The cluster's daemon keypair (master and pool share it) and one client directory per role, laid out as
    docs/pool.md 'Authenticated sockets' says: authorized/engines/, daemons/, operators/, and one legacy flat key."""
    root = tmp_path_factory.mktemp("rolekeys")
    daemon = root / "daemon"
    generate(daemon, "server", role="daemon")
    auth = daemon / "authorized"
    for sub in ("engines", "daemons", "operators"):
        (auth / sub).mkdir(parents=True)
    shutil.copy(daemon / "server.key", auth / "daemons" / "pools.key")  # the pool, reporting to the master
    shutil.copy(daemon / "server.key", daemon / "master.key")
    out = {"daemon": daemon}
    for name, role, where in (("engine", "engine", auth / "engines"), ("operator", "operator", auth / "operators"),
                              ("legacy", None, auth)):
        d = root / name
        generate(d, role=role)
        shutil.copy(d / "client.key", where / f"{name}.key")
        shutil.copy(daemon / "server.key", d / "server.key")
        out[name] = d
    # The daemon's own keypair as a client's (what a pool presents to the master), to knock on the pool's door.
    as_client = root / "daemon-client"
    as_client.mkdir()
    shutil.copy(daemon / "server.key_secret", as_client / "client.key_secret")
    shutil.copy(daemon / "server.key", as_client / "server.key")
    out["daemon_client"] = as_client
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, keys):
    tmp = tmp_path_factory.mktemp("roles")
    with MasterProcess(tmp, lease_s=30.0, args=("--auth-dir", str(keys["daemon"]))) as master:
        with PoolProcess(tmp, capacity="8MiB", block_bytes=BB, master=master.endpoint,
                         args=("--auth-dir", str(keys["daemon"]))) as pool:
            admin = MasterClient(master.endpoint, auth=ClientKeys.load(keys["operator"], master.endpoint))
            assert until(lambda: [n["state"] for n in admin.nodes()] == ["live"], 15.0), master.log()[-3000:]
            yield master, pool, admin
            admin.close()
            assert master.alive() and pool.alive()


def client(keys, who: str, endpoint: str) -> MasterClient:
    return MasterClient(endpoint, timeout_s=3.0, auth=ClientKeys.load(keys[who], endpoint))


def pool_call(keys, who: str, endpoint: str, op: str, body: dict) -> dict:
    """One raw pool request with ``who``'s keys: its reply body, or PoolRefused with the pool's error."""
    ctx = zmq.Context()
    ch = Channel(endpoint, ctx, timeout_s=3.0, auth=ClientKeys.load(keys[who], endpoint))
    try:
        return ch.call(op, body).body
    finally:
        ch.close()
        ctx.term()


def forbidden(call, needs: str) -> str:
    with pytest.raises((MasterError, PoolRefused)) as e:
        call()
    assert e.value.code == wire.ERR_FORBIDDEN, e.value
    assert f"needs an {needs}" in str(e.value) or f"needs a {needs}" in str(e.value), e.value
    return str(e.value)


def register(m: MasterClient, node: str) -> None:
    """Register ``node`` at an endpoint of its own (an address is one node's: master/nodes.py)."""
    address = f"tcp://10.9.9.9:{1 + zlib.crc32(node.encode()) % 65535}"
    m.call(api.register(node, uuid.uuid4().hex, 0, [("dram", 1 << 30)], address, {"role": "pool"}))


def test_an_engine_key_moves_blocks_and_looks_up_but_cannot_register_clear_or_forget(cluster, keys, make_keys):
    master, pool, admin = cluster
    conn = connect(pool.tcp, BB, transport="tcp", timeout_s=3.0, auth=ClientKeys.load(keys["engine"], pool.tcp))
    try:
        ks = make_keys(8, start=100)
        src = blocks_for(ks, BB)
        assert conn.put(ks, rows_of(src)) == [True] * 8
        out = torch.zeros_like(src)
        assert_all_hits_exact(conn.get(ks, rows_of(out)), out, src)
    finally:
        conn.close()
    with client(keys, "engine", master.endpoint) as m:
        assert m.lookup(ks).n == 8
        assert m.pin(session="agent-1", ttl_s=60) == 1
        assert m.route_put([BB])  # placements are an engine's business
        msg = forbidden(lambda: register(m, "fake-pool"), "daemon")
        assert str(keys["daemon"] / "authorized" / "daemons") in msg  # where a daemon key would go
        forbidden(lambda: m.call(api.forget("fake-pool")), "operator")
    forbidden(lambda: pool_call(keys, "engine", pool.tcp, "clear", {}), "operator")
    assert "fake-pool" not in [n["node"] for n in admin.nodes()]
    assert pool_call(keys, "operator", pool.tcp, "stats", {})["tier"]["used_bytes"] == 8 * BB  # nothing cleared
    assert "op 'clear' needs an operator key" in pool.log()  # and the pool says so


def test_a_daemon_key_registers_its_node_but_moves_no_blocks(cluster, keys):
    master, pool, admin = cluster
    assert [n["labels"].get("role") for n in admin.nodes()] == ["pool"]  # the pool registered with its daemon key
    with client(keys, "daemon_client", master.endpoint) as m:
        register(m, "pool-b")
        assert m.ping()["nodes"]["syncing"] == 1
        forbidden(lambda: m.call(api.forget("pool-b")), "operator")
    forbidden(lambda: pool_call(keys, "daemon_client", pool.tcp, "hello", {"block_bytes": BB}), "engine")
    forbidden(lambda: pool_call(keys, "daemon_client", pool.tcp, "get", {"keys": b"\0" * 16}), "engine")
    assert admin.call(api.forget("pool-b")) is True  # the operator cleans up


def test_an_operator_key_clears_a_pool_and_forgets_a_node(cluster, keys, make_keys):
    master, pool, admin = cluster
    conn = connect(pool.tcp, BB, transport="tcp", timeout_s=3.0, auth=ClientKeys.load(keys["operator"], pool.tcp))
    try:
        ks = make_keys(4, start=500)
        assert conn.put(ks, rows_of(blocks_for(ks, BB))) == [True] * 4  # operators may do what engines do
    finally:
        conn.close()
    assert pool_call(keys, "operator", pool.tcp, "clear", {})["removed"] >= 4
    assert pool_call(keys, "operator", pool.tcp, "stats", {})["tier"]["used_bytes"] == 0
    with client(keys, "daemon_client", master.endpoint) as d:
        register(d, "pool-c")
    assert admin.call(api.forget("pool-c")) is True
    assert "pool-c" not in [n["node"] for n in admin.nodes()]
    forbidden(lambda: register(admin, "pool-d"), "daemon")  # an operator is not a pool either


def test_only_an_operator_key_asks_a_pool_for_a_copy(cluster, keys, make_keys):
    """copy_from makes a pool dial an endpoint the caller names and store what comes back: engine, daemon and
    legacy keys are refused (the role check, before the op runs); an operator's is admitted (the copy then
    runs: here from the pool itself, whose daemon key may not read it, so the source is unavailable)."""
    master, pool, admin = cluster
    body = {"source": pool.tcp, "keys": wire.pack_keys(make_keys(2, start=900))}
    for who in ("engine", "daemon_client", "legacy"):
        forbidden(lambda who=who: pool_call(keys, who, pool.tcp, "copy_from", body), "operator")
    with pytest.raises(PoolRefused) as e:
        pool_call(keys, "operator", pool.tcp, "copy_from", body)
    assert e.value.code == wire.ERR_UNAVAILABLE, e.value


def test_a_key_straight_in_authorized_is_an_engine(cluster, keys, make_keys):
    master, pool, admin = cluster
    with client(keys, "legacy", master.endpoint) as m:
        assert m.ping()["version"] == wire.VERSION
        forbidden(lambda: register(m, "legacy-pool"), "daemon")
    forbidden(lambda: pool_call(keys, "legacy", pool.tcp, "clear", {}), "operator")
    assert "admitted as engines" in master.log() and "legacy.key" in master.log()


def test_with_the_layout_before_roles_an_admitted_key_still_cannot_register_or_clear(tmp_path, make_keys):
    """The keys as docs/pool.md's layout before roles made them (no role, every client key straight in authorized/):
    such a key is an engine's, so it still moves blocks but no longer registers pools or clears them."""
    daemon, engine = tmp_path / "daemon", tmp_path / "engine"
    generate(daemon, "server")
    generate(engine)
    (daemon / "authorized").mkdir()
    shutil.copy(engine / "client.key", daemon / "authorized" / "engine-1.key")
    shutil.copy(daemon / "server.key", engine / "server.key")
    with MasterProcess(tmp_path, args=("--auth-dir", str(daemon))) as master, \
            PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, args=("--auth-dir", str(daemon))) as pool:
        conn = connect(pool.tcp, BB, transport="tcp", timeout_s=3.0, auth=ClientKeys.load(engine, pool.tcp))
        try:
            ks = make_keys(2, start=900)
            assert conn.put(ks, rows_of(blocks_for(ks, BB))) == [True, True]
        finally:
            conn.close()
        with MasterClient(master.endpoint, timeout_s=3.0, auth=ClientKeys.load(engine, master.endpoint)) as m:
            with pytest.raises(MasterError) as e:
                register(m, "fake-pool")
            assert e.value.code == wire.ERR_FORBIDDEN
            assert m.nodes() == []
        ch_keys = {"engine": engine}
        with pytest.raises(PoolRefused) as e:
            pool_call(ch_keys, "engine", pool.tcp, "clear", {})
        assert e.value.code == wire.ERR_FORBIDDEN


def test_a_key_in_the_wrong_roles_directory_stops_the_daemon(tmp_path, keys):
    bad = tmp_path / "daemon"
    shutil.copytree(keys["daemon"], bad)
    shutil.copy(keys["engine"] / "client.key", bad / "authorized" / "operators" / "oops.key")
    r = subprocess.run([sys.executable, "-m", "kvtier.master", "--bind", "tcp://127.0.0.1:*", "--metrics-port", "-1",
                        "--auth-dir", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "oops.key is a engine key" in r.stderr and "authorized/engines/" in r.stderr, r.stderr


def test_keys_generate_writes_the_role_and_says_where_the_key_goes(tmp_path, capsys):
    from kvtier.auth.roles import declared_role
    from kvtier.tools.cli import main as kvtier_main

    assert kvtier_main(["keys", "generate", str(tmp_path / "ops"), "--role", "operator"]) == 0
    out = capsys.readouterr().out
    assert "authorized/operators/" in out
    assert declared_role(tmp_path / "ops" / "client.key") == "operator"
    assert kvtier_main(["keys", "generate", str(tmp_path / "d"), "--role", "daemon"]) == 0
    assert declared_role(tmp_path / "d" / "server.key") == "daemon"


# ---- without keys: a node id belongs to its registration ------------------------------------------------------

def test_a_stranger_can_neither_say_goodbye_for_a_live_pool_nor_register_over_it(tmp_path):
    with MasterProcess(tmp_path, lease_s=30.0) as master, \
            PoolProcess(tmp_path, capacity="8MiB", block_bytes=BB, master=master.endpoint) as pool:
        with MasterClient(master.endpoint, timeout_s=3.0) as stranger:
            assert until(lambda: [n["state"] for n in stranger.nodes()] == ["live"], 15.0), master.log()[-3000:]
            real = stranger.nodes()[0]
            # Everything nodes shows, tried as the node's proof of identity.
            for incarnation in (real["incarnation"], real["node"], "x"):
                with pytest.raises(MasterError) as e:
                    stranger.call(api.goodbye(real["node"], incarnation))
                assert e.value.code == wire.ERR_UNKNOWN_NODE
            with pytest.raises(MasterError) as e:
                stranger.call(api.register(real["node"], uuid.uuid4().hex, 0, [("dram", 1 << 40)],
                                           "tcp://10.6.6.6:6666", {"role": "pool"}))
            assert e.value.code == wire.ERR_NODE_OWNED and "goodbye" in e.value.message
            after = stranger.nodes()
            assert [(n["node"], n["state"], n["address"]) for n in after] == \
                [(real["node"], "live", real["address"])]
            assert stranger.route_put([BB] * 4, labels={"role": "pool"}) == [(real["node"], "dram")] * 4
            assert "said goodbye" not in master.log()
        assert pool.terminate() == 0  # its own goodbye works ...
        with MasterClient(master.endpoint, timeout_s=3.0) as m:
            assert until(lambda: [n["state"] for n in m.nodes()] == ["dead"], 5.0)
            # ... and then the id is free for whoever registers next.
            assert m.call(api.register(real["node"], uuid.uuid4().hex, 0, [("dram", 1 << 30)])).resync


# ---- binding beyond loopback without keys ---------------------------------------------------------------------

@pytest.mark.parametrize("daemon", ["kvtier.master", "kvtier.pool"])
def test_binding_beyond_loopback_without_keys_needs_insecure_bind(tmp_path, daemon):
    cmd = [sys.executable, "-m", daemon, "--bind", "tcp://0.0.0.0:*"]
    cmd += ["--metrics-port", "-1"] if daemon == "kvtier.master" else ["--capacity", "4MiB", "--rdma", "off"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--insecure-bind" in r.stderr and "tcp://0.0.0.0:*" in r.stderr, r.stderr


def test_insecure_bind_serves_and_warns(tmp_path):
    m = MasterProcess(tmp_path, args=("--insecure-bind",))
    m.bind = "tcp://0.0.0.0:*"
    with m:
        assert "WITHOUT AUTHENTICATION" in m.log()
        port = m.endpoint.rpartition(":")[2]
        with MasterClient(f"tcp://127.0.0.1:{port}") as c:
            assert c.ping()["version"] == wire.VERSION
    with PoolProcess(tmp_path, host="0.0.0.0", capacity="4MiB", args=("--insecure-bind",)) as p:
        assert "WITHOUT AUTHENTICATION" in p.log()


def test_one_key_cannot_take_every_hint_or_node_slot(tmp_path, keys):
    """Per-key quotas (--max-hints-per-client, --max-nodes-per-client): what one key holds is bounded apart
    from the totals, so another key is still served."""
    args = ("--auth-dir", str(keys["daemon"]), "--max-hints-per-client", "5", "--max-nodes-per-client", "2")
    with MasterProcess(tmp_path, lease_s=30.0, args=args) as master:
        with client(keys, "engine", master.endpoint) as e, client(keys, "operator", master.endpoint) as o:
            for i in range(5):
                e.pin(session=f"s{i}", ttl_s=60)
            with pytest.raises(MasterError) as err:
                e.pin(session="s5", ttl_s=60)
            assert err.value.code == wire.ERR_TOO_LARGE and "--max-hints-per-client" in err.value.message
            e.pin(session="s0", ttl_s=120)  # extending its own hint adds none
            assert o.pin(session="other", ttl_s=60) == 1  # another key is still served
            e.unpin(session="s1")
            e.pin(session="s5", ttl_s=60)
            assert sorted(o.hints().session_pins) == ["other", "s0", "s2", "s3", "s4", "s5"]
        with client(keys, "daemon_client", master.endpoint) as d:
            register(d, "a")
            register(d, "b")
            with pytest.raises(MasterError) as err:
                register(d, "c")
            assert err.value.code == wire.ERR_TOO_LARGE and "--max-nodes-per-client" in err.value.message


@pytest.mark.parametrize("program", ["kvtier-pool", "kvtier-master"])
def test_the_readmes_daemon_commands_bind_beyond_loopback_only_with_keys_or_insecure_bind(program):
    """Each daemon command of README.md and docs/, as its CLI would check it: a command that serves a network
    says how (--auth-dir or --insecure-bind), so it starts as written."""
    import logging

    from kvtier.auth.exposure import check_binds
    from kvtier.master.cli import build_parser as master_parser
    from kvtier.pool.cli import build_parser as pool_parser
    from test_vllm_connector_modes import readme_commands

    parser = {"kvtier-pool": pool_parser, "kvtier-master": master_parser}[program]()
    for words in readme_commands(program):
        args = parser.parse_args(words[1:])
        binds = args.bind if isinstance(args.bind, list) else [args.bind or "tcp://127.0.0.1:7300"]
        check_binds(program, binds, auth=bool(args.auth_dir), insecure=args.insecure_bind,
                    log=logging.getLogger("test"))
