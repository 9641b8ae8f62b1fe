"""The daemons' Prometheus ports (kvtier/daemon/metrics_http.py) against slow and hostile HTTP clients (issue 23, 4).

Real daemons (kvtier-pool and kvtier-master as subprocesses) and real sockets. Before the fix both ports were
prometheus_client's ``start_http_server``: a thread per connection and no deadline, so 200 clients trickling
partial headers held 214 threads of the pool and 1,000 made it fail to start threads.
"""

from __future__ import annotations

import os
import resource
import socket
import time
import urllib.error
import urllib.request

import pytest
from masterproc import MasterProcess
from poolproc import PoolProcess
from prometheus_client.parser import text_string_to_metric_families
from promkit import promtool_check

from kvtier.daemon.metrics_http import HttpLimits

SLOW_CLIENTS = 1000
MAX_THREADS = 40  # "a few dozen": the daemon's own threads (pool: workers, dispatcher, ...) + the port's one
LIMITS = HttpLimits()
REFUSED = {"pool": "kvtier_pool_refused_connections_total", "master": "kvtier_master_refused_connections_total"}


@pytest.fixture
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < SLOW_CLIENTS + 200:
        pytest.skip(f"the hard open-files limit ({hard}) is below {SLOW_CLIENTS + 200}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _start(kind: str, tmp_path) -> tuple[MasterProcess | PoolProcess, int, int]:
    """(the daemon, its pid, its metrics port)"""
    if kind == "pool":
        pool = PoolProcess(tmp_path, capacity="4MiB", block_bytes=4096, args=("--metrics-port", "0")).start()
        return pool, pool.info["pid"], pool.info["metrics_port"]
    master = MasterProcess(tmp_path).start()
    return master, master.pid, master.metrics_port


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _scrape(port: int, timeout: float) -> dict[tuple[str, tuple], float]:
    """The port's samples; the exposition must pass ``promtool check metrics``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout).read().decode()
    r = promtool_check(text)
    assert r.returncode == 0, r.stdout + r.stderr
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _refused(samples: dict, kind: str, reason: str) -> float:
    return samples.get((REFUSED[kind], (("port", "metrics"), ("reason", reason))), 0.0)


def _slow_clients(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that send the start of a request head and then nothing."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slo")
        except OSError:  # the daemon already closed it (evicted): that is allowed
            pass
        socks.append(s)
    return socks


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        s.setblocking(False)
        return s.recv(1) == b""
    except BlockingIOError:
        return False  # still open: nothing to read
    except OSError:
        return True  # reset by the daemon (or never connected)


# The pool's run is slow (its start alone is some 7 s on a loaded machine); the port is the same module in both.
@pytest.mark.parametrize("kind", [pytest.param("pool", marks=pytest.mark.slow), "master"])
def test_a_thousand_slow_clients_hold_few_threads_and_a_scrape_still_answers(tmp_path, many_fds, kind):
    daemon, pid, port = _start(kind, tmp_path)
    socks: list[socket.socket] = []
    try:
        socks = _slow_clients(port, SLOW_CLIENTS)
        # Before: a thread per connection (1,000+ or "can't start new thread"); now the port's one thread.
        threads = _threads(pid)
        assert threads <= MAX_THREADS, f"{kind} holds {threads} threads with {SLOW_CLIENTS} slow clients"
        # A normal scrape, while the slow ones are still connected, answers within 1 s (urlopen's deadline)
        # with valid metrics that count the connections evicted to make room for newcomers.
        samples = _scrape(port, timeout=1.0)
        assert _refused(samples, kind, "made_room") >= SLOW_CLIENTS - LIMITS.connections
        # The slow ones are closed once the head deadline has passed: none is left open.
        deadline = time.monotonic() + LIMITS.head_s + 5
        open_ = socks
        while open_ and time.monotonic() < deadline:
            time.sleep(0.2)
            open_ = [s for s in open_ if not _closed_by_peer(s)]
        assert not open_, f"{len(open_)} slow clients still connected {LIMITS.head_s + 5:g} s on"
        samples = _scrape(port, timeout=1.0)
        timed_out = _refused(samples, kind, "head_timeout")
        assert 1 <= timed_out <= LIMITS.connections
        # One log line per reason and second, naming who, what and why, with the count held back.
        log = daemon.log()
        assert "127.0.0.1:" in log and "head_timeout: no whole head within 3 s" in log, log[-3000:]
        assert "made_room: the port is full" in log and "more like it" in log, log[-3000:]
        assert "Traceback" not in log, log[log.index("Traceback") - 300:][:3000]
        assert daemon.proc.poll() is None
    finally:
        for s in socks:
            s.close()
        daemon.kill()


@pytest.mark.parametrize("request_head, reason", [
    (b"x" * (LIMITS.head_bytes * 3), "head_too_large"),
    (b"NONSENSE\r\n\r\n", "bad_request"),
    (b"GET /metrics HTTP/1.0\r\nno colon here\r\n\r\n", "bad_request"),
])
def test_malformed_heads_are_refused_counted_and_logged(tmp_path, request_head, reason):
    daemon, _pid, port = _start("master", tmp_path)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            try:
                s.sendall(request_head)
                answer = s.recv(65536)
            except ConnectionError:
                answer = b""
        assert answer == b"" or answer.startswith(b"HTTP/1.0 400"), answer[:200]
        assert _refused(_scrape(port, timeout=5), "master", reason) == 1
        assert f": {reason}: " in daemon.log()
    finally:
        daemon.kill()


def test_the_port_still_speaks_prometheus_clients_formats(tmp_path):
    """OpenMetrics by Accept, gzip by Accept-Encoding, name[] filtering: prometheus_client's app answers."""
    import gzip

    daemon, _pid, port = _start("master", tmp_path)
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics?name[]=kvtier_master_directory_keys",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0",
                                              "Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.headers["Content-Encoding"] == "gzip"
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            text = gzip.decompress(r.read()).decode()
        assert "kvtier_master_directory_keys 0" in text and text.rstrip().endswith("# EOF")
        assert "kvtier_master_nodes" not in text
    finally:
        daemon.kill()


SERIES = 20_000


class _Big:
    """A collector whose exposition is some 4.5 MiB: more than loopback's socket buffers take for a non-reader."""

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("kvtier_test_big", "padding", labels=["i"])
        for i in range(SERIES):
            g.add_metric([f"{i:0200d}"], i)
        yield g


def test_readers_that_never_take_the_answer_are_cut_and_a_full_port_refuses_newcomers():
    """The port's own module in-process (a real socket): an answer not taken within send_s is cut
    (send_timeout); while every open connection is being answered, a newcomer is closed at once (too_many)."""
    refused: list[str] = []
    server = _big_server(refused, HttpLimits(connections=2, head_s=2.0, send_s=1.5))
    port = server.port
    readers = []
    try:
        readers = _non_readers(server, 2)  # their answers stall in the socket buffers
        with socket.create_connection(("127.0.0.1", port), timeout=5) as late:
            late.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert _recv_all(late) == b""  # closed unanswered: every slot is busy answering
        assert refused == ["too_many"]
        time.sleep(2.5)  # past send_s: both non-readers cut
        assert sorted(refused) == ["send_timeout", "send_timeout", "too_many"] and server.open == 0
        # and the port serves again
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert body.count(b"kvtier_test_big{") == SERIES
    finally:
        for s in readers:
            s.close()
        server.close()


def test_answers_slow_readers_have_not_taken_are_bounded_in_bytes():
    """Past ``answer_bytes`` of answers not yet taken, a request is answered 503 at once (answers_full),
    until the slow readers are cut (send_timeout); then the port answers again."""
    refused: list[str] = []
    server = _big_server(refused, HttpLimits(connections=8, send_s=1.5, answer_bytes=6 << 20))
    readers = []
    try:
        readers = _non_readers(server, 1)  # 4.5 MiB of 6 not taken
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10)
        assert e.value.code == 503 and refused == ["answers_full"]
        time.sleep(2.0)  # past send_s
        assert refused == ["answers_full", "send_timeout"]
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read()
        assert body.count(b"kvtier_test_big{") == SERIES
    finally:
        for s in readers:
            s.close()
        server.close()


