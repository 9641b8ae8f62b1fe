"""An engine-like process with a TieredStore built from a config (stdin: one JSON command per line, stdout:
one JSON answer per line). Used to test processes sharing a node pool and surviving its restarts.

    {"op": "put", "start": 0, "count": 10}   -> {"stored": n, "skipped": n, "rejected": n}
    {"op": "get", "start": 0, "count": 10}   -> {"hits": n, "correct": n}   (bytes checked against block_for)
    {"op": "maps"}                            -> {"maps": [paths of mapped kvtier-pool files]}
    {"op": "stats"}                           -> the store's stats
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bytecheck import check_rows  # noqa: E402
from conftest import blocks_for  # noqa: E402

from kvtier.keys import Namespace  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    config = json.loads(sys.argv[1])
    block_bytes = int(sys.argv[2])
    ns = Namespace("pool-client")
    with TieredStore.from_config(config, block_bytes) as store:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op in ("put", "get"):
                keys = ns.keys(range(cmd["start"], cmd["start"] + cmd["count"]))
            if op == "put":
                r = store.put(keys, blocks_for(keys, block_bytes))
                store.flush(5.0)
                out = {"stored": r.stored, "skipped": r.skipped, "rejected": len(r.rejected)}
            elif op == "get":
                buf = torch.zeros(len(keys), block_bytes, dtype=torch.uint8)
                hit = store.get(keys, buf)
                got = check_rows(hit, buf, blocks_for(keys, block_bytes))
                out = {"hits": got.hits, "correct": got.hits - len(got.wrong)}
            elif op == "maps":
                out = {"maps": sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                                       if "kvtier-pool-" in line and line.endswith(".shm")})}
            elif op == "stats":
                out = json.loads(json.dumps(store.stats(), default=str))
            else:
                out = {"error": f"unknown op {op}"}
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
