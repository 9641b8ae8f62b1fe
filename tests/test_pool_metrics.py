"""Issue 15 (pool part): ``kvtier-pool --metrics-port`` serves Prometheus metrics on loopback by default: requests
by op and status, latency, bytes in and out per path, slots, evictions, connections and refusals, the memory
and held budgets, leases. Read back through prometheus_client's own parser from a real pool's HTTP port."""

from __future__ import annotations

import os
import socket
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from attack import RawClient, host_port
from bytecheck import assert_all_hits_exact
from doctext import page_text
from kvtier import wire
from kvtier.keys import Namespace
from kvtier.transport import connect
from kvtier.transport.base import PoolError
from kvtier.wire import pool as P
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
        documented = page_text("pool.md")  # its metrics table
        for name in names:
            base = name.removesuffix("_total").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
            base = base.removesuffix("_created")
            if base.startswith("kvtier_pool_"):
                assert base in documented, f"{base} is not in docs/pool.md's metrics table"


def test_replies_a_client_does_not_read_are_dropped_counted_and_logged(tmp_path):
    """A client that keeps asking and never reads fills its connection's reply queue (REPLY_HWM): the replies past
    it are dropped, and each drop is counted and said in the log with the client's account (they went silently
    before: a client pipelining too deep saw only its call time out). Another connection is served meanwhile."""
    with PoolProcess(tmp_path, ipc=True, capacity="64MiB", block_bytes=BB, args=("--metrics-port", "0")) as p:
        port = p.info["metrics_port"]
        keys = ns.keys(range(1000, 1016))
        src = np.stack([np.full(BB, 7 + i, np.uint8) for i in range(16)])
        honest = connect(p.ipc, BB, transport="tcp", timeout_s=5.0)
        assert all(honest.put(keys, rows(src)))
        out = np.zeros((16, BB), np.uint8)
        assert_all_hits_exact(honest.get(keys, rows(out)), out, src)  # a client that reads: nothing dropped
        assert value(scrape(port), "kvtier_pool_replies_dropped_total", reason="not_reading") == 0
        flood = RawClient(p.ipc, rcvhwm=1)
        try:
            for i in range(96):  # one-block gets, 64 KiB each, never read: far past its connection's 8 replies
                flood.send(P.GET, {"keys": wire.pack_keys([keys[i % 16]]), "block_bytes": BB})
            assert until(lambda: value(scrape(port), "kvtier_pool_replies_dropped_total", reason="not_reading") > 0)
            assert until(lambda: "is not reading its replies" in p.log())
            line = next(x for x in p.log().splitlines() if "is not reading its replies" in x)
            assert line.split("client ")[1].split(" ")[0].endswith(f":{os.getpid()}"), line  # its account: its pid
            out[:] = 0
            assert_all_hits_exact(honest.get(keys, rows(out)), out, src)
        finally:
            flood.close()
            honest.close()
