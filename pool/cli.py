"""``kvtier-pool``: serve a node's DRAM to other nodes (tcp://) and to engine processes on this host (ipc://).

    kvtier-pool --master tcp://127.0.0.1:7300 --bind tcp://127.0.0.1:7400 --capacity 8GiB
    kvtier-pool --bind ipc:///run/kvtier/pool.sock --capacity 64GiB          # standalone node pool
    kvtier-pool --bind tcp://0.0.0.0:7400 --bind ipc:///run/kvtier/pool.sock --advertise tcp://node-3:7400

Errors at start-up (address in use, bad option, no room in /dev/shm) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

import zmq

from kvtier.auth.exposure import check_binds
from kvtier.daemon.startup import add_start_options, parse_and_log, start_error
from kvtier.policies import make_policy
from kvtier.pool.server import PoolServer
from kvtier.pool.sizing import block_size_problem
from kvtier.pool.state import PoolSettings
from kvtier.units import parse_bytes


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    d = PoolSettings()
    p = argparse.ArgumentParser(prog="kvtier-pool", description="kvtier node pool: a DRAM region serving KV "
                                "blocks to engines on this host (shared memory) and to other nodes (tcp, rdma)")
    p.add_argument("--bind", action="append", help=f"endpoint to serve on, repeatable: tcp://host:port (other "
                   f"nodes; tcp://host:* picks a free port) and/or ipc:///path (engine processes on this host, "
                   f"which then map the pool's DRAM; standalone mode). Default {d.bind[0]}")
    p.add_argument("--capacity", type=parse_bytes, default=d.capacity, help="bytes of DRAM to serve (default 8GiB)")
    p.add_argument("--block-bytes", type=parse_bytes, default=0, help="block size; default: set by the first client "
                   "to store a block (a hello never sets it)")
    p.add_argument("--master", default="", help="kvtier-master endpoint to register with (placements, events, "
                   "heartbeats); without it clients list this pool in their 'pool' setting")
    p.add_argument("--node-id", default="", help="name with the master (default pool-<host>-<hash of address>)")
    p.add_argument("--advertise", default="", help="endpoint other nodes reach this pool at (default: the tcp "
                   "endpoint bound, with the host name for a wildcard address)")
    p.add_argument("--label", action="append", type=_label, default=[], help="key=value label for the master, "
                   "repeatable (role=pool is always set)")
    p.add_argument("--insecure-bind", action="store_true", help="serve without authentication: without it and "
                   "without --auth-dir only this user's processes may connect (the owner token, found with no "
                   "configuration); with it anyone who reaches the ports (every local user, and the network for a "
                   "non-loopback --bind or --stream, which needs it) may read, overwrite and clear blocks; logged "
                   "as a warning")
    p.add_argument("--workers", type=int, default=d.workers, help=f"request threads (default {d.workers})")
    p.add_argument("--shm-dir", default=d.shm_dir, help=f"where the shared DRAM file lives when an ipc endpoint "
                   f"is bound (default {d.shm_dir})")
    p.add_argument("--lease-s", type=float, default=d.lease_s, help="how long a shared-memory or RDMA client may "
                   f"hold reserved or acquired blocks before they are taken back (default {d.lease_s})")
    p.add_argument("--eviction", default=d.eviction, help=f"eviction policy (default {d.eviction})")
    p.add_argument("--policy-clock", choices=("local", "sender"), default=d.policy_clock,
                   help="where the eviction policy reads time: local (this host's clock; the engines' observation "
                        "times are moved onto it), or sender (the latest time their observations carried: for a "
                        "pool standing in for a replay's second node, whose time is virtual)")
    p.add_argument("--max-keys", type=int, default=d.max_keys, help=f"most keys per request (default {d.max_keys})")
    p.add_argument("--copy-threads", type=int, default=d.copy_threads, help="threads per batched copy")
    p.add_argument("--prefault", action="store_true", help="touch all of the DRAM at start (no page faults later)")
    p.add_argument("--rdma", default=d.rdma, help="auto (use an RDMA device when there is one), off, or a device "
                   "name such as mlx5_0")
    p.add_argument("--stream", default=d.stream, help="the raw TCP data port clients move block bytes over "
                   "(received straight into place): auto (the tcp bind's host, a free port), off, or host:port")
    p.add_argument("--stream-max-connections", type=int, default=d.stream_max_connections,
                   help="data connections served at once; more are refused with a log line (each holds a thread; "
                   f"default {d.stream_max_connections})")
    p.add_argument("--stream-message-timeout-s", type=float, default=d.stream_message_timeout_s,
                   help="the longest one data message may take before its connection is dropped (a peer that "
                   f"trickles bytes holds a thread no longer; default {d.stream_message_timeout_s:g})")
    p.add_argument("--stream-pending-max", type=int, default=d.stream_pending_max,
                   help="data connections accepted but not yet admitted (no token / no request yet) at once; past "
                   f"it the oldest is closed (default {d.stream_pending_max})")
    p.add_argument("--handshake-s", type=float, default=d.handshake_s, help="a connection that has not finished "
                   "its handshake this fast (zmq greeting and CURVE on the zmq port, the token or a first request "
                   f"on the data port) is closed (default {d.handshake_s:g})")
    p.add_argument("--staging-bytes", type=parse_bytes, default=0, help="memory beyond --capacity for clients' "
                   "requests and replies (queued request data, get replies gathered into copies, envelopes on "
                   "the data port), half of it per client; past it requests are held back or answered busy "
                   "(default: capacity/8, at least 256MiB, at most 4GiB)")
    p.add_argument("--client-share", type=float, default=d.client_share, help="of the capacity, what one client "
                   "may hold unevictable at once (one-sided leases, replies in flight); all together at most half "
                   f"(default {d.client_share:g}; 1 for a pool with one trusted client, e.g. a tool's own)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port "
                   "(0: a free one, written to the ready file); default: no metrics")
    p.add_argument("--metrics-host", default=d.metrics_host, help=f"address of the metrics port (default "
                   f"{d.metrics_host}: this host only; it is not authenticated)")
    p.add_argument("--auth-dir", default="", help="require CurveZMQ keys: DIR/server.key_secret is this pool's "
                   "keypair, DIR/authorized/*.key the clients admitted, DIR/master.key (optional) the master's "
                   "public key; the data port then admits connections by a token handed out at hello "
                   "(docs/pool.md 'Authenticated sockets'). Default: only this user's processes (the owner token; "
                   "--insecure-bind: anyone)")
    p.add_argument("--heartbeat-s", type=float, default=None, help="heartbeat interval (default: lease/3)")
    add_start_options(p, "{endpoints, node, pid, epoch, shm_path, stream_port, metrics_port}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_and_log(build_parser(), argv)
    try:
        if min(args.workers, args.max_keys, args.copy_threads, args.stream_max_connections,
               args.stream_pending_max) < 1:
            raise ValueError("--workers, --max-keys, --copy-threads, --stream-max-connections and "
                             "--stream-pending-max must be >= 1")
        if min(args.capacity, args.lease_s, args.stream_message_timeout_s, args.handshake_s) <= 0:
            raise ValueError("--capacity, --lease-s, --stream-message-timeout-s and --handshake-s must be > 0")
        if args.staging_bytes < 0 or (args.metrics_port is not None and not 0 <= args.metrics_port < 65536):
            raise ValueError("--staging-bytes must be >= 0 and --metrics-port a port number")
        if not 0 < args.client_share <= 1:
            raise ValueError("--client-share must be in (0, 1]")
        if args.block_bytes:
            why = block_size_problem(args.block_bytes, args.capacity, minimum=1)
            if why:
                raise ValueError(f"--block-bytes: {why}")
        make_policy(args.eviction, 1)  # a bad policy fails now, not at the first client's hello
        binds = list(args.bind or PoolSettings().bind)
        if args.stream not in ("auto", "off"):  # auto follows the tcp bind's host
            binds.append(f"tcp://{args.stream}")
        check_binds("kvtier-pool", binds, auth=bool(args.auth_dir), insecure=args.insecure_bind,
                    log=logging.getLogger("kvtier.pool"))
        settings = PoolSettings(
            bind=tuple(args.bind or PoolSettings().bind), capacity=args.capacity, block_bytes=args.block_bytes,
            node_id=args.node_id, master=args.master, advertise=args.advertise, workers=args.workers,
            shm_dir=args.shm_dir, lease_s=args.lease_s, eviction=args.eviction, max_keys=args.max_keys,
            policy_clock=args.policy_clock,
            copy_threads=args.copy_threads, prefault=args.prefault, rdma=args.rdma, stream=args.stream,
            stream_max_connections=args.stream_max_connections,
            stream_message_timeout_s=args.stream_message_timeout_s, stream_pending_max=args.stream_pending_max,
            handshake_s=args.handshake_s, staging_bytes=args.staging_bytes, client_share=args.client_share,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host, heartbeat_s=args.heartbeat_s, auth_dir=args.auth_dir,
            insecure_bind=args.insecure_bind, labels=dict(args.label),
        )
        PoolServer(settings, ready_file=args.ready_file).run()
    except (ValueError, OSError, zmq.ZMQError) as e:
        return start_error("kvtier-pool", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
