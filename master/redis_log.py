"""RedisLog: the shared directory's home in Redis: the log of state changes, its snapshot, and the cluster's epoch.

Keys (under ``kvtier:`` in the URL's database, so one Redis can hold clusters in different databases):

* ``log``: a stream; one entry per state change a master accepted, fields ``n`` (1, 2, 3, ...: a counter
  incremented in the same script as the XADD, so a reader sees a gap or a step back at once) and ``c`` (the
  command, msgpack);
* ``n``: that counter; ``epoch``: a random id naming the history the log holds. Set when the cluster's state
  is seeded, and replaced (``rebase``) when a master finds the log lost or rewrote entries it had applied
  (Redis restarted behind its last writes, an older copy restored): a Redis that restarted without its data,
  or was flushed, has none; one re-seeded or rebased by another master has another;
* ``config``: the master settings that decide how commands apply (bounds, lease, heat half-life): every
  master of a cluster must have the same, or they would apply the same log differently;
* ``snap:current`` -> a generation; ``snap:GEN:meta`` (msgpack: the log position, nodes, hints) and
  ``snap:GEN:ARRAY:I`` (the directory's columns in 16 MiB chunks); ``snaplock``: which master writes the
  next one.

Appends run one Lua script per batch (epoch check, counter, XADD for each command): atomic, one round trip.
So do a seed (only where there is no epoch), a rebase (only under the epoch the master followed) and a
snapshot's publication (only under the epoch it was taken in).
The stream is trimmed (MINID) behind the previous snapshot and capped (MAXLEN ~ ``max_entries``) as a memory
bound; a master that falls behind a trim sees the gap in ``n`` and reloads from the snapshot.

Async (redis.asyncio) for the master's event loop; one reader connection blocks in XREAD, commands go over
the client's pool. Connection errors surface as redis.exceptions.ConnectionError / TimeoutError (the caller
turns them into read-only mode); an epoch mismatch on append as ``EpochChanged``.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgpack
import numpy as np
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

PREFIX = "kvtier:"
CHUNK_BYTES = 16 << 20
SNAPSHOT_FORMAT = 1

# KEYS: epoch, n, log; ARGV: epoch, maxlen, command...; returns the new n of the last command.
_APPEND = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('EPOCH changed or lost') end
local n = 0
for i = 3, #ARGV do
  n = redis.call('INCR', KEYS[2])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'n', n, 'c', ARGV[i])
end
return n
"""
# KEYS: epoch, n, log, snap:current, config; ARGV: epoch, generation, config. Seeds an empty (or data-lost)
# Redis with a snapshot written beforehand; 0 if another master seeded it first.
_SEED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[3])
redis.call('SET', KEYS[2], 0)
redis.call('SET', KEYS[4], ARGV[2])
redis.call('SET', KEYS[5], ARGV[3])
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""
# KEYS: epoch, n, log; ARGV: the epoch the caller followed, a new epoch, maxlen, command. The log lost or
# rewrote entries a master had applied: a new epoch, and the command (``_rebase``) appended under it, in one
# step; 0 if the epoch is no longer the one the caller followed (another master rebased or seeded first).
_REBASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
local n = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'n', n, 'c', ARGV[4])
return n
"""
# KEYS: epoch, snap:current; ARGV: epoch, generation. Publishes a snapshot only under the epoch it was taken in
# (a master that has not yet seen a rebase or a re-seed must not replace the new epoch's state with its own);
# returns the generation replaced, false if the epoch is another.
_PUBLISH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
local old = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[2], ARGV[2])
return old or ''
"""


