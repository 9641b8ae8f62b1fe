"""Authenticated sockets: CurveZMQ keys for kvtier-master and kvtier-pool, and tokens for the pool's data port.

Keys are off unless configured (daemons: ``--auth-dir DIR``; clients: the ``auth_dir`` config key); without
them a daemon serves only its own user's processes, who find its owner token with no configuration (owner.py),
unless started with ``--insecure-bind`` (exposure.py). The key layout:

    daemon DIR (kvtier-master --auth-dir DIR, kvtier-pool --auth-dir DIR)
        server.key, server.key_secret      its own keypair (kvtier keys generate DIR --name server)
        authorized/{engines,daemons,operators}/*.key
                                           the public keys of the clients it admits, by role (roles.py: what each
                                           role may do); a key straight in authorized/ is an engine's
        master.key                         kvtier-pool only: the master's public key; the pool then reports to
                                           the master as a CURVE client with its own server keypair (so the
                                           master's authorized/ lists the pool's server.key)

    client DIR (an engine's ``auth_dir``)
        client.key, client.key_secret      its own keypair (kvtier keys generate DIR)
        server.key                         the daemons' public key (one keypair shared by the cluster's daemons)
        servers/<endpoint>.key             optional, per daemon: e.g. servers/10.0.0.2_7400.key for
                                           tcp://10.0.0.2:7400 (endpoint_key_name() says the name); wins over
                                           server.key for that endpoint

files.py reads and writes the key files, client.py is the client side (a socket's keys, and what to say when
a daemon stays silent; secure_client: keys or the owner token), server.py the daemons' gate with keys (CURVE
server + ZAP), owner.py the gate without keys (the owner token), gate.py what both gates share (a failed
handshake counted and logged), roles.py what each key may do (the per-op check both daemons make), exposure.py
the --insecure-bind rule for daemons without keys, tokens.py the data-port tokens, peercred.py the kernel's
credentials of an ipc:// peer (a keyless pool's proof that a caller is its own user; the proof a file a pool
names is the pool's own).
"""

from kvtier.auth.client import ClientKeys, secure_client, silence_hint
from kvtier.auth.files import AuthError, Keypair, endpoint_key_name, generate, load_keypair
from kvtier.auth.owner import OwnerGate, forget_tokens
from kvtier.auth.server import ServerAuth
from kvtier.auth.tokens import TOKEN_BYTES, DataTokens

__all__ = ["TOKEN_BYTES", "AuthError", "ClientKeys", "DataTokens", "Keypair", "OwnerGate", "ServerAuth",
           "endpoint_key_name", "forget_tokens", "generate", "load_keypair", "secure_client", "silence_hint"]
