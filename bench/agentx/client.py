"""A streaming OpenAI completions call over asyncio's own streams (stdlib: no HTTP library in the bench's venv),
timed per token event, every read bounded.

``POST /v1/completions`` with ``stream: true`` and ``stream_options.include_usage``: the server answers with
server-sent events (``data: {...}``) in HTTP/1.1 chunked encoding (or until it closes, if not chunked); each
event with a choice is one engine step's output, the last carries ``usage`` (prompt tokens, cached tokens).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class StreamError(RuntimeError):
    """The request failed: refused connection, an HTTP error, a malformed stream, or a stall past its bound."""


@dataclass
class Completion:
    """One streamed request: monotonic times of send, each output event, and what usage said."""

    sent: float
    events: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    done: float = 0.0


class Endpoint:
    """Where the server is (``http://host:port``) and the model name it serves."""

    def __init__(self, url: str, model: str) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"--url must be http://HOST:PORT, got {url!r}")
        self.host, self.port, self.model = u.hostname, u.port or 80, model


async def _read(coro, until: float, stall_s: float, what: str):  # noqa: ANN001, ANN202 - any awaitable read
    left = min(until - time.monotonic(), stall_s)
    if left <= 0:
        raise StreamError(f"{what}: deadline passed")
    try:
        return await asyncio.wait_for(coro, left)
    except asyncio.TimeoutError:
        raise StreamError(f"{what}: no bytes for {left:.1f} s (stalled or past the run's end)") from None


async def complete(ep: Endpoint, prompt: list[int], max_tokens: int, until: float, stall_s: float) -> Completion:
    """Stream one completion; raises StreamError on any failure. ``until``: monotonic hard deadline;
    ``stall_s``: the longest wait for the next bytes."""
    body = json.dumps({"model": ep.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {ep.host}:{ep.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    out = Completion(sent=time.monotonic())
    try:
        reader, writer = await _read(asyncio.open_connection(ep.host, ep.port), until, stall_s, "connect")
    except OSError as e:
        raise StreamError(f"connect: {e}") from None
    try:
        writer.write(head + body)
        await _read(writer.drain(), until, stall_s, "send")
        status = (await _read(reader.readline(), until, stall_s, "status")).decode("latin-1").split()
        if len(status) < 2 or not status[1].isdigit():
            raise StreamError(f"not an HTTP answer: {' '.join(status)!r}")
        chunked = False
        while True:
            line = (await _read(reader.readline(), until, stall_s, "headers")).decode("latin-1").strip()
            if not line:
                break
            k, _, v = line.partition(":")
            chunked |= k.strip().lower() == "transfer-encoding" and "chunked" in v.lower()
        if status[1] != "200":
            text = await _read(reader.read(4096), until, stall_s, "error body")
            raise StreamError(f"HTTP {status[1]}: {text.decode(errors='replace')[:300]}")
        buffer = b""
        async for data in _body(reader, chunked, until, stall_s):
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if _event(event, out):
                    out.done = time.monotonic()
                    return out
        raise StreamError(f"the stream ended without [DONE] after {len(out.events)} events")
    except (OSError, asyncio.IncompleteReadError) as e:
        raise StreamError(f"connection lost after {len(out.events)} events: {e}") from None
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, chunked: bool, until: float, stall_s: float):  # noqa: ANN202
    if not chunked:
        while True:
            data = await _read(reader.read(65536), until, stall_s, "body")
            if not data:
                return
            yield data
    while True:
        size_line = await _read(reader.readline(), until, stall_s, "chunk size")
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield (await _read(reader.readexactly(size + 2), until, stall_s, "chunk"))[:-2]  # less its CRLF


def _event(event: bytes, out: Completion) -> bool:
    """Fold one server-sent event into ``out``; True at ``[DONE]``."""
    for line in event.decode().splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        msg = json.loads(data)
        if "error" in msg:
            raise StreamError(f"server error in the stream: {str(msg['error'])[:300]}")
        if msg.get("choices"):
            out.events.append(time.monotonic())
        usage = msg.get("usage")
        if usage:
            out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            out.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            out.cached_tokens = int(details.get("cached_tokens") or 0)
    return False
