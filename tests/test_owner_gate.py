"""kvtier/auth/owner.py's OwnerGate on real zmq sockets: each bound endpoint admits only its own token, an ipc
peer of another uid is refused whatever it presents, token file names never collide, and a daemon that stops
cleanly takes its token files with it (a killed one keeps them, for its successor). The other-uid cases run a
real client as uid 65534 under setpriv (root only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvtier.auth.owner import OwnerGate, owner_token, runtime_dir, token_name
from poolproc import PoolProcess

NOBODY = 65534
AS_NOBODY = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                               reason="plays another local user: needs root and setpriv")

# A client that presents ``token`` on ``endpoint`` and says whether the server answered (the handshake passed).
CLIENT = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.plain_username, s.plain_password = b"probe", sys.argv[2].encode()
s.connect(sys.argv[1])
s.send(b"ping")
print("answered" if s.poll(2000) else "silent")
s.close(0)
ctx.term()
"""


def dial(endpoint: str, token: str, user: int | None = None) -> str:
    cmd = [sys.executable, "-c", CLIENT, endpoint, token]
    if user is not None:
        cmd = ["setpriv", "--reuid", str(user), "--regid", str(user), "--clear-groups", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


class Served:
    """A ROUTER behind an OwnerGate bound on ``binds``, answering every message; ``published``: its tokens."""

    def __init__(self, binds: list[str]) -> None:
        self.counts: list[str] = []
        self.ctx = zmq.Context()
        self.gate = OwnerGate(self.counts.append, binds)
        self.gate.start(self.ctx)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.endpoints = []
        for b in binds:
            self.gate.secure(self.sock, b)
            self.sock.bind(b)
            self.endpoints.append(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
            if b.startswith("ipc://"):
                os.chmod(b[len("ipc://"):], 0o666)  # the socket file lets anyone try: the gate must refuse
        self.gate.publish(self.endpoints)
        self._stop = False
        self._thread = threading.Thread(target=self._echo, daemon=True)
        self._thread.start()

    def _echo(self) -> None:
        while not self._stop:
            if self.sock.poll(50):
                ident, msg = self.sock.recv_multipart()
                self.sock.send_multipart([ident, msg])

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close(0)
        self.gate.stop()
        self.ctx.term()


@pytest.fixture
def public_dir():
    d = Path(tempfile.mkdtemp(prefix="kvtier-gate-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_each_endpoint_admits_only_its_own_token(public_dir):
    """A pool bound on tcp and on an ipc path that kept an earlier daemon's token: the ipc token opens only the
    ipc endpoint, the fresh (tcp) token only the tcp one."""
    ipc = f"ipc://{public_dir}/p.sock"
    kept = "k" * 43
    path = runtime_dir(create=True) / token_name(ipc)
    path.write_text(kept)
    path.chmod(0o600)
    served = Served(["tcp://127.0.0.1:*", ipc])
    try:
        tcp = served.endpoints[0]
        fresh = owner_token(tcp)
        assert fresh is not None and fresh != kept and owner_token(ipc) == kept
        assert dial(tcp, fresh) == "answered" and dial(ipc, kept) == "answered"
        assert dial(tcp, kept) == "silent" and dial(ipc, fresh) == "silent"
        assert served.counts.count("auth_refused_token") == 2 and served.gate.refused == 2
    finally:
        served.close()


@AS_NOBODY
def test_another_uid_on_ipc_is_refused_even_with_the_right_token(public_dir, caplog):
    """The kernel's credentials in the ZAP request decide on ipc: a stranger handed the token gets nothing; the
    same stranger with the same token over tcp (the negative control) is served, so the token was right."""
    ipc = f"ipc://{public_dir}/q.sock"
    served = Served([ipc, "tcp://127.0.0.1:*"])
    try:
        token = owner_token(ipc)
        assert dial(ipc, token) == "answered"  # the owner
        with caplog.at_level("WARNING", logger="kvtier.auth"):
            assert dial(ipc, token, user=NOBODY) == "silent"
        assert served.counts.count("auth_refused_uid") == 1 and served.gate.refused_uid == 1
        assert f"refused an ipc connection from uid {NOBODY} (pid " in caplog.text
        assert dial(served.endpoints[1], owner_token(served.endpoints[1]), user=NOBODY) == "answered"
    finally:
        served.close()


def test_ipc_paths_that_read_alike_get_different_token_files():
    a, b = token_name("ipc:///a/b_c"), token_name("ipc:///a_b/c")
    assert a != b and a.startswith("ipc-a_b_c-") and b.startswith("ipc-a_b_c-")
    assert token_name("tcp://localhost:7400") == token_name("tcp://127.0.0.1:7400") == "tcp-7400.token"


@given(st.lists(st.text(alphabet="ab_/.-", min_size=1, max_size=300), min_size=2, max_size=2, unique=True))
def test_distinct_ipc_paths_never_share_a_token_file(paths):
    names = [token_name(f"ipc:///{p}") for p in paths]
    assert names[0] != names[1] and all(len(n) < 255 for n in names)


def test_a_clean_stop_removes_the_token_file_and_a_kill_keeps_it(tmp_path):
    """kill -9 keeps the file (the restarted pool keeps the token its clients present); SIGTERM removes it, so
    a later server on the port (another program, a pool with keys) does not get this user's clients' PLAIN."""
    with PoolProcess(tmp_path, ipc=True) as pool:
        files = [runtime_dir() / token_name(e) for e in (pool.tcp, pool.ipc)]
        assert all(f.exists() for f in files)
        pool.kill()
        assert all(f.exists() for f in files)
    with PoolProcess(tmp_path, ipc=True) as pool:
        files = [runtime_dir() / token_name(e) for e in (pool.tcp, pool.ipc)]
        assert all(f.exists() for f in files)
        assert pool.terminate() == 0
        assert not any(f.exists() for f in files), [f for f in files if f.exists()]


def test_a_clean_stop_leaves_a_file_another_daemon_rewrote(tmp_path):
    ctx = zmq.Context()
    gate = OwnerGate(None, ["tcp://127.0.0.1:*"])
    sock = ctx.socket(zmq.ROUTER)
    try:
        gate.secure(sock, "tcp://127.0.0.1:*")
        sock.bind("tcp://127.0.0.1:*")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        [path] = gate.publish([endpoint])
        path.write_text("n" * 43)  # a daemon started on this endpoint since
    finally:
        sock.close(0)
        gate.stop()
        ctx.term()
    assert path.read_text() == "n" * 43
    path.unlink()


SQUATTER = str(Path(__file__).parent / "owner_squatter.py")


@AS_NOBODY
@pytest.mark.parametrize("mode", ["null", "plain"])
def test_a_squatter_on_a_dead_pools_ipc_path_gets_neither_the_token_nor_a_client(public_dir, mode):
    """The owner's pool died (its token file stays) and another user binds its ipc path as a fake pool. The
    owner's client never presents the token to a socket file another uid owns, and refuses every reply whose
    kernel credentials are another uid's: a NULL squatter's hello reply is refused (not_owner), a PLAIN one
    (admitting any password) never completes a handshake. Negative control: the same fake pool run by the
    owner (PLAIN) is believed (its hello's node comes back) and is sent the token, so the refusal is the uid's."""
    from kvtier.transport.base import PoolUnavailable
    from kvtier.transport.channel import Channel
    from kvtier.transport.connection import hello

    squat = public_dir / "squat"
    squat.mkdir()
    os.chown(squat, NOBODY, NOBODY)
    endpoint = f"ipc://{squat}/pool.sock"
    token = runtime_dir(create=True) / token_name(endpoint)
    token.write_text("t" * 43)
    token.chmod(0o600)

    def against(user: int | None) -> tuple[object, dict]:
        prefix = ["setpriv", "--reuid", str(user), "--regid", str(user), "--clear-groups"] if user else []
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(Path(__file__).parent.parent)}
        proc = subprocess.Popen([*prefix, sys.executable, SQUATTER, endpoint, mode], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env, cwd="/")
        try:
            assert proc.stdout.readline().strip() == "ready"
            ctx = zmq.Context()
            ch = Channel(endpoint, ctx, timeout_s=1.5)
            try:
                got: object = hello(ch, 4096)
            except PoolUnavailable as e:
                got = e
            finally:
                ch.close()
                ctx.term()
            out, _ = proc.communicate("", timeout=30)
            return got, json.loads(out.strip().splitlines()[-1])
        finally:
            if proc.poll() is None:
                proc.kill()
            Path(f"{squat}/pool.sock").unlink(missing_ok=True)

    got, seen = against(NOBODY)
    assert isinstance(got, PoolUnavailable), got
    assert got.code == ("not_owner" if mode == "null" else "timeout"), got
    assert seen["passwords"] == [] and seen["served"] == (1 if mode == "null" else 0), seen
    if mode == "null":
        assert f"refused a reply from uid {NOBODY}" in got.message
        return
    # The control: the owner's own fake pool (PLAIN, the token file and socket file both the owner's) is believed
    # and receives the token, so an empty list of passwords above means the squatter was never sent it.
    got, seen = against(None)
    assert not isinstance(got, Exception) and got.node == "squatter" and got.uid == os.geteuid(), got
    assert seen["passwords"] == ["t" * 43], seen
