"""``kvtier keys``: make CurveZMQ keypairs for authenticated sockets (docs/pool.md "Authenticated sockets").

    kvtier keys generate /etc/kvtier/daemon --role daemon       # a daemon's keypair (server.key, server.key_secret)
    kvtier keys generate /etc/kvtier/engine                     # an engine's (client.key, client.key_secret)
    kvtier keys generate /etc/kvtier/ops --role operator        # an operator's (client.*): clear, forget

The role decides the file name (``server`` for a daemon, ``client`` otherwise; ``--name`` overrides it), is
written into the key files' metadata, and names the directory of a daemon's ``authorized/`` the public key goes
into (kvtier/auth/roles.py); the command prints the exact copy to make.
"""

from __future__ import annotations

import argparse

from kvtier.auth.files import generate, load_public
from kvtier.auth.roles import DAEMON, ENGINE, ROLE_DIRS, ROLES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="CurveZMQ keypairs for kvtier-master/kvtier-pool --auth-dir and auth_dir")
    keys = p.add_subparsers(dest="keys_command", required=True)
    g = keys.add_parser("generate", help="write DIR/NAME.key (public, 0644) and DIR/NAME.key_secret (0600)")
    g.add_argument("dir", help="directory to write the keypair to (created 0700 if missing)")
    g.add_argument("--role", choices=ROLES, default=None,
                   help="engine (put/get/lookup/hints; the default), daemon (a kvtier-pool reporting to the master: "
                   "register/heartbeat/goodbye as a node), operator (an engine's rights plus clear and forget)")
    g.add_argument("--name", default=None, help="file name (default: 'server' for --role daemon, else 'client')")
    g.add_argument("--force", action="store_true", help="replace an existing keypair (locks out every peer "
                   "that trusts the old public key)")
    g.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    # Before roles, `--name server` made a daemon's keypair: it still does.
    role = args.role or (DAEMON if args.name == "server" else ENGINE)
    name = args.name or ("server" if role == DAEMON else "client")
    public, secret = generate(args.dir, name, force=args.force, role=role)
    print(f"wrote {secret} (secret, 0600) and {public} (public, 0644), role {role}")
    print(f"public key: {load_public(public).decode()}")
    into = f"<daemon dir>/authorized/{ROLE_DIRS[role]}/"
    if role == DAEMON:
        print(f"daemon: start it with --auth-dir {args.dir}; put its clients' public keys in {args.dir}/authorized/"
              f"{{engines,operators}}/; give each client a copy of {public} as server.key; for a pool that reports "
              f"to a master, copy {public} into the master's {into} and the master's server.key to "
              f"{args.dir}/master.key")
    else:
        print(f"{role}: copy {public} into each daemon's {into}, the daemons' server.key into {args.dir}, and set "
              f"auth_dir = {args.dir}")
    return 0
