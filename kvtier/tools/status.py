"""``kvtier status --master tcp://...``: one screen of a running cluster, for the person paged at 3 a.m.

What it shows, all from kvtier-master through the SDK's ``MasterClient`` (ping, nodes, top):
nodes and their state (dead and silent ones flagged first), each tier's capacity / used / utilization,
measured bandwidth and RPC latency per node, the directory's size, the master's requests by op with their
errors, lookup hits and misses (keys asked vs leading keys some live node held), the hottest prefixes, and
the master's most recent errors, and the standard agent hints this kvtier applies (``Request.kv_hints`` /
``GenerateReqInput.kv_hints``: actions and protocol versions, which no engine can advertise for it). ``--json``
prints the same data for scripts; ``--watch N`` redraws every N seconds (a master that stops answering is shown
as such, and the watch keeps trying). ``--hints`` prints the hints line alone, without a master.

    kvtier status --master tcp://10.0.0.1:7300 [--auth-dir DIR] [--top 10] [--json] [--watch 2]
    kvtier status --hints [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import time
from typing import Any

from kvtier.tools.status_shape import NODES, PING, TOP, MalformedStatus, check
from kvtier.units import format_bytes
from kvtier.wire.pool import PAGES_LABEL

EXIT_UNREACHABLE = 1  # no answer, or an error answer
EXIT_MALFORMED = 3  # an answer that is not a status (another version, not a master): nothing shown


def gather(master: str, top: int = 10, timeout_s: float = 2.0, auth_dir: str = "") -> dict[str, Any]:
    """Everything the screen shows, as plain data (what ``--json`` prints). Raises MasterError (MasterTimeout
    when the master does not answer within ``timeout_s``), or MalformedStatus when an answer is not the shape
    the screen reads (kvtier/tools/status_shape.py: checked here, once, before anything reads it)."""
    from kvtier.auth.client import ClientKeys
    from kvtier.client import MasterClient

    from kvtier.client.master import MasterError, parse_endpoints

    auth = ClientKeys.load(auth_dir, master) if auth_dir else None
    masters = []
    endpoints = parse_endpoints(master)
    if len(endpoints) > 1:  # several masters of one shared directory: each one's own state, then the cluster's
        for endpoint in endpoints:
            with MasterClient(endpoint, timeout_s=timeout_s, auth=auth) as one:
                try:
                    t0 = time.perf_counter()
                    p = one.ping()
                    check(PING, p, "ping", endpoint)
                    masters.append({"endpoint": endpoint, "up": True, "rtt_s": time.perf_counter() - t0,
                                    "uptime_s": p.get("uptime_s", 0), "backend": p.get("backend", {})})
                except (MasterError, MalformedStatus) as e:  # shown on its row; the cluster's view goes on
                    masters.append({"endpoint": endpoint, "up": False, "error": str(e)})
    with MasterClient(endpoints, timeout_s=timeout_s, auth=auth) as m:
        t0 = time.perf_counter()
        ping = m.ping()
        rtt = time.perf_counter() - t0
        nodes = m.nodes()
        hot = m.top(top) if top > 0 else None
        master = m.endpoint
    check(PING, ping, "ping", master)
    check(NODES, nodes, "nodes", master)
    if hot is not None:
        check(TOP, dataclasses.asdict(hot), "top", master)
    hottest = [] if hot is None else [
        {"key": k.hex(), "heat": round(h, 3), "count": c, "last": last}
        for k, h, c, last in zip(hot.keys, hot.heat, hot.count, hot.last)]
    from kvtier.connectors.kv_hints import supported_hints

    return {"master": master, "at": time.time(), "rtt_s": rtt, "ping": ping, "nodes": nodes, "hottest": hottest,
            "masters": masters, "hints": supported_hints()}


# ---- rendering -----------------------------------------------------------------------------------------------


def _ago(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s < 86400 else f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _rate(bw: float) -> str:
    return f"{bw / 1e9:.2f} GB/s" if bw >= 1e8 else f"{bw / 1e6:.1f} MB/s" if bw > 0 else "-"


def _latency(seconds: float | None) -> str:
    if not seconds:
        return "-"
    return f"{seconds * 1e3:.2f}ms" if seconds < 1 else f"{seconds:.1f}s"


STATE_ORDER = {"dead": 0, "syncing": 1, "pending": 2, "live": 3}


def _backend(b: dict[str, Any]) -> str:
    """Where the state lives, for the directory line: shared in redis (and its state when not ok), lmdb, memory."""
    if b.get("kind") != "redis":
        return f"   state in {b.get('kind', 'memory')}"
    state = b.get("state", "?")
    trouble = "" if state == "ok" else f", {state.upper()}: {b.get('why', '')}"
    return f"   shared in {b.get('url')} (entry {b.get('entry', 0):,}{trouble})"


def render(data: dict[str, Any], width: int = 110) -> str:
    """The screen, as text (no colours: it reads the same in a pager, a log or a ticket)."""
    ping, nodes = data["ping"], data["nodes"]
    activity = ping.get("activity", {})
    counts = ping.get("nodes", {})
    when = dt.datetime.fromtimestamp(data["at"]).strftime("%Y-%m-%d %H:%M:%S")
    out = [f"kvtier-master {data['master']}   up {_ago(ping.get('uptime_s', 0))}   rtt {_latency(data['rtt_s'])}"
           f"   lease {ping.get('lease_s', 0):g}s   {when}",
           f"directory {ping.get('keys', 0):,} keys ({format_bytes(ping.get('directory_bytes', 0))})   "
           f"{ping.get('locations', 0)} locations" + _backend(ping.get("backend", {})),
           ""]
    if data.get("masters"):
        out.append("MASTERS  " + f"{sum(m['up'] for m in data['masters'])} of {len(data['masters'])} answering")
        for m in data["masters"]:
            if m["up"]:
                b = m["backend"]
                out.append(f"  {'  ' if b.get('state') == 'ok' else '!!'}{m['endpoint']:<30}{b.get('state', '?'):<12}"
                           f"entry {b.get('entry', 0):<10,} rtt {_latency(m['rtt_s']):>8}   up {_ago(m['uptime_s'])}"
                           + (f"   ({b.get('why')})" if b.get("state") != "ok" else ""))
            else:
                out.append(f"  !!{m['endpoint']:<30}{'down':<12}{m['error'][:width - 50]}")
        out.append("")
    out += [
           "NODES  " + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("live", "syncing", "pending", "dead"))]
    header = (f"  {'':2}{'node':<22}{'state':<9}{'address':<24}{'silent':>8}{'rpc':>9}  {'tier':<6}"
              f"{'capacity':>11}{'used':>11}{'util':>6}{'bandwidth':>12}")
    out.append(header)
    for n in sorted(nodes, key=lambda n: (STATE_ORDER.get(n["state"], 9), n["node"])):
        flag = "!!" if n["state"] != "live" else "  "
        tiers = n.get("tiers") or [{"name": "-", "capacity": 0, "used": 0, "bw": 0.0}]
        for i, t in enumerate(tiers):
            util = f"{100 * t['used'] / t['capacity']:.0f}%" if t["capacity"] else "-"
            if i == 0:
                lead = (f"  {flag}{n['node'][:21]:<22}{n['state']:<9}{(n.get('address') or '-')[:23]:<24}"
                        f"{_ago(n.get('silent_s', 0)):>8}{_latency(n.get('rpc_latency_s')):>9}")
            else:
                lead = " " * (4 + 22 + 9 + 24 + 8 + 9)
            # a pool's DRAM page size, as it registered it (kvtier.memory.hostmem: huge pages where the kernel allows)
            pages = (n.get("labels") or {}).get(PAGES_LABEL) if t["name"] == "dram" else None
            out.append(f"{lead}  {t['name'][:5]:<6}{format_bytes(t['capacity']):>11}{format_bytes(t['used']):>11}"
                       f"{util:>6}{_rate(t.get('bw') or 0.0):>12}" + (f"  pages {pages}" if pages else ""))
    if not nodes:
        out.append("  (no node has registered)")
    lookups = activity.get("lookups", {})
    keys, hits = lookups.get("keys", 0), lookups.get("hits", 0)
    out += ["", f"LOOKUPS  {lookups.get('count', 0):,} lookups, {keys:,} keys asked: {hits:,} hits, "
                f"{lookups.get('misses', 0):,} misses" + (f" ({100 * hits / keys:.1f}% hit)" if keys else "")]
    requests = activity.get("requests", {})
    if requests:
        parts = []
        for op, by_status in sorted(requests.items(), key=lambda kv: -sum(kv[1].values())):
            errors = {s: c for s, c in by_status.items() if s != "ok"}
            err = (" (" + ", ".join(f"{c} {s}" for s, c in sorted(errors.items())) + ")") if errors else ""
            parts.append(f"{op} {sum(by_status.values()):,}{err}")
        line = "REQUESTS "
        for p in parts:
            if len(line) + len(p) + 3 > width:
                out.append(line)
                line = "         "
            line += " " + p + ","
        out.append(line.rstrip(","))
    out += ["", "HOTTEST PREFIXES (by decayed access heat)"]
    if data["hottest"]:
        out.append(f"  {'key':<34}{'heat':>10}{'accesses':>10}{'last access':>14}")
        for h in data["hottest"]:
            last = _ago(max(0.0, data["at"] - h["last"])) + " ago" if h["last"] else "never"
            out.append(f"  {h['key']:<34}{h['heat']:>10.2f}{h['count']:>10,}{last:>14}")
    else:
        out.append("  (none)")
    errors = activity.get("recent_errors", [])
    out += ["", f"RECENT ERRORS ({len(errors)})"]
    for e in errors[:10]:
        at = dt.datetime.fromtimestamp(e["at"]).strftime("%H:%M:%S")
        out.append(f"  {at} {e['op']:<10} {e['code']:<12} {e['message'][:width - 40]}")
    if not errors:
        out.append("  (none)")
    out += ["", hints_line(data["hints"])]
    return "\n".join(out)


def hints_line(hints: dict[str, Any]) -> str:
    from kvtier.connectors.kv_hints import describe_hints

    return f"AGENT HINTS (kv_hints envelope)  {describe_hints(hints)}"


def unreachable(master: str, error: Exception) -> str:
    return (f"kvtier status: master {master} did not answer: {error}\n"
            "  is kvtier-master running and reachable there? (started with --auth-dir: pass --auth-dir)")


def failure(master: str, error: Exception) -> tuple[str, int]:
    """What to print (on stderr) and the exit status when ``gather`` raised ``error``: one line naming the
    master and what was wrong for an answer that is not a status; for silence, the line and a hint."""
    from kvtier import wire
    from kvtier.client.master import MasterError, MasterTimeout

    if isinstance(error, MalformedStatus):
        return f"kvtier status: {error}", EXIT_MALFORMED
    if isinstance(error, MasterError) and error.code in (wire.ERR_BAD_MESSAGE, wire.ERR_BAD_VERSION):
        return f"kvtier status: master {master} answered a malformed status: {error}", EXIT_MALFORMED
    if isinstance(error, MasterTimeout):
        return unreachable(master, error), EXIT_UNREACHABLE
    return f"kvtier status: master {master} answered with an error: {error}", EXIT_UNREACHABLE


# ---- the command ---------------------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="one screen of a running cluster: nodes, tiers, bandwidth, hits, errors",
                       description=__doc__.split("\n")[0])
    p.add_argument("--master", help="kvtier-master's endpoint, e.g. tcp://10.0.0.1:7300, or the "
                   "masters of a shared directory, comma-separated (each one's state is shown)")
    p.add_argument("--top", type=int, default=10, help="how many of the hottest prefixes to show")
    p.add_argument("--json", action="store_true", help="print the data as JSON instead of the screen")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS", help="redraw every SECONDS")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the master")
    p.add_argument("--auth-dir", default="", help="CurveZMQ client keys, as the store's auth_dir")
    p.add_argument("--hints", action="store_true", help="print only the standard agent hints (kv_hints actions and "
                   "protocol versions) this kvtier applies; needs no master")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.client.master import MasterError
    from kvtier.connectors.kv_hints import supported_hints

    if args.hints:
        print(json.dumps({"hints": supported_hints()}, indent=1) if args.json else hints_line(supported_hints()))
        return 0
    if not args.master:
        print("kvtier status: --master is required (or --hints alone)", file=sys.stderr)
        return 2
    while True:
        try:
            data = gather(args.master, args.top, args.timeout, args.auth_dir)
            text = json.dumps(data, indent=1, default=str) if args.json else render(data)
            rc = 0
        except (MasterError, MalformedStatus) as e:
            text, rc = failure(args.master, e)
        if not args.watch:
            print(text, file=sys.stdout if rc == 0 else sys.stderr)
            return rc
        sys.stdout.write("\x1b[H\x1b[2J" + text + f"\n\n(every {args.watch:g} s; Ctrl-C to stop)\n")
        sys.stdout.flush()
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
