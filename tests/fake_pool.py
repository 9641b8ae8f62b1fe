"""A process posing as a kvtier-pool on an ipc:// socket, for the tests of issue 23 (tests/test_copy_from_hostile.py):
its hello names, as its shared-memory file, a file of the test's choosing (root's 0600 secret), and it answers
the one-sided ops as a pool whose every slot lies in that file, so a client that maps what a hello names reads
the file's bytes as blocks (acquire) or writes blocks into it (reserve/commit). A get over zmq frames (what a
pool that never maps a peer's file sends) is answered with misses: this process cannot read the secret.

    python fake_pool.py CONFIG_JSON

CONFIG_JSON: {"bind": "ipc://...", "ready": path, "shm": path, "nbytes": n, "block_bytes": b, "node": name,
"uid": u or null}. With "uid" (the test runs as root) the process drops to that uid before it binds, so the
kernel reports that uid for its end of the socket, and writes its generation file (zeros: every slot at
generation 0, as the acquire replies say) as that uid next to the socket. Writes the ready file
({"endpoint": ...}) once it serves; runs until killed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import msgpack
import zmq

from kvtier import wire
from kvtier.wire import pool as P


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg.get("uid") is not None:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    bb, nbytes = cfg["block_bytes"], cfg["nbytes"]
    slots = nbytes // bb
    gen = Path(cfg["bind"][len("ipc://"):] + ".gen")
    gen.write_bytes(bytes(8 * slots))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(cfg["bind"])
    Path(cfg["ready"]).write_text(json.dumps({"endpoint": cfg["bind"]}))
    epoch = 0x23
    hello = {"node": cfg["node"], "block_bytes": bb, "capacity": nbytes, "max_keys": 4096, "lease_s": 30.0,
             "request_bytes": nbytes, "session": b"s" * 32,
             "transports": {"tcp": {}, "shm": {"path": cfg["shm"], "nbytes": nbytes, "generations": str(gen)}}}
    while True:
        ident, envelope, *_data = sock.recv_multipart()
        _version, req_id, op, body = msgpack.unpackb(envelope, raw=False)
        n = len(body.get("keys", b"")) // 16
        first = [i < slots for i in range(n)]  # the first `slots` keys land in the file, slot i at block i
        offsets = [i * bb if i < slots else -1 for i in range(n)]
        if op == P.HELLO:
            reply = hello
        elif op == P.ACQUIRE:
            reply = {"lease": 1, "offsets": P.offsets(offsets), "skipped": 0,
                     "generations": bytes(8 * n)}
        elif op == P.RESERVE:
            reply = {"lease": 2, "held": P.bitmap(first), "fresh": P.bitmap(first),
                     "offsets": P.offsets([o for o in offsets if o >= 0]), "skipped": 0, "valid": [True]}
        elif op == P.COMMIT:
            reply = {"published": sum(first), "valid": True if "lease" in body else [True] * len(body["leases"])}
        elif op == P.GET:
            reply = {"hit": P.bitmap([False] * n)}
        elif op == P.RELEASE:
            continue
        else:
            reply = {"code": wire.ERR_UNKNOWN_OP, "message": op}
            sock.send_multipart([ident, wire.encode_reply(req_id, False, {**reply, "epoch": epoch})])
            continue
        sock.send_multipart([ident, wire.encode_reply(req_id, True, {**reply, "epoch": epoch})])


if __name__ == "__main__":
    main()
