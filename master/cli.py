"""``kvtier-master``: start the cluster directory daemon.

    kvtier-master --bind tcp://127.0.0.1:7300 --data-dir /var/lib/kvtier-master --metrics-port 9310

Errors at start-up (address in use, unwritable data dir, bad option) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import zmq

from kvtier.auth.exposure import check_binds
from kvtier.daemon.startup import add_start_options, parse_and_log, start_error
from kvtier.master.cost import DEFAULT_TIER_BW, CostDefaults
from kvtier.master.persist import DiskError
from kvtier.master.placement import known_placements, make_placement
from kvtier.master.server import MasterServer
from kvtier.master.service import MasterSettings
from kvtier.units import parse_bytes


def _bandwidths(text: str) -> dict[str, float]:
    out = dict(DEFAULT_TIER_BW)
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected tier=bytes_per_s, got {item!r}")
        out[name.strip()] = float(parse_bytes(value.strip().removesuffix("/s")))
    return out


def build_parser() -> argparse.ArgumentParser:
    d = MasterSettings()
    p = argparse.ArgumentParser(prog="kvtier-master", description="kvtier cluster directory: where every KV "
                                "block is, how hot it is, and what it costs to bring back")
    p.add_argument("--bind", default=d.bind, help=f"zmq endpoint to serve on (default {d.bind}; "
                   "tcp://host:* picks a free port)")
    p.add_argument("--data-dir", help="directory for the lmdb state (nodes, hints, directory snapshots); "
                   "without it (and without --directory) nothing survives a restart")
    p.add_argument("--directory", default="", help="redis://HOST:PORT/N (or unix:///path.sock?db=N): keep the state "
                   "in Redis, shared by every master started with the same URL (docs/master.md 'Running more "
                   "than one master'); default: this process (with --data-dir's lmdb)")
    p.add_argument("--write-timeout-s", type=float, default=d.write_timeout_s, help="with --directory: a write not "
                   f"applied from the shared log by then is answered '{'unavailable'}' (default {d.write_timeout_s:g})")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help=f"Prometheus port (default {d.metrics_port}; 0 picks a free one; -1 disables)")
    p.add_argument("--metrics-host", default=d.metrics_host, help=f"metrics bind address (default {d.metrics_host}: "
                   "the metrics port has no authentication; e.g. 0.0.0.0 to let a Prometheus on another host scrape)")
    p.add_argument("--lease-s", type=float, default=d.lease_s,
                   help=f"a node silent this long is dead and its placements vanish (default {d.lease_s})")
    p.add_argument("--heat-half-life-s", type=float, default=d.heat_half_life_s,
                   help=f"half-life of a key's access heat (default {d.heat_half_life_s})")
    p.add_argument("--placement", default=d.placement, help=f"route_put policy: {', '.join(known_placements())} "
                   f"or package.module:Class (default {d.placement})")
    p.add_argument("--max-batch-keys", type=int, default=d.max_batch_keys,
                   help=f"largest batch one request may carry (default {d.max_batch_keys}); the largest message "
                   "read is 24 B per key of it plus 1 MiB")
    g = p.add_argument_group("memory bounds (docs/reliability.md)")
    g.add_argument("--max-nodes", type=int, default=d.max_nodes, help=f"node records kept, dead ones included "
                   f"(default {d.max_nodes}; past it the oldest dead node is forgotten, else a register is refused)")
    g.add_argument("--max-nodes-per-client", type=int, default=d.max_nodes_per_client,
                   help="nodes one CurveZMQ key may hold (with --auth-dir; default 0: only --max-nodes)")
    g.add_argument("--max-locations", type=int, default=d.max_locations, help="node tiers numbered at once (a bit "
                   f"of every directory entry's mask each; default {d.max_locations})")
    g.add_argument("--forget-dead-s", type=float, default=d.forget_dead_s, help="a dead node is forgotten, here "
                   f"and on disk, this long after it died (default {d.forget_dead_s:g})")
    g.add_argument("--max-hint-keys", type=int, default=d.max_hint_keys,
                   help=f"keyed pins and priorities kept (default {d.max_hint_keys})")
    g.add_argument("--max-hint-sessions", type=int, default=d.max_hint_sessions,
                   help=f"session pins and priorities kept (default {d.max_hint_sessions})")
    g.add_argument("--max-hints-per-client", type=int, default=d.max_hints_per_client,
                   help="hints one CurveZMQ key may hold (with --auth-dir; default 0: only the totals)")
    g.add_argument("--reply-budget", type=parse_bytes, default=d.reply_budget_bytes, help="bytes of large replies "
                   "unsent to slow or absent readers, all clients together, before more get ERR_BUSY (default "
                   f"{d.reply_budget_bytes >> 20}MiB)")
    g.add_argument("--client-reply-budget", type=parse_bytes, default=d.client_reply_bytes, help="the same per "
                   f"client connection (default {d.client_reply_bytes >> 20}MiB)")
    g.add_argument("--handshake-timeout-s", type=float, default=d.handshake_timeout_s, help="a connection that has "
                   f"not finished zmq's handshake (CurveZMQ's with --auth-dir) by then is closed (default "
                   f"{d.handshake_timeout_s:g})")
    p.add_argument("--replicate-heat", type=float, default=d.replicate_heat, help="hot-block replication: a key "
                   "this hot (decayed accesses) held by one pool gets a copy on another, dropped again below half "
                   "of it (default 0: off; docs/master.md 'Hot-block replication')")
    p.add_argument("--replicate-interval-s", type=float, default=d.replicate_interval_s,
                   help=f"how often replication looks at the hottest keys (default {d.replicate_interval_s:g})")
    p.add_argument("--snapshot-interval-s", type=float, default=d.snapshot_interval_s,
                   help=f"write a directory snapshot this often, 0: only at shutdown (default {d.snapshot_interval_s})")
    p.add_argument("--tier-bw", type=_bandwidths, default=dict(DEFAULT_TIER_BW),
                   help="bandwidth per tier name where nodes have measured none yet, e.g. "
                   "'dram=20GB,ssd=3GB' (bytes/s; defaults: "
                   + ", ".join(f"{k}={v / 1e9:g}GB" for k, v in DEFAULT_TIER_BW.items()) + ")")
    p.add_argument("--path-bw", type=lambda s: float(parse_bytes(s)), default=CostDefaults().path_bw,
                   help="node-to-node bandwidth where none is measured yet (bytes/s, default 10GB)")
    p.add_argument("--auth-dir", default="", help="require CurveZMQ keys: DIR/server.key_secret is this daemon's "
                   "keypair, DIR/authorized/*.key the clients admitted (kvtier keys generate; "
                   "docs/pool.md 'Authenticated sockets'). Default: only this user's processes (the owner token; "
                   "--insecure-bind: anyone)")
    p.add_argument("--insecure-bind", action="store_true", help="serve without authentication: without it and "
                   "without --auth-dir only this user's processes may connect (the owner token, found with no "
                   "configuration); with it anyone who reaches the port (every local user, and the network for a "
                   "non-loopback --bind, which needs it) may do any op; logged as a warning")
    add_start_options(p, "{endpoint, metrics_port, pid}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_and_log(build_parser(), argv)
    try:
        if args.lease_s <= 0 or args.heat_half_life_s <= 0:
            raise ValueError("--lease-s and --heat-half-life-s must be > 0")
        for name in ("max_batch_keys", "max_nodes", "max_locations", "max_hint_keys", "max_hint_sessions",
                     "reply_budget", "client_reply_budget"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if args.forget_dead_s < 0 or args.handshake_timeout_s <= 0:
            raise ValueError("--forget-dead-s must be >= 0 and --handshake-timeout-s > 0")
        if args.directory and args.data_dir:
            raise ValueError("--directory and --data-dir are exclusive: with a shared directory the state lives there")
        if args.directory and not args.directory.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--directory {args.directory!r}: expected redis://HOST:PORT/N or unix:///path?db=N")
        if args.directory:
            import redis  # noqa: F401 - the optional dependency, checked now rather than at the first write
        make_placement(args.placement)
        check_binds("kvtier-master", [args.bind], auth=bool(args.auth_dir), insecure=args.insecure_bind,
                    log=logging.getLogger("kvtier.master"))
        settings = MasterSettings(
            bind=args.bind, data_dir=args.data_dir, directory=args.directory, write_timeout_s=args.write_timeout_s,
            metrics_port=None if args.metrics_port < 0 else args.metrics_port, metrics_host=args.metrics_host,
            lease_s=args.lease_s, heat_half_life_s=args.heat_half_life_s, placement=args.placement,
            max_batch_keys=args.max_batch_keys, snapshot_interval_s=args.snapshot_interval_s,
            max_nodes=args.max_nodes, max_nodes_per_client=args.max_nodes_per_client,
            max_locations=args.max_locations, forget_dead_s=args.forget_dead_s, max_hint_keys=args.max_hint_keys,
            max_hint_sessions=args.max_hint_sessions, max_hints_per_client=args.max_hints_per_client,
            reply_budget_bytes=args.reply_budget, client_reply_bytes=args.client_reply_budget,
            handshake_timeout_s=args.handshake_timeout_s, replicate_heat=args.replicate_heat,
            replicate_interval_s=args.replicate_interval_s,
            cost=CostDefaults(tier_bw=args.tier_bw, path_bw=args.path_bw), auth_dir=args.auth_dir,
            insecure_bind=args.insecure_bind,
        )
        server = MasterServer(settings, ready_file=args.ready_file)
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency; a plain loop still works
            asyncio.run(server.run())
        else:
            uvloop.run(server.run())
    except ImportError as e:
        return start_error("kvtier-master", f"--directory needs the redis package ({e}): pip install 'kvtier[redis]'")
    except (ValueError, OSError, DiskError, zmq.ZMQError) as e:  # AuthError is a ValueError
        return start_error("kvtier-master", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
