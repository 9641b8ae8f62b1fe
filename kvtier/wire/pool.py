"""The pool's wire protocol: kvtier.wire's envelope and codec, with block bytes riding as extra zmq frames.

    request: [envelope, *data]     envelope = wire.encode_request(req_id, op, body)
    reply:   [envelope, *data]     envelope = wire.encode_reply(req_id, ok, body)

Keys travel as one n*16-byte blob (``keys``), per-key flags as a packed bitmap (``np.packbits``, key i is bit i
in big-endian bit order), per-key offsets as little-endian int64 blobs. Every reply body carries ``epoch``, the
pool's incarnation (a fresh random number per start), so a client notices a restarted pool at its next call.

Ops (request body -> reply body):

  hello     {block_bytes}        -> {node, epoch, block_bytes, capacity, max_keys, lease_s, transports, session,
                                     request_bytes}
            Never sizes the pool: without --block-bytes the first op that stores (put, reserve, a data-port
            put) sets the size from its ``block_bytes``; until then block_bytes is 0 and other data ops answer
            ERR_NOT_READY (the pool holds nothing). Blocks under 512 B are refused; a client whose blocks have
            another size is refused (ERR_BAD_REQUEST naming both sizes). ``transports`` maps each data path
            the pool offers to what a client needs for it: {"tcp": {}, "stream": {"port", "token"?},
            "shm": {"path", "nbytes", "generations"} ({} until the pool is sized), "rdma": {...}}. "token"
            (a pool with --auth-dir): 32 bytes a data connection must send first (kvtier/auth/tokens.py); a
            fresh one per hello. ``session``: 32 bytes every lease op (reserve, commit, acquire, release)
            must carry: leases are bound to the client (its key or address) and this session.
            ``request_bytes``: the largest request a client should send (a batch's requests in flight then
            fit in its share of what it may hold: pool/budget.py).
  contains  {keys}               -> {held: bitmap}
  remove    {keys}               -> {removed: int}
  put       {keys} + data        -> {held: bitmap}        data: the n blocks' bytes in key order, cut into
                                                          frames anywhere on block boundaries
  get       {keys}               -> {hit: bitmap} + data  data: the hits' bytes in key order, same framing rule
  reserve   {keys}               -> {lease, held: bitmap, offsets, generations}   one-sided writes (shm, rdma):
            ``offsets`` are the byte offsets in the pool's buffer of the reserved keys (held, but not held
            before), in key order, ``generations`` their slots' (bumped for this reservation); the client fills
            them, then commits (a pipelined client piggybacks the commits of the chunks
            it has copied on its next reserve: {keys, leases, oks} -> {..., valid: [bool]})
  commit    {lease, ok}          -> {published: int, valid: bool}    publishes them (ok False gives them back);
            {leases, oks}        -> {published: int, valid: [bool]}  several reservations in one round trip
  acquire   {keys}               -> {lease, offsets, generations}   one-sided reads: offset per key, -1 for a
            miss; the blocks stay put (not evicted, not reused) until their release, or until the lease
            expires (a pipelined client piggybacks the releases of the chunks it has copied: {keys,
            releases: [lease]}). ``generations``: little-endian uint64 per key, its slot's generation
            (kvtier/wire/generations.py); after its copy the client reads them again (a changed one: a miss).
            Reserve and acquire grant at most the client's share of the pool's held budget: keys past it are
            answered not held / -1, and ``skipped`` says how many.
  release   {lease}              -> {valid: bool}        valid False: the lease had expired (the bytes read may
            {leases}             -> {valid: bool}        have been reused: the client must count those blocks
                                                         as misses); for a list, whether all were live
  touch     {keys}               -> {touched: int}      (noreply) blocks a one-sided client read without an
            acquire, where it saw them last (a reserve or acquire reply), its copy proven by the slots'
            generations unchanged since (kvtier/transport/locations.py): counted as hits and as accesses for
            the pool's eviction policy. A slot's generation is also bumped when its key leaves it (removed,
            evicted, a failed write), so such a read of a key no longer held is a miss.
  stats     {}                   -> {tier, leases, counters}
  clear     {}                   -> {removed: int}       drop every block (an operator's reset; a policy's
            history, e.g. S3-FIFO's ghosts, stays)
  observe   {now, scope, arrivals, completions, hints} -> {taken: int}   what the sender's engine knows about
            its agents (kvtier/wire/observations.py), for the pool's eviction policy: the pool evicts by the same
            session-aware policy as the engines' DRAM; at most 4096 observations and max_keys keys a message
  rdma_connect {qp fields}       -> {qp fields, rkey, addr}   see kvtier/wire/verbs.py, pool/rdma.py
  copy_from {source, keys}       -> {copied, missing}     copy the keys' blocks from the pool at ``source``
            (its client endpoint) into this one, pool to pool (pool/replicas.py; hot-block replication
            asks for the same copy in a heartbeat reply); an operator's op, answered when the copy is done

Leases expire after the pool's ``lease_s`` and are quarantined for another ``lease_s`` before their slots are
reused (pool/leases.py); lease numbers are random 62-bit values, and act only for the client and session
that took them; ``release``, ``commit`` and ``touch`` carry ``noreply`` True when the client does not wait for
the answer.
Errors use kvtier.wire's codes, and ERR_BUSY: the pool has too much waiting from this client (or from all of
them) and answers at once instead of queueing; a put over the pool's capacity is ERR_TOO_LARGE naming the
sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier import wire
from kvtier.units import format_bytes

HELLO = "hello"
CONTAINS = "contains"
REMOVE = "remove"
PUT = "put"
GET = "get"
RESERVE = "reserve"
COMMIT = "commit"
ACQUIRE = "acquire"
RELEASE = "release"
STATS = "stats"
CLEAR = "clear"
RDMA_CONNECT = "rdma_connect"
COPY_FROM = "copy_from"
OBSERVE = "observe"
TOUCH = "touch"

# Clients cut batches into requests of at most the hello's request_bytes but no fewer than MIN_REQUEST_BLOCKS
# blocks (kvtier/transport/connection.py), a few in flight; however small the pool, each client may hold
# (reserve, acquire, have in flight) at least MIN_HELD_BLOCKS (pool/budget.py), room for those few.
MIN_REQUEST_BLOCKS = 4
MIN_HELD_BLOCKS = 4 * MIN_REQUEST_BLOCKS

# Pools register with the master under these labels; clients place and look up blocks among them only.
POOL_LABELS = {"role": "pool"}
# Where a pool may be (a node's registered address, a copy's source): no inproc://, no other zmq transport.
ENDPOINT_SCHEMES = ("tcp://", "ipc://")
PAGES_LABEL = "dram_pages"  # a pool's DRAM page size ("4 KiB", "2 MiB (THP)"), as it registered: kvtier status

ERR_WRONG_SIZE = wire.ERR_BAD_REQUEST  # a client whose blocks differ in size from the pool's
ERR_NOT_READY = "not_ready"  # a data op (other than a put) before any put sized the pool
ERR_BUSY = "busy"  # too much waiting from this client or from all of them; answered at once, try again


def bitmap(flags: Sequence[bool] | np.ndarray) -> bytes:
    return np.packbits(np.asarray(flags, dtype=bool)).tobytes()


def unbitmap(blob: bytes, n: int) -> list[bool]:
    """The first ``n`` flags of a bitmap; WireError when it is too short."""
    if len(blob) * 8 < n:
        raise wire.WireError(wire.ERR_BAD_MESSAGE, f"bitmap of {len(blob)} bytes for {n} keys")
    return np.unpackbits(np.frombuffer(blob, np.uint8), count=n).astype(bool).tolist()


def offsets(values: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def unoffsets(blob: bytes, n: int) -> np.ndarray:
    if len(blob) != 8 * n:
        raise wire.WireError(wire.ERR_BAD_MESSAGE, f"{len(blob)} bytes of offsets for {n} entries")
    return np.frombuffer(blob, "<i8")


def too_large(n: int, block_bytes: int, capacity: int) -> str | None:
    """Why ``n`` blocks can never fit a pool of ``capacity`` bytes (naming the sizes), or None if they can."""
    if n * block_bytes <= capacity:
        return None
    return (f"a put of {n} blocks x {format_bytes(block_bytes)} = {format_bytes(n * block_bytes)} exceeds the "
            f"pool's capacity of {format_bytes(capacity)}")
