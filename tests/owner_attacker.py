"""A local stranger's attacks on a keyless kvtier-master and kvtier-pool, run by tests/test_owner_token.py as
another uid (65534, nobody). Each attack is a real client doing what an engine or a pool would; prints one JSON
object: attack -> "ok" (it worked) or why it failed (the exception's class and message, cut short).

    python owner_attacker.py '{"master": ..., "pool_tcp": ..., "pool_ipc": ..., "stream_port": ...,
                               "shm_path": ..., "token_dir": ..., "token_file": ..., "key": "<hex>", "block_bytes": N}'
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid

import numpy as np
import zmq

from kvtier.client import MasterClient, api
from kvtier.transport import connect
from kvtier.transport.channel import Channel

TIMEOUT_S = 1.0
STRANGER = 0xA5  # the byte every block the stranger writes is made of


def attempt(fn) -> str:
    try:
        out = fn()
    except BaseException as e:  # noqa: BLE001 - every failure is an answer here
        return f"{type(e).__name__}: {e}"[:300]
    return "ok" if out in (None, True) or out == [True] else f"answered {out!r}"[:300]


def main() -> None:
    cfg = json.loads(sys.argv[1])
    bb, key = cfg["block_bytes"], bytes.fromhex(cfg["key"])
    rows = np.full((1, bb), STRANGER, dtype=np.uint8)
    ptrs = np.array([rows.ctypes.data], dtype=np.uint64)
    ctx = zmq.Context()
    out = {"uid": os.geteuid()}

    def put(transport: str, endpoint: str) -> object:
        conn = connect(endpoint, bb, transport=transport, timeout_s=TIMEOUT_S)
        try:
            return conn.put([key], ptrs)
        finally:
            conn.close()

    def get() -> object:
        conn = connect(cfg["pool_tcp"], bb, transport="tcp", timeout_s=TIMEOUT_S)
        try:
            return conn.get([key], ptrs)
        finally:
            conn.close()

    def pool_op(op: str) -> object:
        ch = Channel(cfg["pool_tcp"], ctx, timeout_s=TIMEOUT_S)
        try:
            return ch.call(op, {}).body.get("removed", True) is not None or None
        finally:
            ch.close()

    def register() -> object:
        m = MasterClient(cfg["master"], timeout_s=TIMEOUT_S)
        try:
            return m.call(api.register("stranger-node", uuid.uuid4().hex, 0, [("dram", 1 << 40)],
                                       "tcp://127.0.0.1:9", {"role": "pool"})) is not None or None
        finally:
            m.close()

    def stream() -> object:
        """The raw data port: a token of zeros, then a request; the pool must close it unanswered."""
        with socket.create_connection(("127.0.0.1", cfg["stream_port"]), timeout=TIMEOUT_S) as s:
            s.sendall(b"\0" * 32 + b"\0\0\0\x10" + b"x" * 16)
            s.settimeout(3.0)
            try:
                got = s.recv(64)
            except ConnectionResetError:  # closed with our bytes unread
                got = b""
        return None if got else "closed unanswered"

    def read_file(path: str) -> object:
        with open(path, "rb") as f:
            return f.read(1) is not None or None

    def ipc_socket() -> object:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(cfg["pool_ipc"][len("ipc://"):])
        finally:
            s.close()

    out["put_tcp"] = attempt(lambda: put("tcp", cfg["pool_tcp"]))
    if cfg.get("only_put"):
        print(json.dumps(out))
        return
    out["put_stream"] = attempt(lambda: put("stream", cfg["pool_tcp"]))
    out["put_shm"] = attempt(lambda: put("shm", cfg["pool_ipc"]))
    out["get"] = attempt(get)
    out["clear"] = attempt(lambda: pool_op("clear"))
    out["register"] = attempt(register)
    out["stream_raw"] = attempt(stream)
    out["shm_file"] = attempt(lambda: read_file(cfg["shm_path"]))
    out["token_dir"] = attempt(lambda: os.listdir(cfg["token_dir"]) and None)
    out["token_file"] = attempt(lambda: read_file(cfg["token_file"]))
    out["ipc_socket"] = attempt(ipc_socket)
    ctx.term()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
