"""Block keys: 16 bytes each, namespaced so that two models, layouts or parallel ranks never collide.

A key is a plain ``bytes`` of length 16 end to end (tiers, wire, lmdb): no per-key Python objects beyond
the bytes themselves. Two ways to make keys:

* from the engine's own block hashes (vLLM's ``BlockHash`` bytes, an int, SGLang's hex page keys), folded
  with the namespace: ``ns.keys(hashes)``;
* for callers without engine hashes, chained from token ids: ``ns.chain(token_ids, block_size)``, where each
  block's key hashes its parent's key and its own tokens, so a key names the whole prefix up to its block.

Hash: xxh3-128. It is not a cryptographic hash; keys come from trusted engines in one deployment, and its
128 bits make an accidental collision among 10^12 blocks about 10^-15 likely.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

KEY_BYTES = 16
BlockKey = bytes  # exactly KEY_BYTES long

# A one-byte tag per source type, so the int 0x61 and the bytes b"a" never fold to the same key.
_TAG_BYTES, _TAG_INT, _TAG_STR, _TAG_TOKENS = b"b", b"i", b"s", b"t"

_xxh128 = xxhash.xxh3_128_digest


@dataclass(frozen=True)
class Namespace:
    """Everything that must differ for two blocks with the same engine hash to hold different bytes.

    ``layout`` is ``BlockLayout.fingerprint``; ``rank``/``world_size`` the tensor- (and pipeline-) parallel
    position of the worker whose slice of KV the block holds; ``cache_group`` the engine's KV cache group
    (hybrid models); ``extra`` anything else (model revision, a cache-bust salt).
    """

    model: str
    layout: str = ""
    rank: int = 0
    world_size: int = 1
    cache_group: int = 0
    extra: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < max(self.world_size, 1):
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        text = "\x1f".join(
            ["kvtier-ns-v1", self.model, self.layout, str(self.rank), str(self.world_size),
             str(self.cache_group), self.extra]
        )
        # sha256 here (once per namespace): the namespace digest is the root every key hangs from.
        object.__setattr__(self, "digest", hashlib.sha256(text.encode()).digest()[:KEY_BYTES])

    def key(self, engine_hash: bytes | int | str) -> BlockKey:
        """Fold one engine block hash into this namespace."""
        return _xxh128(self.digest + _encode_hash(engine_hash))

    def keys(self, engine_hashes: Iterable[bytes | int | str]) -> list[BlockKey]:
        """Fold a batch of engine block hashes into this namespace (the hot path: one list, no objects)."""
        root = self.digest
        out: list[bytes] = []
        append = out.append
        for h in engine_hashes:
            if type(h) is bytes:  # noqa: E721 - the common case, kept first and cheap
                append(_xxh128(root + _TAG_BYTES + h))
            else:
                append(_xxh128(root + _encode_hash(h)))
        return out

    def chain(
        self, token_ids: Sequence[int] | np.ndarray, block_size: int, parent: BlockKey | None = None
    ) -> list[BlockKey]:
        """Keys of the full blocks of ``token_ids``: key[i] = H(key[i-1] || tokens of block i).

        The first block hangs from ``parent`` (a key returned by an earlier call, to extend a prefix) or
        from the namespace itself. A trailing partial block gets no key: only full blocks are cached.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        tokens = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64).astype("<u4", copy=False))
        n_blocks = len(tokens) // block_size
        raw = tokens[: n_blocks * block_size].tobytes()
        step = block_size * 4
        prev = parent if parent is not None else self.digest
        out: list[bytes] = []
        for i in range(n_blocks):
            prev = _xxh128(prev + _TAG_TOKENS + raw[i * step : (i + 1) * step])
            out.append(prev)
        return out


def _encode_hash(h: bytes | int | str) -> bytes:
    if isinstance(h, (bytes, bytearray, memoryview)):
        return _TAG_BYTES + bytes(h)
    if isinstance(h, int):
        # Python hashes (older vLLM) can be negative: signed, little-endian, minimal length >= 8.
        return _TAG_INT + h.to_bytes(max(8, (h.bit_length() + 8) // 8), "little", signed=True)
    if isinstance(h, str):
        return _TAG_STR + h.encode()
    raise TypeError(f"an engine block hash must be bytes, int or str, got {type(h).__name__}")


def rendezvous_order(keys: np.ndarray, names: Sequence[str]) -> np.ndarray:
    """Highest-random-weight ranking of ``names`` for each key: row i lists name indices, best first.

    ``keys``: (n, 2) uint64 (a key blob viewed as two words). Stable across processes and machines, so
    clients and the master agree without talking; a name joining or leaving moves only its share of keys.
    """
    salts = np.array([xxhash.xxh3_64_intdigest(name.encode()) for name in names], np.uint64)
    scores = _splitmix64(keys[:, 0][:, None] ^ keys[:, 1][:, None] ^ salts[None, :])
    return np.argsort(scores, axis=1, kind="stable")[:, ::-1]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def check_keys(keys: Sequence[bytes]) -> None:
    """Raise ValueError naming the first key that is not KEY_BYTES bytes."""
    # Fast path, looped in C: every call of the store checks its whole batch.
    if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {KEY_BYTES}:
        return
    for i, k in enumerate(keys):
        if type(k) is not bytes or len(k) != KEY_BYTES:  # noqa: E721
            got = f"{type(k).__name__} of length {len(k)}" if hasattr(k, "__len__") else type(k).__name__
            raise ValueError(f"key {i}: expected {KEY_BYTES} bytes, got {got}")
