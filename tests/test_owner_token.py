"""A keyless kvtier-master and kvtier-pool (a default start: no --auth-dir, loopback and ipc) serve only their
own user's processes: another local user (uid 65534, nobody, a real process under setpriv) can neither read
nor write a block, clear the pool, register a node, reach the data port, map the shared memory, connect to the
ipc socket nor read the owner token; each refusal is counted and logged. The pool's user needs no
configuration (the pool itself reports to the master that way). Negative controls: the stranger handed the
token, and a pool started with --insecure-bind, do overwrite a block, so the checks can fail
(kvtier/auth/owner.py, docs/reliability.md section 11)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import blocks_for
from kvtier.auth.owner import RUNTIME_ENV, runtime_dir, token_name
from kvtier.client import MasterClient, api
from kvtier.keys import Namespace
from kvtier.transport import connect
from masterproc import MasterProcess
from poolproc import PoolProcess, until

BB = 16 << 10
NOBODY = 65534
STRANGER = 0xA5  # tests/owner_attacker.py writes blocks of this byte
ATTACKER = str(Path(__file__).parent / "owner_attacker.py")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="plays another local user: needs root and setpriv")


def rows_of(t: torch.Tensor) -> np.ndarray:
    return np.uint64(t.data_ptr()) + np.arange(t.shape[0], dtype=np.uint64) * np.uint64(t.shape[1])


@pytest.fixture
def shared_dir():
    """A directory every user may enter (pytest's tmp_path is root's only, which would hide the ipc socket and
    the shared memory whatever their modes): the modes of what the pool creates must do the work."""
    d = Path(tempfile.mkdtemp(prefix="kvtier-owner-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def stranger_dir(shared_dir):
    """The stranger's own runtime directory (0700, nobody's): empty, or holding the tokens it is handed."""
    d = shared_dir / "stranger"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    return d


def attack(cfg: dict, runtime: Path) -> dict:
    """tests/owner_attacker.py as uid 65534 with ``runtime`` as its runtime directory: {attack: outcome}."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp", RUNTIME_ENV: str(runtime)}
    r = subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
                        sys.executable, ATTACKER, json.dumps(cfg)], env=env, cwd="/", capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out.pop("uid") == NOBODY
    return out


def hand_token(endpoint: str, to: Path, token: str | None = None) -> None:
    """Put the owner token of ``endpoint`` (or ``token``: a guess) where the stranger's client looks."""
    name = token_name(endpoint)
    path = to / name
    path.write_text(token if token is not None else (runtime_dir() / name).read_text())
    path.chmod(0o600)
    os.chown(path, NOBODY, NOBODY)


def read_back(endpoint: str, keys: list[bytes], want: torch.Tensor) -> tuple[int, int]:
    """(misses, wrong blocks) of reading ``keys`` from the pool as its own user, with no configuration."""
    out = torch.zeros_like(want)
    conn = connect(endpoint, BB, transport="tcp", timeout_s=3.0)
    try:
        hits = conn.get(keys, rows_of(out))
    finally:
        conn.close()
    misses = hits.count(False)
    wrong = sum(1 for i, h in enumerate(hits) if h and not torch.equal(out[i], want[i]))
    return misses, wrong


