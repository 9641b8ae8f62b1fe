"""Multi-host: two pool nodes and a client in three network namespaces joined by veth pairs, so block bytes
cross a real network stack (TCP over veth, not loopback). Needs root and ``ip netns``; skipped otherwise.
Namespaces are deleted even when the test fails.

    client ns  10.77.1.1 --veth-- 10.77.1.2  pool ns 1
               10.77.2.1 --veth-- 10.77.2.2  pool ns 2
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from poolproc import BB, Client, PoolProcess, until

TAG = uuid.uuid4().hex[:6]
CLIENT_NS, POOL_NS = f"kvt-c-{TAG}", [f"kvt-p1-{TAG}", f"kvt-p2-{TAG}"]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"kvt-probe-{TAG}"
    r = ip("netns", "add", probe, check=False)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


REASON = _netns_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"multi-host test: {REASON}")


@pytest.fixture
def hosts():
    made: list[str] = []
    try:
        for ns in [CLIENT_NS, *POOL_NS]:
            ip("netns", "add", ns)
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        for i, ns in enumerate(POOL_NS, 1):
            here, there = f"kvc{i}-{TAG}", f"kvp{i}-{TAG}"
            ip("link", "add", here, "netns", CLIENT_NS, "type", "veth", "peer", "name", there, "netns", ns)
            ip("-n", CLIENT_NS, "addr", "add", f"10.77.{i}.1/24", "dev", here)
            ip("-n", ns, "addr", "add", f"10.77.{i}.2/24", "dev", there)
            ip("-n", CLIENT_NS, "link", "set", here, "up")
            ip("-n", ns, "link", "set", there, "up")
        yield
    finally:
        for ns in made:
            ip("netns", "del", ns, check=False)


def rx_bytes(ns: str) -> int:
    """Bytes received on every interface of ``ns`` but loopback."""
    stats = json.loads(ip("-n", ns, "-s", "-j", "link", "show").stdout)
    return sum(link["stats64"]["rx"]["bytes"] for link in stats if link["ifname"] != "lo")


@pytest.mark.slow  # three pool processes in network namespaces: ~7 s here
def test_blocks_cross_a_real_network_between_namespaces(hosts, tmp_path):
    # The namespaces' network is this test's own: the pools serve it without keys, as the flag says.
    pools = [PoolProcess(tmp_path, name=f"p{i}", capacity="16MiB", host=f"10.77.{i}.2", args=("--insecure-bind",),
                         prefix=("ip", "netns", "exec", ns)) for i, ns in enumerate(POOL_NS, 1)]
    try:
        for p in pools:
            p.start()
        config = {"mode": "distributed", "pool": ",".join(p.tcp for p in pools), "dram_capacity": 8 * BB,
                  "pool_timeout_ms": 1000}
        writer = Client(config, tmp_path / "writer.log", prefix=("ip", "netns", "exec", CLIENT_NS))
        reader = Client(config, tmp_path / "reader.log", prefix=("ip", "netns", "exec", CLIENT_NS))
        try:
            before = rx_bytes(CLIENT_NS)
            for start in range(0, 200, 8):  # DRAM holds 8: everything else lives only in the pools
                assert writer.ask(op="put", start=start, count=8)["stored"] == 8
            sent = [rx_bytes(ns) for ns in POOL_NS]
            assert min(sent) > 20 * BB, f"both pools must receive blocks over their veth: {sent}"
            assert reader.ask(op="get", start=0, count=200) == {"hits": 200, "correct": 200}
            assert rx_bytes(CLIENT_NS) - before > 200 * BB  # the reader's blocks came over the wire

            pools[1].kill()  # one host dies: its blocks are misses, the other host's still come back
            assert until(lambda: 0 < writer.ask(op="get", start=8, count=192)["hits"] < 192)
        finally:
            writer.close()
            reader.close()
    finally:
        for p in pools:
            p.kill()
    assert all(Path(p.log_path).exists() for p in pools)
