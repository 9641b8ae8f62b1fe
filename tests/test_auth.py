"""Authenticated sockets, with real daemons and real CurveZMQ: a kvtier-pool and a kvtier-master started with
--auth-dir serve the clients whose keys they list (bytes round-trip over stream, tcp and shm; lookups and
placements through the master, with the pool reporting to it over CURVE too), stay silent to a client with
another key or none (whose error says keys may be why) and go on serving; the pool's raw data port closes a
connection that does not open with a token from an encrypted hello; `kvtier keys generate` writes the keys
with the right modes."""

from __future__ import annotations

import shutil
import socket
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier.auth import ClientKeys, DataTokens, TOKEN_BYTES, generate
from kvtier.tools.cli import main as kvtier_main
from kvtier.client import MasterClient, MasterTimeout
from kvtier.store import TieredStore
from kvtier.transport import connect
from kvtier.transport.base import PoolUnavailable
from masterproc import MasterProcess
from poolproc import PoolProcess, until
from zmtp import RawPeer, greeting

BB = 16 << 10


def rows_of(t: torch.Tensor) -> np.ndarray:
    return np.uint64(t.data_ptr()) + np.arange(t.shape[0], dtype=np.uint64) * np.uint64(t.shape[1])


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """One daemon keypair for the cluster (master and pool share it, as docs/pool.md's layout allows), an authorized
    client, a client whose key no daemon lists, and a client directory with the daemon key but no keypair."""
    root = tmp_path_factory.mktemp("keys")
    daemon, good, stranger, lost = root / "daemon", root / "good", root / "stranger", root / "lost"
    generate(daemon, "server")
    generate(good)
    generate(stranger)
    generate(lost, "server")  # another daemon's key: "lost" holds good's keypair but this as its server.key
    shutil.copy(good / "client.key_secret", lost / "client.key_secret")
    (daemon / "authorized" / "engines").mkdir(parents=True)
    (daemon / "authorized" / "daemons").mkdir()
    shutil.copy(good / "client.key", daemon / "authorized" / "engines" / "engine-1.key")
    shutil.copy(daemon / "server.key", daemon / "authorized" / "daemons" / "pool.key")  # the pool, reporting to the master
    shutil.copy(daemon / "server.key", daemon / "master.key")
    for d in (good, stranger):
        shutil.copy(daemon / "server.key", d / "server.key")
    return {"daemon": daemon, "good": good, "stranger": stranger, "lost": lost}


@pytest.fixture(scope="module")
def pool(tmp_path_factory, keys):
    tmp = tmp_path_factory.mktemp("authpool")
    with PoolProcess(tmp, ipc=True, capacity="8MiB", block_bytes=BB, args=("--auth-dir", str(keys["daemon"]))) as p:
        yield p
        assert p.alive(), "the pool died during the tests"


