"""One SGLang "server" as a process of its own: SGLang's real radix cache and controller (tests/sglang_harness.py)
with kvtier as L3, for tests of several servers sharing kvtier. One JSON argument:

    {"op": "write", "kind": "mha", "layout": "page_first", "extra": {...}, "tokens": [...], "seed": 1, "out": "a.pt"}
        computes the prompt (random KV), waits until SGLang backed it up to L3, saves its device KV rows to out;
    {"op": "read", ...same..., "out": "b.pt"}
        prefetches the prompt from L3, loads it to the device, saves the loaded rows to out;

then prints one JSON line ({"loaded": tokens prefetched, "stats": the backend's page counters}) and exits.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import sglang_harness  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    job = json.loads(sys.argv[1])
    import torch

    server = sglang_harness.RadixServer(kind=job["kind"], layout=job["layout"], extra=job["extra"])
    tokens = job["tokens"]
    loaded = 0
    if job["op"] == "write":
        rows = server.insert(tokens, seed=job["seed"])
        if not server.pump(server.backed_up):
            raise SystemExit("the backup to L3 did not finish")
    else:
        loaded = server.prefetch(tokens)
        rows = server.load_back(tokens)
    torch.save(rows, job["out"])
    print(json.dumps({"loaded": loaded, "stats": server.backend.stats()["pages"]}), flush=True)
    server.close()


if __name__ == "__main__":
    main()