class EpochChanged(RuntimeError):
    """The cluster's epoch is not the one this master follows: Redis lost its data, or another master re-seeded
    it. The master reloads (or re-seeds) before it records anything again."""


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class RedisLog:
    """The keys above, in the Redis at ``url``. ``timeout_s``: every command but the blocking read."""

    def __init__(self, url: str, timeout_s: float = 2.0, block_ms: int = 500, max_entries: int = 1_000_000) -> None:
        self.url = url
        self.block_ms = block_ms
        self.max_entries = max_entries
        opts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "retry": Retry(NoBackoff(), 0)}
        self.redis = Redis.from_url(url, **opts)
        # The blocking reader has its own connection and a timeout past its block time.
        self.reader = Redis.from_url(url, **{**opts, "socket_timeout": timeout_s + block_ms / 1000})
        self._append = self.redis.register_script(_APPEND)
        self._seed = self.redis.register_script(_SEED)
        self._rebase = self.redis.register_script(_REBASE)
        self._publish = self.redis.register_script(_PUBLISH)

    def key(self, name: str) -> str:
        return PREFIX + name

    async def close(self) -> None:
        for r in (self.redis, self.reader):
            try:
                await r.aclose()
            except Exception:  # closing a connection to a dead server must not stop a shutdown
                pass

    # ---- the cluster ----------------------------------------------------------------------------------

    async def epoch(self) -> str | None:
        raw = await self.redis.get(self.key("epoch"))
        return raw.decode() if raw is not None else None

    async def counter(self) -> int:
        raw = await self.redis.get(self.key("n"))
        return int(raw) if raw is not None else 0

    async def config(self) -> dict[str, Any] | None:
        raw = await self.redis.get(self.key("config"))
        return unpack(raw) if raw is not None else None

    async def seed(self, generation: str, config: dict[str, Any]) -> str | None:
        """Make a written snapshot ``generation`` the cluster's start under a new epoch; the epoch, or None if
        another master seeded first."""
        epoch = self.new_epoch()
        keys = [self.key(k) for k in ("epoch", "n", "log", "snap:current", "config")]
        won = await self._seed(keys=keys, args=[epoch, generation, pack(config)])
        return epoch if int(won) else None

    async def rebase(self, followed: str, epoch: str, command: bytes) -> int | None:
        """Replace the epoch ``followed`` by ``epoch`` (``new_epoch()``) and append ``command`` under it,
        atomically: the command's counter, or None if the cluster's epoch is not ``followed`` any more."""
        n = int(await self._rebase(keys=[self.key("epoch"), self.key("n"), self.key("log")],
                                   args=[followed, epoch, self.max_entries, command]))
        return n or None

    @staticmethod
    def new_epoch() -> str:
        return secrets.token_hex(8)

    # ---- the log --------------------------------------------------------------------------------------

    async def append(self, epoch: str, commands: list[bytes]) -> int:
        """Append ``commands`` in order, atomically; the counter of the last. EpochChanged if ``epoch`` is not
        the cluster's."""
        try:
            return int(await self._append(keys=[self.key("epoch"), self.key("n"), self.key("log")],
                                          args=[epoch, self.max_entries, *commands]))
        except ResponseError as e:
            if "EPOCH" in str(e):
                raise EpochChanged(str(e)) from None
            raise

    async def read(self, after: bytes, count: int, block: bool) -> list[tuple[bytes, int, bytes]]:
        """Entries after stream id ``after``: (id, n, command), at most ``count``; ``block`` waits up to
        ``block_ms`` for the first."""
        client = self.reader if block else self.redis
        got = await client.xread({self.key("log"): after}, count=count, block=self.block_ms if block else None)
        if not got:
            return []
        return [(eid, int(f[b"n"]), f[b"c"]) for eid, f in got[0][1]]

    async def entry_n(self, eid: bytes) -> int | None:
        """The counter of the entry with stream id ``eid``; None if the log holds no such entry."""
        got = await self.redis.xrange(self.key("log"), min=eid, max=eid, count=1)
        return int(got[0][1][b"n"]) if got else None

    async def first_id(self) -> bytes | None:
        """The stream id of the oldest entry the log still holds (None: the log is empty)."""
        got = await self.redis.xrange(self.key("log"), count=1)
        return got[0][0] if got else None

    async def trim(self, before: bytes) -> None:
        """Drop log entries older than stream id ``before`` (a snapshot covers them)."""
        await self.redis.xtrim(self.key("log"), minid=before, approximate=False)

    async def length(self) -> int:
        return int(await self.redis.xlen(self.key("log")))

    # ---- snapshots ------------------------------------------------------------------------------------

    async def take_snapshot_turn(self, owner: str, ttl_s: float) -> bool:
        """Whether this master writes the next snapshot (one master per interval)."""
        return bool(await self.redis.set(self.key("snaplock"), owner, nx=True, px=max(1, int(ttl_s * 1000))))

    async def write_snapshot(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> tuple[str, int]:
        """Write a snapshot under a fresh generation (not yet current); (generation, bytes written)."""
        gen = secrets.token_hex(6)
        manifest: dict[str, Any] = {}
        total = 0
        pipe = self.redis.pipeline(transaction=False)
        for name, arr in arrays.items():
            raw = np.ascontiguousarray(arr).tobytes()
            chunks = max(1, -(-len(raw) // CHUNK_BYTES))
            for i in range(chunks):
                pipe.set(self.key(f"snap:{gen}:{name}:{i}"), raw[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES])
            manifest[name] = [arr.dtype.str, list(arr.shape), chunks]
            total += len(raw)
        body = pack({**meta, "format": SNAPSHOT_FORMAT, "arrays": manifest})
        pipe.set(self.key(f"snap:{gen}:meta"), body)
        await pipe.execute()
        return gen, total + len(body)

    async def publish_snapshot(self, gen: str, epoch: str) -> bool:
        """Make ``gen`` current if the cluster's epoch is still ``epoch`` (the generation it replaced is deleted);
        False (``gen`` deleted) if not."""
        old = await self._publish(keys=[self.key("epoch"), self.key("snap:current")], args=[epoch, gen])
        if old is None:
            await self.drop_snapshot(gen)
            return False
        old_gen = old.decode()
        if old_gen and old_gen != gen:
            await self.drop_snapshot(old_gen)
        return True

    async def drop_snapshot(self, gen: str) -> None:
        keys = [k async for k in self.redis.scan_iter(match=self.key(f"snap:{gen}:*"), count=1000)]
        if keys:
            await self.redis.delete(*keys)

    async def load_snapshot(self) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """(meta, arrays) of the current snapshot, or None when there is none. A generation replaced while
        it was read is read again."""
        for _ in range(10):
            raw = await self.redis.get(self.key("snap:current"))
            if raw is None:
                return None
            gen = raw.decode()
            body = await self.redis.get(self.key(f"snap:{gen}:meta"))
            if body is None:
                continue
            meta = unpack(body)
            if meta.get("format") != SNAPSHOT_FORMAT:
                raise RuntimeError(f"the shared snapshot in {self.url} is of format {meta.get('format')!r}; this "
                                   f"master reads {SNAPSHOT_FORMAT} (run masters of one version)")
            arrays: dict[str, np.ndarray] = {}
            for name, (dtype, shape, chunks) in meta["arrays"].items():
                parts = await self.redis.mget([self.key(f"snap:{gen}:{name}:{i}") for i in range(chunks)])
                if any(p is None for p in parts):
                    break
                arrays[name] = np.frombuffer(b"".join(parts), dtype=np.dtype(dtype)).reshape(shape)
            else:
                return meta, arrays
        raise RuntimeError(f"the shared snapshot in {self.url} kept changing while it was read")
