"""TcpConnection: block bytes in zmq frames over TCP, zero-copy on the way out, one copy on the way in.

A put sends the caller's rows as frames that point into the caller's memory (runs of consecutive rows
coalesced; scattered small rows gathered into staging buffers instead, see ``kvtier.wire.frames``); the
pool copies them once, from zmq's receive buffers into the slots it reserved. A get's reply frames point into
the pool's slots (or its staging buffers); here they are copied once, by one native batched copy, from zmq's
receive buffers into the caller's rows. Batches are cut into requests of about
``REQUEST_BYTES`` and spread over parallel connections (the channel's lanes), two in flight per lane, so
the pool copies one request while the next is on the wire.

Runs in the caller's threads; thread-safe (each call checks out its own lanes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.memory.hostcopy import copy_rows
from kvtier.transport.channel import Answer, Request
from kvtier.transport.connection import ConnectionBase
from kvtier.wire import frames as F
from kvtier.wire import pool as P

REQUEST_BYTES = 16 << 20


class TcpConnection(ConnectionBase):
    """Blocks over zmq TCP frames. See ConnectionBase and kvtier.transport.base.PoolConnection."""

    transport = "tcp"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._staging = F.Staging(keep=4 * self.lanes)  # for puts of scattered small blocks

    def _requests(self) -> int:
        return self._per_request(REQUEST_BYTES)

    def put(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        n, bb = len(keys), self.block_bytes
        self._check_fits(n)
        rows = np.asarray(rows, dtype=np.uint64)
        held = [False] * n

        used: list[np.ndarray] = []

        def requests() -> Iterator[Request]:
            for a, b in self._chunks(n, self._requests()):
                def on_reply(ans: Answer, a: int = a, b: int = b) -> None:
                    held[a:b] = P.unbitmap(ans.body["held"], b - a)
                frames, staged = F.frames_for(rows[a:b], bb, self._staging)
                used.extend(staged)
                yield Request(P.PUT, self._body(keys[a:b]), frames, on_reply)
        try:
            self._batch(requests(), self._count(n, self._requests()), self._deadline(n * bb))
        finally:
            self._staging.give(used)  # the batch returns once zmq has let go of every frame
        return held

    def get(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        n, bb = len(keys), self.block_bytes
        rows = np.asarray(rows, dtype=np.uint64)
        hit = [False] * n

        def requests() -> Iterator[Request]:
            for a, b in self._chunks(n, self._requests()):
                def on_reply(ans: Answer, a: int = a, b: int = b) -> None:
                    got = P.unbitmap(ans.body["hit"], b - a)
                    src = F.rows_in(ans.data, bb)
                    index = [a + i for i, h in enumerate(got) if h]
                    if len(src) != len(index):
                        raise wire.WireError(wire.ERR_BAD_MESSAGE, f"{len(index)} hits but {len(src)} blocks of data")
                    copy_rows(rows[index], src, bb)
                    hit[a:b] = got
                yield Request(P.GET, self._body(keys[a:b]), (), on_reply)
        self._batch(requests(), self._count(n, self._requests()), self._deadline(n * bb))
        return hit
