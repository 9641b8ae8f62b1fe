"""ReplyBudget: a bound on the master's memory held by replies its clients have not read.

zmq queues a reply until the client's TCP connection takes it; a client that sends requests and never reads
would make the master keep every reply (3,000 ``top`` replies: gigabytes). Two bounds, per connection:

* small replies (< ``track_bytes``) count only against zmq's send queue (SNDHWM messages per connection,
  server.py): past it, further replies to that connection are dropped and counted;
* large replies are sent zero-copy with a zmq tracker and count here until zmq has let go of them: at most
  ``per_client`` bytes per connection (one reply of any size is let through to a connection with nothing
  unsent, so a big ``hints`` reply is never refused for its size alone) and ``total`` bytes for all
  connections together (one reply of any size when nothing at all is unsent). A reply past a bound is
  replaced by a short ERR_BUSY error: read your replies, then retry.

So the master's unsent-reply memory is at most ``total`` (or one reply, if larger) plus connections x SNDHWM x
``track_bytes`` of small ones. Runs on the master's event loop; not thread-safe.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import zmq


@dataclass
class _Unsent:
    client: bytes
    nbytes: int
    tracker: zmq.MessageTracker


class ReplyBudget:
    """Bytes of large replies zmq has not sent, per client connection (its routing id) and in all."""

    def __init__(self, total: int, per_client: int, track_bytes: int = 8 << 10) -> None:
        self.total_limit, self.client_limit, self.track_bytes = total, per_client, track_bytes
        self.unsent = 0
        self._per_client: dict[bytes, int] = {}
        self._queue: deque[_Unsent] = deque()

    def admits(self, client: bytes, nbytes: int) -> bool:
        """Whether a reply of ``nbytes`` to ``client`` may be queued now."""
        if nbytes < self.track_bytes:
            return True
        self.collect()
        if self.unsent == 0:
            return True
        mine = self._per_client.get(client, 0)
        return (mine == 0 or mine + nbytes <= self.client_limit) and self.unsent + nbytes <= self.total_limit

    def of(self, client: bytes) -> int:
        """Bytes of large replies to ``client`` not sent yet."""
        return self._per_client.get(client, 0)

    def sent(self, client: bytes, nbytes: int, tracker: zmq.MessageTracker) -> None:
        """A tracked reply was handed to zmq."""
        self._queue.append(_Unsent(client, nbytes, tracker))
        self._per_client[client] = self._per_client.get(client, 0) + nbytes
        self.unsent += nbytes

    def collect(self) -> None:
        """Forget replies zmq has sent (or dropped with their connection). Replies to other clients may finish
        out of order; each is checked, the whole queue at most once per call."""
        for _ in range(len(self._queue)):
            u = self._queue.popleft()
            if not u.tracker.done:
                self._queue.append(u)
                continue
            left = self._per_client[u.client] - u.nbytes
            if left:
                self._per_client[u.client] = left
            else:
                del self._per_client[u.client]
            self.unsent -= u.nbytes
