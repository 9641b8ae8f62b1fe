"""Issue 23 item 1: a pool copies only bytes a pool serves, never a file a peer names; only the cluster asks.

The attack (real daemons, a real fake): a process posing as a pool (tests/fake_pool.py, on an ipc:// socket
of its own, running as uid 65534 where the test runs as root) answers hello naming, as its shared-memory
file, root's 0600 file of secret bytes. Before the fix a keyless caller's ``copy_from`` made a real pool map
that file and copy it into blocks under keys the caller chose (a ``get`` then returned the secret), and the
master's replication did the same for a fake registered node. Now:

* a keyless pool refuses ``copy_from`` from anyone but a process of its own uid on its ipc socket (a tcp
  caller is refused), one log line and ``kvtier_pool_copies_refused{reason="not_cluster"}``;
* an admitted copy (the pool's own user; the master's replication work) gets the source's blocks as bytes on
  a socket: the fake, which cannot read the secret, has none to send, so nothing is copied;
* an engine dialing the fake refuses to map a file the fake's uid does not own (and so writes nothing into
  root's file);
* the master refuses a node registering an endpoint another live node holds, and a pool refuses a source that
  answers as another node than the master named.

The secret counts apart: a get that returns it is a leak, a hit with other bytes would be wrong bytes; both
fail. Negative control: the same copy from a real pool copies every block (test_pool_replication.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemonproc import DaemonProcess
from kvtier import wire
from kvtier.client import MasterClient, MasterError, NodeAgent, api
from kvtier.transport import PoolError, connect
from kvtier.transport.channel import Channel
from kvtier.transport.dial import shared_context
from kvtier.wire import pool as P
from masterproc import MasterProcess
from poolproc import PoolProcess, wait_for

BB = 16 << 10
NOBODY = 65534
FAKE = str(Path(__file__).parent / "fake_pool.py")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the fake pool must run as another uid than the test")


class FakePool(DaemonProcess):
    """tests/fake_pool.py as a subprocess, as ``uid``, on a socket in a fresh world-writable directory."""

    what = "fake pool"

    def __init__(self, tmp: Path, shm: Path, nbytes: int, node: str = "fake", uid: int | None = NOBODY) -> None:
        super().__init__(Path(tmp) / "fake.log")
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-fake-pool-"))
        self.dir.chmod(0o777)
        self.endpoint = f"ipc://{self.dir}/fake.sock"
        self.cfg = {"bind": self.endpoint, "ready": str(self.dir / "ready"), "shm": str(shm), "nbytes": nbytes,
                    "block_bytes": BB, "node": node, "uid": uid}

    def __enter__(self) -> FakePool:
        self._spawn([sys.executable, FAKE, json.dumps(self.cfg)], Path(self.cfg["ready"]), 30.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def secret(tmp_path) -> tuple[Path, bytes]:
    """Root's 0600 file of two blocks of secret bytes."""
    data = np.random.default_rng(23).integers(0, 256, 2 * BB, dtype=np.uint8).tobytes()
    path = tmp_path / "secret.bin"
    path.write_bytes(data)
    path.chmod(0o600)
    return path, data


def counters(endpoint: str) -> dict:
    ch = Channel(endpoint, shared_context(), timeout_s=5.0)
    try:
        return ch.call(P.STATS, {}).body["counters"]
    finally:
        ch.close()


