"""``kvtier keys``: make CurveZMQ keypairs for authenticated sockets (README "Authenticated sockets").

    kvtier keys generate /etc/kvtier/master --name server     # a daemon's keypair
    kvtier keys generate /etc/kvtier/engine                   # a client's keypair (client.key, client.key_secret)
"""

from __future__ import annotations

import argparse

from kvtier.auth.files import generate, load_public


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="CurveZMQ keypairs for kvtier-master/kvtier-pool --auth-dir and auth_dir")
    keys = p.add_subparsers(dest="keys_command", required=True)
    g = keys.add_parser("generate", help="write DIR/NAME.key (public, 0644) and DIR/NAME.key_secret (0600)")
    g.add_argument("dir", help="directory to write the keypair to (created 0700 if missing)")
    g.add_argument("--name", default="client", help="file name: 'server' for a daemon's own keypair, 'client' "
                   "(the default) for an engine's")
    g.add_argument("--force", action="store_true", help="replace an existing keypair (locks out every peer "
                   "that trusts the old public key)")
    g.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    public, secret = generate(args.dir, args.name, force=args.force)
    print(f"wrote {secret} (secret, 0600) and {public} (public, 0644)")
    print(f"public key: {load_public(public).decode()}")
    if args.name == "server":
        print(f"daemon: start it with --auth-dir {args.dir}; put its clients' public keys in {args.dir}/authorized/; "
              f"give each client a copy of {public} as server.key")
    else:
        print(f"client: copy {public} into each daemon's authorized/ directory, the daemon's server.key into "
              f"{args.dir}, and set auth_dir = {args.dir}")
    return 0
