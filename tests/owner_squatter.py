"""A fake pool squatting an ipc path (run by tests/test_owner_gate.py as uid 65534): it binds ``endpoint``,
answers every request with a well-formed hello reply, and with ``plain`` admits any PLAIN password (recording
it: the owner's token must never reach it). Prints "ready", then on stdin's end one JSON line:
{"served": N, "passwords": [...]}.

    python owner_squatter.py ipc:///path null|plain
"""

from __future__ import annotations

import json
import os
import sys
import threading

import zmq

from kvtier import wire


def main() -> None:
    endpoint, mode = sys.argv[1], sys.argv[2]
    ctx = zmq.Context()
    passwords: list[str] = []
    if mode == "plain":
        zap = ctx.socket(zmq.REP)
        zap.bind("inproc://zeromq.zap.01")

        def admit_all() -> None:
            while True:
                try:
                    m = zap.recv_multipart()
                except zmq.ZMQError:
                    return
                if m[5] == b"PLAIN":
                    passwords.append(m[7].decode("ascii", "replace"))
                zap.send_multipart([m[0], m[1], b"200", b"OK", b"squatter", b""])

        threading.Thread(target=admit_all, daemon=True).start()
    sock = ctx.socket(zmq.ROUTER)
    sock.plain_server = mode == "plain"
    sock.bind(endpoint)
    served = 0
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("ready", flush=True)
    while not stop.is_set():
        if not sock.poll(50):
            continue
        ident, frame, *_ = sock.recv_multipart()
        req_id, _op, body = wire.decode_request(frame)
        served += 1
        sock.send_multipart([ident, wire.encode_reply(req_id, True, {
            "node": "squatter", "epoch": 7, "block_bytes": body.get("block_bytes", 0), "capacity": 1 << 30,
            "max_keys": 1024, "lease_s": 5.0})])
    print(json.dumps({"served": served, "passwords": passwords}), flush=True)
    os._exit(0)  # not ctx.term(): the ZAP thread's socket would keep it waiting


if __name__ == "__main__":
    main()
