"""RoleGate: the proxy between a daemon's CURVE ROUTER socket and its worker threads that refuses, per message,
the ops its sender's roles do not grant (kvtier/auth/roles.py).

zmq's own proxy (zmq.proxy_steerable) forwards messages without the metadata that says which key sent them
(the User-Id the CURVE handshake proved), so a kvtier-pool started with ``--auth-dir`` forwards through this
loop instead. For each request it reads the User-Id on the frontend, decodes the op from the envelope and,
when the key may not run it, answers ERR_FORBIDDEN itself (through ``refuse``, which builds the daemon's error
reply); everything else goes to the workers as received, and replies come back as the workers sent them
(frames are passed on by reference, never copied: a worker's zero-copy reply is released once zmq sent it).
A message whose envelope does not decode goes on too: the worker answers it with the daemon's usual error.

Runs on one thread, which owns the three sockets until ``run`` returns (a TERMINATE on ``control``, as for
zmq.proxy_steerable). Costs one Python pass per message, only where keys are required.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import zmq

from kvtier import wire
from kvtier.auth.server import ServerAuth
from kvtier.wire import WireError

BATCH = 64  # messages moved per socket per poll wakeup


class RoleGate:
    """``permissions``: op -> the permission it needs (unknown ops pass: the daemon answers them);
    ``refuse(req_id, error)``: the reply frame for a refused request; ``on_refusal(op, error)``: counts and logs
    it."""

    def __init__(self, auth: ServerAuth, permissions: Mapping[str, str],
                 refuse: Callable[[int, WireError], bytes], on_refusal: Callable[[str, WireError], None] | None = None) -> None:
        self.auth = auth
        self.permissions = permissions
        self.refuse = refuse
        self.on_refusal = on_refusal

    def run(self, frontend: zmq.Socket[Any], backend: zmq.Socket[Any], control: zmq.Socket[Any]) -> None:
        poller = zmq.Poller()
        for sock in (frontend, backend, control):
            poller.register(sock, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if control in ready and control.recv() == b"TERMINATE":
                return
            if frontend in ready:
                for _ in range(BATCH):
                    try:
                        frames = frontend.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    refusal = self._check(frames)
                    if refusal is None:
                        backend.send_multipart(frames, copy=False)
                    else:
                        frontend.send_multipart(refusal)
            if backend in ready:
                for _ in range(BATCH):
                    try:
                        frames = backend.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    frontend.send_multipart(frames, copy=False)

    def _check(self, frames: list[zmq.Frame]) -> list[Any] | None:
        """None to forward ``frames``; else the refusal to send back ([routing frames..., reply])."""
        route = 2 if len(frames) > 2 and len(frames[1]) == 0 else 1  # [identity, (empty), envelope, *data]
        if len(frames) <= route:
            return None
        try:
            req_id, op, _ = wire.decode_request(frames[route].buffer)
        except WireError:
            return None
        key = frames[0].get("User-Id")
        try:
            self.auth.book.check(op, self.permissions.get(op), key)
        except WireError as err:
            if self.on_refusal is not None:
                self.on_refusal(op, err)
            return [f.bytes for f in frames[:route]] + [self.refuse(req_id, err)]
        return None


__all__ = ["RoleGate"]