def _big_server(refused: list[str], limits: HttpLimits):
    import logging

    from prometheus_client import CollectorRegistry

    from kvtier.daemon.metrics_http import MetricsServer

    registry = CollectorRegistry()
    registry.register(_Big())
    server = MetricsServer(registry, refused.append, logging.getLogger("test-metrics-http"), limits)
    server.start("127.0.0.1", 0)
    return server


def _non_readers(server, n: int) -> list[socket.socket]:
    """``n`` clients that ask for the metrics and never read, once the server is answering all of them."""
    readers = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.port))
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        readers.append(s)
    deadline = time.monotonic() + 20
    while server.answering < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.answering == n
    return readers


def _recv_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionError:
        pass
    return out


@pytest.mark.slow  # some 12 s: waves of slow clients time out before the scrape gets a file
def test_a_daemon_out_of_files_counts_the_failed_accepts_and_serves_again(tmp_path):
    """The master under an open-files limit of 40 (23 in use at start): slow clients take the rest, accept()
    fails with EMFILE: counted and logged once a second without a traceback; once the slow ones time out,
    a scrape is answered."""
    master = MasterProcess(tmp_path, prefix=("prlimit", "--nofile=40:40", "--")).start()
    socks: list[socket.socket] = []
    try:
        socks = _slow_clients(master.metrics_port, 30)
        time.sleep(1.5)  # asyncio retries accept() once a second
        samples = _scrape(master.metrics_port, timeout=LIMITS.head_s * 3 + 5)  # after a wave or two of slow ones
        assert _refused(samples, "master", "accept_failed") >= 1
        log = master.log()
        assert ": accept_failed: out of files" in log and "Traceback" not in log, log[-3000:]
        assert master.proc.poll() is None
    finally:
        for s in socks:
            s.close()
        master.kill()
