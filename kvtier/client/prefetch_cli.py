"""``kvtier prefetch``: an operator asks a node to bring a prefix up into its DRAM (master/prefetch.py).

    kvtier prefetch --master tcp://10.0.0.1:7300 --node gpu-3 --session agent-7       # its last prefix
    kvtier prefetch --master tcp://10.0.0.1:7300 --node gpu-3 --keys 0a1b...,2c3d...  # keys, hex, root first

Prints the master's answer (outcome, why, keys held and queued); ``--json`` prints it as JSON. Exit status 0 when
an order was queued or the prefix is in the node's top tier already, 1 when it was refused or the master did not
answer within ``--timeout``, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvtier.keys import KEY_BYTES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefetch", help="ask a node to bring a prompt's prefix (or an agent's last one) up into "
                       "its DRAM before the request arrives", description=__doc__.split("\n")[0])
    p.add_argument("--master", required=True, help="kvtier-master's endpoint(s), comma-separated")
    p.add_argument("--node", required=True, help="the node (worker) that will serve the prompt")
    p.add_argument("--session", help="the agent: with no --keys, the node brings up the last prefix it saw for it")
    p.add_argument("--keys", help=f"the prompt's block keys, root first: {KEY_BYTES}-byte hex, comma-separated")
    p.add_argument("--ttl", type=float, default=30.0, help="seconds the order waits for the node to collect it")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the master")
    p.add_argument("--auth-dir", default="", help="CurveZMQ client keys, as the store's auth_dir")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    p.set_defaults(func=run)


def _keys(text: str) -> list[bytes]:
    keys = []
    for i, h in enumerate(t for t in text.split(",") if t.strip()):
        try:
            k = bytes.fromhex(h.strip())
        except ValueError:
            raise ValueError(f"--keys: key {i} is not hex: {h.strip()[:40]!r}") from None
        if len(k) != KEY_BYTES:
            raise ValueError(f"--keys: key {i} has {len(k)} bytes, a key has {KEY_BYTES}")
        keys.append(k)
    if not keys:
        raise ValueError("--keys: no key given")
    return keys


def run(args: argparse.Namespace) -> int:
    from kvtier.auth.client import ClientKeys
    from kvtier.client import MasterClient, MasterError

    if args.keys is None and args.session is None:
        print("kvtier prefetch: give --keys or --session (or both)", file=sys.stderr)
        return 2
    keys = _keys(args.keys) if args.keys is not None else None
    auth = ClientKeys.load(args.auth_dir, args.master) if args.auth_dir else None
    try:
        with MasterClient(args.master, timeout_s=args.timeout, auth=auth) as m:
            got = m.prefetch(args.node, keys, args.session, args.ttl)
    except MasterError as e:
        print(f"kvtier prefetch: {args.master}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(dataclasses.asdict(got)))
    else:
        print(f"{got.outcome}: {got.why} (session {got.session!r}: {got.asked} keys asked, {got.held} held in the "
              f"cluster, {got.in_top} in the node's top tier, {got.queued} queued)")
    return 1 if got.outcome == "rejected" else 0