def metric(port: int, name: str, label: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def put_as_owner(endpoint: str, keys: list[bytes], blocks: torch.Tensor) -> list[bool]:
    conn = connect(endpoint, BB, transport="tcp", timeout_s=3.0)
    try:
        return conn.put(keys, rows_of(blocks))
    finally:
        conn.close()


def test_another_local_user_can_neither_read_nor_write_a_keyless_pool_nor_join_its_master(shared_dir, stranger_dir):
    keys = Namespace("owner-test").keys(range(18))
    src = blocks_for(keys, BB)
    stored, target, control = keys[:16], keys[16], keys[17]  # the stranger stores under target, control first
    with MasterProcess(shared_dir) as master, \
            PoolProcess(shared_dir, ipc=True, block_bytes=BB, master=master.endpoint,
                        args=("--metrics-port", "0", "--lease-s", "5")) as pool:
        # The pool's user: no keys, no configuration (the pool itself found the master's token the same way: it
        # registered).
        assert put_as_owner(pool.tcp, stored, src[:16]) == [True] * 16
        owner = MasterClient(master.endpoint, timeout_s=3.0)
        assert until(lambda: [n["node"] for n in owner.call(api.nodes())] == [pool.info["node"]])

        cfg = {"master": master.endpoint, "pool_tcp": pool.tcp, "pool_ipc": pool.ipc,
               "stream_port": pool.info["stream_port"], "shm_path": pool.info["shm_path"],
               "token_dir": str(runtime_dir()), "token_file": str(runtime_dir() / token_name(pool.tcp)),
               "key": target.hex(), "block_bytes": BB}
        assert pool.info["stream_port"] and pool.info["shm_path"]
        got = attack(cfg, stranger_dir)
        assert not [a for a, outcome in got.items() if outcome == "ok"], got
        for a in ("put_tcp", "put_stream", "get", "clear", "register"):
            assert "Unavailable" in got[a] or "Timeout" in got[a], (a, got[a])  # no reply: never served
        for a in ("shm_file", "token_dir", "token_file", "ipc_socket", "put_shm"):
            assert "Permission" in got[a] or "Unavailable" in got[a], (a, got[a])
        assert got["stream_raw"] == "answered 'closed unanswered'"

        # Nothing changed: the engine's later put of target stores its own bytes, every block reads back as its
        # key's bytes, none cleared, no stranger's node.
        assert put_as_owner(pool.tcp, [target], src[16:17]) == [True]
        assert read_back(pool.tcp, keys[:17], src[:17]) == (0, 0)
        assert [n["node"] for n in owner.call(api.nodes())] == [pool.info["node"]]
        # Each refusal counted and logged: who (where from, what it claims), what (the port), why.
        pm, mm = pool.info["metrics_port"], master.metrics_port
        # (zmq reports a refused handshake from its own thread: it may come a moment after the client gave up.)
        # A client without the token either sends its mechanism (a mismatch) or hangs up on seeing the daemon's:
        # either is a refusal, counted and logged.
        assert until(lambda: metric(pm, "kvtier_pool_refused_connections_total", 'reason="no_owner_token"')
                     + metric(pm, "kvtier_pool_refused_connections_total", 'reason="closed_in_handshake"') >= 4)
        assert until(lambda: metric(pm, "kvtier_pool_refused_connections_total", 'reason="bad_token"') >= 1)
        assert until(lambda: metric(mm, "kvtier_master_refused_connections_total", 'reason="no_owner_token"')
                     + metric(mm, "kvtier_master_refused_connections_total", 'reason="closed_in_handshake"') >= 1)
        for log in (pool.log(), master.log()):
            assert "refused a connection on tcp://127.0.0.1:" in log and "owner token" in log
        assert "data connection from ('127.0.0.1'" in pool.log() and "refused: a wrong token" in pool.log()

        # A guessed token: refused, counted, logged with what the client says it is.
        hand_token(pool.tcp, stranger_dir, token="guess" * 8)
        assert "Unavailable" in attack({**cfg, "key": control.hex(), "only_put": True}, stranger_dir)["put_tcp"]
        assert until(lambda: metric(pm, "kvtier_pool_refused_connections_total", 'reason="wrong_owner_token"') >= 1)
        assert f"(says 'uid={NOBODY} pid=" in pool.log() and "wrong owner token" in pool.log()

        # Negative control: handed the token, the same stranger stores under control before the engine does, and
        # the engine's read of control returns the stranger's bytes: the checks above can fail.
        hand_token(pool.tcp, stranger_dir)
        assert attack({**cfg, "key": control.hex(), "only_put": True}, stranger_dir)["put_tcp"] == "ok"
        assert put_as_owner(pool.tcp, [control], src[17:]) == [True]
        assert read_back(pool.tcp, keys, src) == (0, 1)
        stranger = src.clone()
        stranger[17].fill_(STRANGER)
        assert read_back(pool.tcp, keys, stranger) == (0, 0)
        owner.close()


def test_insecure_bind_is_the_explicit_choice_to_serve_every_local_user(shared_dir, stranger_dir):
    """The negative control on the daemon's side: the same stranger, no token, a pool started with
    --insecure-bind: its put lands (and the pool said so at start)."""
    keys = Namespace("owner-test-open").keys(range(4))
    src = blocks_for(keys, BB)
    with PoolProcess(shared_dir, block_bytes=BB, args=("--insecure-bind",)) as pool:
        cfg = {"pool_tcp": pool.tcp, "key": keys[0].hex(), "block_bytes": BB, "only_put": True}
        assert attack(cfg, stranger_dir)["put_tcp"] == "ok"
        assert put_as_owner(pool.tcp, keys, src) == [True] * 4
        assert read_back(pool.tcp, keys, src) == (0, 1)
        assert "WITHOUT AUTHENTICATION (--insecure-bind): any local user" in pool.log()


def test_a_token_directory_that_is_not_ours_stops_the_daemon(shared_dir):
    """Another user who made the runtime directory first gets a start-up error, not our token."""
    squat = shared_dir / "squat"
    squat.mkdir(mode=0o700)
    os.chown(squat, NOBODY, NOBODY)
    r = subprocess.run([sys.executable, "-m", "kvtier.pool", "--bind", "tcp://127.0.0.1:*", "--capacity", "1MiB",
                        "--rdma", "off"], env={**os.environ, RUNTIME_ENV: str(squat)}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and f"belongs to uid {NOBODY}" in r.stderr, r.stderr[-2000:]
    assert list(squat.iterdir()) == []
