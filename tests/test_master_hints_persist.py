"""Hints persist one entry at a time (master/persist.py), through a real kvtier-master subprocess with a data
dir: a pin writes its own record, never the whole hint table (bytes written per change, from /proc/PID/io,
stay small beside a 20,000-session table), and SIGTERM right after 200,000 session pins (50,000 outside the
slow suite) exits within a couple of seconds with every pin on disk (a restarted master serves all of them)."""

from __future__ import annotations

import time

import pytest
import zmq

from kvtier import wire
from kvtier.auth import secure_client
from kvtier.client import MasterClient
from masterproc import MasterProcess

KiB = 1 << 10


def written(pid: int) -> int:
    """Bytes the process has passed to write() and friends (lmdb writes its pages with pwrite)."""
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def pin_sessions(endpoint: str, names: list[str], ttl_s: float = 3600.0, window: int = 200) -> None:
    """Pin every session, pipelined (``window`` requests in flight), and check every reply."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    secure_client(sock, endpoint, None)  # the owner token of a keyless daemon of this user
    sock.connect(endpoint)
    sent = answered = 0
    try:
        while answered < len(names):
            while sent < len(names) and sent - answered < window:
                sock.send(wire.encode_request(sent + 1, wire.PIN, {"session": names[sent], "ttl_s": ttl_s}))
                sent += 1
            assert sock.poll(10_000), f"no reply after {answered} of {len(names)} pins"
            _, ok, body = wire.decode_reply(sock.recv())
            assert ok, body
            answered += 1
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_hint_change_writes_its_own_record_not_the_table(tmp_path):
    with MasterProcess(tmp_path, data_dir=tmp_path / "data", lease_s=30.0) as master:
        pin_sessions(master.endpoint, [f"session-{i:06d}" for i in range(20_000)])
        time.sleep(1.0)  # the table is on disk
        with MasterClient(master.endpoint) as m:
            before = written(master.pid)
            for i in range(20):
                m.pin(session=f"agent-{i}", ttl_s=600)
                time.sleep(0.25)  # each change in a tick of its own: each is persisted on its own
            after = written(master.pid)
        per_change = (after - before) / 20
        assert per_change < 64 * KiB, f"{per_change / KiB:.0f} KiB written per hint change"


@pytest.mark.parametrize("pins", [10_000, pytest.param(50_000, marks=pytest.mark.slow),
                                  pytest.param(200_000, marks=pytest.mark.slow)])
def test_sigterm_after_many_session_pins_is_quick_and_loses_none(tmp_path, pins):
    """10,000 pins in the default suite; 50,000 and the 200,000 of issue 13 in the slow one."""
    data = tmp_path / "data"
    names = [f"agent-{i:06d}" for i in range(pins)]
    with MasterProcess(tmp_path, data_dir=data, lease_s=30.0) as master:
        pin_sessions(master.endpoint, names)
        t0 = time.monotonic()
        assert master.terminate(timeout=60) == 0
        took = time.monotonic() - t0
        assert took < 5.0, f"SIGTERM took {took:.1f} s"
        master.start()
        with MasterClient(master.endpoint, timeout_s=30.0) as m:
            pins = m.hints().session_pins
        assert len(pins) == len(names) and set(pins) == set(names)
