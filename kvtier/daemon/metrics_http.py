"""MetricsServer: the Prometheus port of kvtier-pool and kvtier-master, with bounded connections and deadlines.

prometheus_client's ``start_http_server`` starts one thread per connection and waits for a request head
without a deadline: 200 clients trickling partial headers held 214 threads of the pool, and at 1,000 it could
no longer start threads at all (issue 23). This server is one thread running its own asyncio loop:

* at most ``connections`` connections are open (``HttpLimits``); one more takes the place of the oldest
  connection still reading its request head (a scraper sends its head at once, so the one evicted is the
  slowest), or is closed at once when every open connection is already being answered;
* a request head must arrive whole within ``head_s`` (one deadline for the whole head, not per read: a client
  sending a byte a second gets no more time) and fit in ``head_bytes``;
* the answer must be taken within ``send_s``, and the answers not yet taken, all together, fit in
  ``answer_bytes`` (a request past it is answered 503 at once: slow readers cannot pile up expositions);
* one request per connection (HTTP/1.0, like prometheus_client's server), answered by prometheus_client's own
  WSGI app, so the paths, formats (OpenMetrics by ``Accept``), gzip and ``name[]`` filter are its.

So the port holds one thread, at most ``connections`` sockets, and of memory at most ``connections`` x
``head_bytes`` x 2 (asyncio's read-ahead) + ``answer_bytes`` + the exposition being built. Every refusal calls
``refused(reason)`` (the daemon counts it in its metrics, ``REASONS`` lists them) and logs one line naming the
peer, what it sent and why (rate-limited per reason: a flood logs one line a second with the count held back).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from kvtier.ratelog import RateLimitedLog

# Why a connection was closed unanswered (the ``reason`` label of the daemons' refused-connection counters).
REASONS = ("too_many", "made_room", "head_timeout", "head_too_large", "bad_request", "send_timeout",
           "answers_full", "accept_failed")
# accept() failing for want of files or memory: asyncio stops accepting for a second and retries (the
# connections wait in the kernel's backlog); counted once per failure, logged rate-limited, no traceback.
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
BACKLOG = 128  # the kernel's accept queue: connections past it wait in SYN retries, holding nothing here
START_S = 10.0  # the serving thread has this long to bind its loop (it only starts a loop and a listener)


@dataclass(frozen=True)
class HttpLimits:
    connections: int = 64  # open at once (each a socket and at most 2 x head_bytes read ahead)
    head_s: float = 3.0  # the whole request head, from accept
    send_s: float = 10.0  # the answer, from the head's end
    head_bytes: int = 8192  # request line and headers (a scraper sends some 300 B)
    # Answers written and not yet taken by their readers, all connections together (an exposition is 6-8 KiB
    # here, some 4 MiB for a master at 1,024 nodes of 8 tiers); past it a request is answered 503 at once.
    answer_bytes: int = 32 << 20


class _Connection:
    __slots__ = ("peer", "task", "writer", "reading")

    def __init__(self, peer: str, task: asyncio.Task, writer: asyncio.StreamWriter) -> None:
        self.peer, self.task, self.writer = peer, task, writer
        self.reading = True  # still reading its request head: what an over-the-limit newcomer may evict


class _BadRequest(ValueError):
    pass


class MetricsServer:
    """Serves ``registry`` on an HTTP port from one thread of its own (a daemon thread running an asyncio loop;
    the collectors run in it). ``start`` and ``close`` are called from the daemon's thread; ``open`` and
    ``answering`` may be read from any thread."""

    def __init__(self, registry: CollectorRegistry, refused: Callable[[str], None], log: logging.Logger,
                 limits: HttpLimits = HttpLimits()) -> None:
        self._app = make_wsgi_app(registry)
        self._refused = refused
        self._log = RateLimitedLog(log)
        self.limits = limits
        self._open: dict[int, _Connection] = {}  # insertion order: oldest first
        self._unsent = 0  # bytes of answers written to connections still being answered (answer_bytes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def open(self) -> int:
        """Connections open now (read from another thread: a len, safe)."""
        return len(self._open)

    @property
    def answering(self) -> int:
        """Open connections past their request head, being answered (the rest are still sending it)."""
        return sum(not c.reading for c in list(self._open.values()))

    def start(self, host: str, port: int) -> int:
        """Bind ``host:port`` (``port`` 0 picks a free one) and serve from a thread; returns the port bound."""
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.create_server(addr[:2], family=family, backlog=BACKLOG)
        self.port = int(sock.getsockname()[1])
        ready = threading.Event()
        failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(sock, ready, failed), name="kvtier-metrics-http",
                                        daemon=True)
        self._thread.start()
        if not ready.wait(START_S) or failed:
            sock.close()
            raise RuntimeError(f"metrics port {host}:{self.port} did not start: {failed[0] if failed else 'timeout'}")
        return self.port

    def close(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop closed between the check and the call
                pass
        if self._thread is not None:
            self._thread.join(START_S)

    # ---- the serving thread -------------------------------------------------------------------------------------

    def _run(self, sock: socket.socket, ready: threading.Event, failed: list[BaseException]) -> None:
        loop = self._loop = asyncio.new_event_loop()
        loop.set_exception_handler(self._loop_error)
        try:
            loop.run_until_complete(self._serve(sock, ready))
        except BaseException as e:  # noqa: BLE001 - reported to start(), or logged if it happens later
            failed.append(e)
            if ready.is_set():
                self._log.logger.exception("metrics port %d stopped", self.port)
            ready.set()
        finally:
            loop.close()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        e = context.get("exception")
        if isinstance(e, OSError) and e.errno in ACCEPT_ERRNOS:
            self._refused("accept_failed")
            self._log("accept_failed", logging.WARNING, "metrics port %d: accept failed: %s: accept_failed: out of "
                      "files or memory (the open-files limit?); accepting again in 1 s", self.port, e)
            return
        loop.default_exception_handler(context)

    async def _serve(self, sock: socket.socket, ready: threading.Event) -> None:
        self._stop = asyncio.Event()
        # limit: asyncio's reader stops reading a connection past twice this (and readuntil fails past it)
        server = await asyncio.start_server(self._connection, sock=sock, limit=self.limits.head_bytes,
                                            backlog=BACKLOG)
        ready.set()
        async with server:
            await self._stop.wait()
            tasks = [c.task for c in self._open.values()]
            for c in self._open.values():
                c.writer.transport.abort()  # each task's read or drain then ends, and the task with it
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _peer(writer)
        task = asyncio.current_task()
        assert task is not None
        if len(self._open) >= self.limits.connections and not self._make_room():
            self._refuse(peer, "too_many", "connection", f"all {self.limits.connections} connections are being "
                         "answered")
            writer.transport.abort()
            return
        key = id(task)
        me = self._open[key] = _Connection(peer, task, writer)
        writing = 0  # bytes this connection adds to _unsent
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.limits.head_s)
            except asyncio.TimeoutError:  # not the builtin before 3.11
                self._refuse(peer, "head_timeout", "an unfinished request head",
                             f"no whole head within {self.limits.head_s:g} s")
                return
            except asyncio.LimitOverrunError:
                self._refuse(peer, "head_too_large", f"over {self.limits.head_bytes} B of a request head",
                             f"a head is at most {self.limits.head_bytes} B")
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the client went away before asking: nothing refused
            me.reading = False
            try:
                status, headers, body = self._answer(head)
            except _BadRequest as e:
                self._refuse(peer, "bad_request", repr(head[:80]), str(e))
                status, headers, body = "400 Bad Request", [("Content-Type", "text/plain")], f"{e}\n".encode()
            answer = _response(status, headers, body)
            if self._unsent + len(answer) > self.limits.answer_bytes:
                self._refuse(peer, "answers_full", f"a request for {len(answer)} B", f"{self._unsent} B of "
                             f"answers not yet taken by other readers; the limit is {self.limits.answer_bytes} B")
                answer = _response("503 Service Unavailable", [("Content-Type", "text/plain")],
                                   b"too many answers not yet read by their clients; retry\n")
            writing = len(answer)
            self._unsent += writing
            writer.write(answer)
            # One request per connection: close() sends what asyncio still buffers, then a FIN; once closed, the
            # whole answer is with the kernel (an abort would drop asyncio's unsent tail).
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), self.limits.send_s)
            except asyncio.TimeoutError:
                self._refuse(peer, "send_timeout", f"an answer of {len(answer)} B",
                             f"not read within {self.limits.send_s:g} s")
        except ConnectionError:
            pass
        finally:
            self._unsent -= writing
            self._open.pop(key, None)
            writer.transport.abort()  # refused or cut: nothing unsent is kept for a slow peer (no-op once closed)

    def _make_room(self) -> bool:
        """Evict the oldest connection still reading its head; False when every open one is being answered."""
        for key, c in self._open.items():
            if c.reading:
                del self._open[key]
                self._refuse(c.peer, "made_room", "an unfinished request head", f"the port is full "
                             f"({self.limits.connections} connections) and it was the oldest still sending")
                # Not task.cancel(): asyncio logs a cancelled connection task as an error. The abort ends its
                # read at once (an incomplete read: the task returns quietly).
                c.writer.transport.abort()
                return True
        return False

    def _refuse(self, peer: str, reason: str, what: str, why: str) -> None:
        self._refused(reason)
        self._log(reason, logging.WARNING, "metrics port %d: closed %s (%s): %s: %s", self.port, peer, what,
                  reason, why)

    def _answer(self, head: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
        """(status, headers, body) of prometheus_client's WSGI app for one request head."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            raise _BadRequest("the request line is not 'METHOD TARGET HTTP/x.y'")
        method, target, _version = parts
        path, _, query = target.partition("?")
        environ = {"REQUEST_METHOD": method, "PATH_INFO": urllib.parse.unquote(path), "QUERY_STRING": query}
        for line in lines[1:]:
            if not line:
                continue
            name, colon, value = line.partition(":")
            if not colon:
                raise _BadRequest(f"a header line without ':': {line[:40]!r}")
            if name.strip().lower() in ("accept", "accept-encoding"):
                environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
        started: list[tuple[str, list[tuple[str, str]]]] = []
        try:
            body = b"".join(self._app(environ, lambda status, headers: started.append((status, headers))))
        except Exception:  # noqa: BLE001 - a collector's bug answers 500 (logged); the port goes on
            self._log.logger.exception("metrics port %d: collecting the metrics failed", self.port)
            return "500 Internal Server Error", [("Content-Type", "text/plain")], b"collecting the metrics failed\n"
        status, headers = started[0]
        return status, headers, body


def _response(status: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"HTTP/1.0 {status}", *(f"{k}: {v}" for k, v in headers), f"Content-Length: {len(body)}",
             "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def _peer(writer: asyncio.StreamWriter) -> str:
    addr = writer.get_extra_info("peername")
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