def null_greeting(endpoint: str) -> None:
    """Speak a keyless zmq client's greeting (NULL mechanism) to ``endpoint`` and wait for the daemon to hang up.
    A libzmq client races the daemon: whichever reads the other's greeting first closes, and a daemon that loses
    sees only a closed connection (the client does not reconnect after a protocol error); this peer never
    closes first, so the daemon always reads the mechanism."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    peer = RawPeer(host, int(port), handshake=False)
    try:
        peer.sock.sendall(greeting())
        assert peer.closed_by_peer(5.0), "the daemon kept a keyless connection open"
    finally:
        peer.close()


def keyless_refused_and_logged(attempt, error: type, daemon, endpoint: str) -> None:
    """A client without keys gets ``error`` saying keys may be why, and the daemon at ``endpoint`` logs a keyless
    client."""
    with pytest.raises(error, match="requires CurveZMQ keys"):
        attempt()
    null_greeting(endpoint)
    assert until(lambda: "without CurveZMQ keys" in daemon.log(), 5.0), \
        f"no log line for a keyless client:\n{daemon.log()[-2000:]}"


def test_keys_generate_writes_a_secret_only_its_owner_reads(tmp_path, capsys):
    d = tmp_path / "new" / "engine"
    assert kvtier_main(["keys", "generate", str(d), "--name", "engine-7"]) == 0
    public, secret = d / "engine-7.key", d / "engine-7.key_secret"
    assert mode(secret) == 0o600 and mode(public) == 0o644 and mode(d) == 0o700
    before = secret.read_bytes()
    assert "secret-key" in before.decode() and "secret-key" not in public.read_text()
    assert kvtier_main(["keys", "generate", str(d), "--name", "engine-7"]) == 2  # never overwritten silently
    assert "exists already" in capsys.readouterr().err and secret.read_bytes() == before
    assert kvtier_main(["keys", "generate", str(d), "--name", "engine-7", "--force"]) == 0
    assert secret.read_bytes() != before and mode(secret) == 0o600


@pytest.mark.parametrize("transport", ["stream", "tcp", "shm"])
def test_an_authorized_client_round_trips_over_every_transport(pool, keys, make_keys, transport):
    endpoint = pool.ipc if transport == "shm" else pool.tcp
    conn = connect(endpoint, BB, transport=transport, timeout_s=2.0, auth=ClientKeys.load(keys["good"], endpoint))
    try:
        assert conn.transport == transport
        ks = make_keys(24, start=1000 * ["stream", "tcp", "shm"].index(transport))
        src = blocks_for(ks, BB)
        assert conn.put(ks, rows_of(src)) == [True] * 24
        out = torch.zeros_like(src)
        assert_all_hits_exact(conn.get(ks, rows_of(out)), out, src)
    finally:
        conn.close()


def test_the_pools_local_files_are_its_owners_only(pool):
    assert mode(Path(pool.ipc[len("ipc://"):])) == 0o600
    assert mode(Path(pool.info["shm_path"])) == 0o600


def test_a_stranger_and_a_keyless_client_are_refused_and_told_why(pool, keys):
    stranger = ClientKeys.load(keys["stranger"], pool.tcp)
    with pytest.raises(PoolUnavailable, match="check auth_dir"):
        connect(pool.tcp, BB, timeout_s=0.5, auth=stranger)
    keyless_refused_and_logged(lambda: connect(pool.tcp, BB, timeout_s=0.5), PoolUnavailable, pool, pool.tcp)
    with pytest.raises(PoolUnavailable, match="check auth_dir"):  # an authorized keypair, the wrong daemon key
        connect(pool.tcp, BB, timeout_s=0.5, auth=ClientKeys.load(keys["lost"], pool.tcp))
    key = stranger.own.public.decode()
    assert until(lambda: all(s in pool.log() for s in (key, "server key is not this")),
                 5.0), pool.log()[-2000:]
    # The pool goes on serving the clients it knows.
    conn = connect(pool.tcp, BB, transport="tcp", timeout_s=2.0, auth=ClientKeys.load(keys["good"], pool.tcp))
    counters = conn.stats()["counters"]
    conn.close()
    assert counters["auth_refused_key"] >= 1 and counters["auth_handshake_failed"] >= 1
    assert pool.log().count(f"key {key} is not in") == 1, "a refused key is logged once a minute, not per retry"


def test_the_data_port_closes_connections_without_a_valid_token(pool, keys, make_keys):
    conn = connect(pool.tcp, BB, transport="stream", timeout_s=2.0, auth=ClientKeys.load(keys["good"], pool.tcp))
    port = conn.info.transports["stream"]["port"]
    assert len(conn.info.transports["stream"]["token"]) == TOKEN_BYTES
    before = conn.stats()["counters"].get("stream_auth_refused", 0)
    host = pool.tcp[len("tcp://"):].rpartition(":")[0]

    def closed_by_pool(first: bytes) -> bool:
        with socket.create_connection((host, port), timeout=5.0) as s:
            s.sendall(first)
            try:
                return s.recv(1) == b""  # closed unanswered (a timeout raises instead)
            except ConnectionResetError:  # closed with bytes it never read
                return True

    silent = socket.create_connection((host, port), timeout=5.0)  # sends nothing: closed at the deadline
    assert closed_by_pool(b"\x10\x00\x00\x00" + b"x" * 16 + b"\x00" * 16)  # a request header, no token
    assert closed_by_pool(DataTokens().issue())  # a well-formed token from another pool's key
    assert closed_by_pool(conn.info.transports["stream"]["token"][:-1] + b"\x00")  # a token tampered with
    t0 = time.monotonic()
    assert silent.recv(1) == b"" and time.monotonic() - t0 < 4.0
    silent.close()
    assert conn.stats()["counters"]["stream_auth_refused"] - before == 4
    ks = make_keys(8, start=50_000)  # the pool still serves the token holder
    src = blocks_for(ks, BB)
    assert all(conn.put(ks, rows_of(src)))
    conn.close()


def test_master_and_pool_serve_authorized_clients_end_to_end(tmp_path, keys, make_keys):
    auth = ["--auth-dir", str(keys["daemon"])]
    with MasterProcess(tmp_path, lease_s=5.0, args=tuple(auth)) as mp:
        opts = {"capacity": "4MiB", "block_bytes": BB, "master": mp.endpoint, "args": (*auth, "--heartbeat-s", "0.2")}
        with PoolProcess(tmp_path, name="pa", **opts) as pa:
            good = ClientKeys.load(keys["good"], mp.endpoint)
            with MasterClient(mp.endpoint, auth=good) as m:  # the pool registered over CURVE too
                assert until(lambda: any(n["address"] == pa.tcp and n["state"] == "live" for n in m.nodes()))
                ks = make_keys(30, start=70_000)
                cfg = {"mode": "distributed", "master": mp.endpoint, "node_id": "engine-1", "dram_capacity": 64 * BB,
                       "pool_timeout_ms": 2000, "auth_dir": str(keys["good"])}
                with TieredStore.from_config(cfg, BB) as writer:
                    assert writer.put(ks, blocks_for(ks, BB)).stored == 30
                    assert writer.flush(10.0)
                    assert writer.stats()["offloads"]["pool"]["written"] == 30  # route_put, then stream with token
                assert until(lambda: all(w >= 0 for w in m.locate(ks, {"role": "pool"}).where))
                assert m.lookup(ks).any == 30  # the pool's events reached the directory
                with TieredStore.from_config({**cfg, "node_id": "engine-2"}, BB) as reader:
                    out = torch.empty(30, BB, dtype=torch.uint8)
                    assert_all_hits_exact(reader.get(ks, out), out, blocks_for(ks, BB))
                stranger = ClientKeys.load(keys["stranger"], mp.endpoint)
                with MasterClient(mp.endpoint, 0.5, auth=stranger) as c, pytest.raises(MasterTimeout,
                                                                                       match="check auth_dir"):
                    c.ping()

                def keyless_ping() -> None:
                    with MasterClient(mp.endpoint, 0.5) as c:
                        c.ping()
                keyless_refused_and_logged(keyless_ping, MasterTimeout, mp, mp.endpoint)
                assert m.ping()  # still serving the clients it knows
                assert until(lambda: "is not in" in mp.log(), 5.0)  # logged on the ZAP thread