def refused_metric(port: int, reason: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvtier_pool_copies_refused_total" and s.labels == {"reason": reason}:
                return s.value
    return -1.0


def assert_not_leaked(endpoint: str, keys: list[bytes], data: bytes) -> None:
    """A get of ``keys`` from the pool at ``endpoint``: misses, and no byte of the secret in the buffer."""
    c = connect(endpoint, BB, transport="tcp", timeout_s=5.0)
    try:
        out = np.zeros((len(keys), BB), np.uint8)
        hits = c.get(keys, np.uint64(out.ctypes.data) + np.arange(len(keys), dtype=np.uint64) * np.uint64(BB))
    finally:
        c.close()
    leaked = [out[i].tobytes() == data[i * BB:(i + 1) * BB] for i in range(len(keys))]
    assert not any(leaked), "the pool served the secret file's bytes"
    assert hits == [False] * len(keys), "wrong bytes under the keys"


@root_only
def test_a_keyless_copy_from_a_tcp_caller_is_refused_logged_and_counted(tmp_path, secret, make_keys):
    path, data = secret
    keys = make_keys(2, start=2300)
    with FakePool(tmp_path, path, 2 * BB) as fake, \
            PoolProcess(tmp_path, name="victim", ipc=True, capacity="4MiB", block_bytes=BB,
                        args=("--metrics-port", "0")) as pool:
        ch = Channel(pool.tcp, shared_context(), timeout_s=10.0)
        with pytest.raises(PoolError) as err:
            ch.call(P.COPY_FROM, {"source": fake.endpoint, "keys": wire.pack_keys(keys)})
        ch.close()
        assert err.value.code == wire.ERR_FORBIDDEN and "ipc://" in err.value.message, err.value
        assert_not_leaked(pool.tcp, keys, data)
        assert counters(pool.ipc).get("copy_refused_not_cluster") == 1
        assert refused_metric(pool.info["metrics_port"], "not_cluster") == 1
        lines = [ln for ln in pool.log().splitlines() if "copy_from" in ln and "refused" in ln]
        assert len(lines) == 1 and "127.0.0.1" in lines[0] and fake.endpoint in lines[0], lines


@root_only
def test_an_admitted_copy_never_maps_the_file_the_source_names(tmp_path, secret, make_keys):
    """The pool's own user asks (over its ipc socket): admitted, and the copy gets the source's blocks as bytes
    on a socket; the fake has no bytes of the secret to send, so nothing is copied."""
    path, data = secret
    keys = make_keys(2, start=2310)
    with FakePool(tmp_path, path, 2 * BB) as fake, \
            PoolProcess(tmp_path, name="victim", ipc=True, capacity="4MiB", block_bytes=BB) as pool:
        ch = Channel(pool.ipc, shared_context(), timeout_s=10.0)
        answer = ch.call(P.COPY_FROM, {"source": fake.endpoint, "keys": wire.pack_keys(keys)})
        with pytest.raises(PoolError) as err:  # admitted caller, but a source no pool can be at
            ch.call(P.COPY_FROM, {"source": "inproc://kvtier-pool", "keys": wire.pack_keys(keys)})
        ch.close()
        assert err.value.code == wire.ERR_FORBIDDEN and f":{os.getpid()} refused" in err.value.message, err.value
        assert counters(pool.ipc).get("copy_refused_bad_source") == 1
        assert (answer.body["copied"], answer.body["missing"]) == (0, 2)
        assert_not_leaked(pool.tcp, keys, data)
        assert path.read_bytes() == data


@root_only
def test_an_engine_refuses_to_map_a_file_a_fake_pool_does_not_own(tmp_path, secret, make_keys):
    """The same fake dialed by an engine: the file it names is root's, the fake runs as 65534, so the engine
    maps nothing: no secret read, no block written into root's file."""
    path, data = secret
    keys = make_keys(2, start=2320)
    with FakePool(tmp_path, path, 2 * BB) as fake:
        with pytest.raises(PoolError) as err:
            c = connect(fake.endpoint, BB, timeout_s=5.0)  # shm: the hello's file is mapped at once
            src = np.full((2, BB), 0xAB, np.uint8)
            c.put(keys, np.uint64(src.ctypes.data) + np.arange(2, dtype=np.uint64) * np.uint64(BB))
        assert f"owned by uid 0, the pool runs as uid {NOBODY}" in err.value.message, err.value
    assert path.read_bytes() == data


def replicate_from_fake_node(tmp_path, secret, keys, answers_as: str) -> dict:
    """A fake node "fake" registers with the master (keyless) at the fake pool's endpoint, holding ``keys``,
    which get hot; the master asks the real pool pa to copy them from there. The fake pool answers hello as
    ``answers_as``. Returns pa's counters once it has tried (or refused) the copy; asserts nothing leaked."""
    path, data = secret
    args = ("--replicate-heat", "3", "--replicate-interval-s", "0.3", "--heat-half-life-s", "5")
    with MasterProcess(tmp_path, lease_s=2.0, args=args) as mp, \
            FakePool(tmp_path, path, 2 * BB, node=answers_as) as fake, \
            PoolProcess(tmp_path, name="pa", ipc=True, capacity="8MiB", block_bytes=BB, master=mp.endpoint,
                        args=("--heartbeat-s", "0.1")) as pa, MasterClient(mp.endpoint) as m:
        agent = NodeAgent(mp.endpoint, "fake", [("dram", 8 << 20)], block_bytes=BB, address=fake.endpoint,
                          labels=P.POOL_LABELS, initial={"dram": keys}, heartbeat_s=0.1).start()
        try:
            assert agent.wait_synced(10.0)
            wait_for(lambda: sum(n["state"] == "live" for n in m.nodes()) == 2, what="pa and the fake node live")
            wait_for(lambda: m.lookup(keys, touch=False).any == len(keys), what="the fake node's keys")
            for _ in range(6):
                m.locate(keys)

            def tried() -> dict | None:
                c = counters(pa.ipc)
                done = ("replicate_missing", "replicate_copied", "copy_refused_wrong_node")
                return c if sum(c.get(name, 0) for name in done) else None
            got = wait_for(tried, 20.0, "the master's copy work done by pa")
            assert_not_leaked(pa.tcp, keys, data)
            return got
        finally:
            agent.close()


@root_only
def test_the_masters_replication_from_a_fake_node_copies_no_file(tmp_path, secret, make_keys):
    """The fake answers as the node it registered: the copy runs, as bytes on a socket, and gets none."""
    c = replicate_from_fake_node(tmp_path, secret, make_keys(2, start=2330), answers_as="fake")
    assert c.get("replicate_copied", 0) == 0 and c.get("replicate_missing", 0) == 2, c


@root_only
def test_a_pool_refuses_a_source_that_is_not_the_node_the_master_named(tmp_path, secret, make_keys):
    """The fake answers as another node than the one registered at its endpoint: refused before any get,
    counted as wrong_node (and logged once)."""
    c = replicate_from_fake_node(tmp_path, secret, make_keys(2, start=2340), answers_as="someone-else")
    assert c.get("copy_refused_wrong_node", 0) >= 1 and c.get("replicate_missing", 0) == 0, c


def test_a_node_cannot_register_an_endpoint_another_node_holds(tmp_path, make_keys):
    """A stranger registering a live pool's endpoint under its own name is refused (node_owned), logged with the
    name it claimed and counted in the master's requests by status; the pool's own registration stands."""
    with MasterProcess(tmp_path, lease_s=5.0) as mp, \
            PoolProcess(tmp_path, name="pa", capacity="4MiB", block_bytes=BB, master=mp.endpoint,
                        args=("--heartbeat-s", "0.1")) as pa, MasterClient(mp.endpoint) as m:
        wait_for(lambda: [n["state"] for n in m.nodes()] == ["live"], what="the pool live")
        address = m.nodes()[0]["address"]
        assert address == pa.tcp
        with pytest.raises(MasterError) as err:
            m.call(api.register("thief", "i-thief", 0, [("dram", 1 << 20)], address, P.POOL_LABELS))
        assert err.value.code == wire.ERR_NODE_OWNED and "'thief'" in err.value.message, err.value
        with pytest.raises(MasterError) as err:  # nor an endpoint no pool can be at
            m.call(api.register("thief", "i-thief", 0, [("dram", 1 << 20)], "inproc://pool", P.POOL_LABELS))
        assert err.value.code == wire.ERR_BAD_REQUEST and "address" in err.value.message, err.value
        assert [(n["node"], n["address"]) for n in m.nodes()] == [(pa.info["node"], address)]
        text = urllib.request.urlopen(f"http://127.0.0.1:{mp.metrics_port}/metrics", timeout=5).read().decode()
        assert 'kvtier_master_requests_total{op="register",status="node_owned"} 1.0' in text
        assert sum("thief" in ln and "node_owned" in ln for ln in mp.log().splitlines()) == 1
