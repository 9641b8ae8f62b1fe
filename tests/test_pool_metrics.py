"""Issue 15 (pool part): ``kvtier-pool --metrics-port`` serves Prometheus metrics on loopback by default: requests
by op and status, latency, bytes in and out per path, slots, evictions, connections and refusals, the memory
and held budgets, leases. Read back through prometheus_client's own parser from a real pool's HTTP port."""

from __future__ import annotations

import socket
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from attack import host_port
from kvtier.keys import Namespace
from kvtier.transport import connect
from kvtier.transport.base import PoolError
from poolproc import PoolProcess, until

BB = 64 << 10
ns = Namespace("metrics")


def rows(a: np.ndarray) -> np.ndarray:
    return np.uint64(a.ctypes.data) + np.arange(a.shape[0], dtype=np.uint64) * np.uint64(a.shape[1])


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_the_pool_serves_its_metrics_on_loopback(tmp_path):
    with PoolProcess(tmp_path, ipc=True, capacity="4MiB", block_bytes=BB, args=("--metrics-port", "0")) as p:
        port = p.info["metrics_port"]
        assert port
        bound = [line for line in open(f"/proc/{p.proc.pid}/net/tcp").read().splitlines()[1:]
                 if int(line.split()[1].split(":")[1], 16) == port and line.split()[3] == "0A"]
        assert bound and all(b.split()[1].startswith("0100007F") for b in bound)  # 127.0.0.1 only
        keys = ns.keys(range(96))  # 96 blocks into a 64-block pool: evictions
        src = np.full((96, BB), 3, np.uint8)
        for transport, endpoint in (("tcp", p.tcp), ("stream", p.tcp), ("shm", p.ipc)):
            c = connect(endpoint, BB, transport=transport, timeout_s=5.0)
            part = slice(32 * ["tcp", "stream", "shm"].index(transport), 32 * ["tcp", "stream", "shm"].index(transport) + 32)
            assert all(c.put(keys[part], rows(src[part])))
            out = np.zeros((32, BB), np.uint8)
            c.get(keys[part], rows(out))  # shm: read where the put left them, then reported (touch)
            if transport == "shm":
                c.locations.forget_all()
                c.get(keys[part], rows(out))  # by acquire
            c.close()
        try:
            connect(p.tcp, 4 * BB, timeout_s=2.0)  # another block size: refused, counted by code
        except PoolError:
            pass
        idle = socket.create_connection(host_port(p.tcp))  # never completes a handshake
        m = scrape(port)
        assert value(m, "kvtier_pool_requests_total", op="put", status="ok") >= 1
        assert value(m, "kvtier_pool_requests_total", op="hello", status="bad_request") >= 1
        assert value(m, "kvtier_pool_request_seconds_count", op="acquire") >= 1
        assert until(lambda: value(scrape(port), "kvtier_pool_located_reads_total") == 32)
        for path in ("zmq", "stream", "onesided"):
            assert value(m, "kvtier_pool_bytes_total", direction="in", path=path) >= 32 * BB, path
            assert value(m, "kvtier_pool_bytes_total", direction="out", path=path) > 0, path
        assert value(m, "kvtier_pool_slots", state="used") + value(m, "kvtier_pool_slots", state="free") == 64
        assert value(m, "kvtier_pool_evictions_total") >= 32
        assert value(m, "kvtier_pool_get_blocks_total", result="hit") > 0
        assert value(m, "kvtier_pool_memory_bytes", kind="limit") > 0
        assert value(m, "kvtier_pool_held_bytes", kind="per_client_limit") > 0
        assert value(m, "kvtier_pool_errors_total", code="bad_request") >= 1
        assert until(lambda: value(scrape(port), "kvtier_pool_connections", port="zmq", stage="handshaking") >= 1,
                     timeout=1.0)
        assert until(lambda: value(scrape(port), "kvtier_pool_refused_connections_total", port="zmq",
                                   reason="handshake_timeout") >= 1, timeout=8.0)
        idle.close()
        names = {name for name, _ in scrape(port)}
        documented = open(__file__.replace("tests/test_pool_metrics.py", "README.md")).read()
        for name in names:
            base = name.removesuffix("_total").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
            base = base.removesuffix("_created")
            if base.startswith("kvtier_pool_"):
                assert base in documented, f"{base} is not in the README's metrics table"
