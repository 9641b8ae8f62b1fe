"""Engine-compatible block hashers: token ids -> the exact block hashes vLLM or SGLang computes for them.

A router that wants to ask "who holds this prompt's prefix" must name the blocks exactly as the engine that
stored them did. Connectors fold the engine's own block hashes into kvtier keys (``Namespace.keys``), so a
router does ``ns.keys(hasher.hashes(token_ids))`` with the hasher of that engine and gets the same keys.

* vLLM (v1, ``--prefix-caching-hash-algo sha256``, the default): block i's hash is
  ``sha256(pickle.dumps((parent, tuple(tokens_i), extra_keys), HIGHEST_PROTOCOL))`` with parent = the
  previous block's hash, and for block 0 ``NONE_HASH = sha256(pickle.dumps(seed))`` where seed is
  $PYTHONHASHSEED if set, else "vllm-none-hash" (vllm/v1/core/kv_cache_utils.py: hash_block_tokens,
  init_none_hash, get_request_block_hasher; vllm/utils/hashing.py: sha256). ``extra_keys`` is None for a
  plain text request; with a LoRA adapter it is (lora_name,) on every block, and a ``cache_salt`` is
  appended on block 0 only. Only full blocks get a hash.
* SGLang (HiCache storage): page i's key is ``sha256(bytes.fromhex(prior) || uint32-LE tokens_i).hexdigest()``
  with no prior for the first page (python/sglang/srt/mem_cache/hicache_storage.py: get_hash_str). Only
  full pages get a key.

Token ids must be Python ints for vLLM's hash (pickle encodes numpy ints differently): hashers convert.
Pure functions; thread-safe.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

VLLM_DEFAULT_SEED = "vllm-none-hash"


class BlockHasher(Protocol):
    """Token ids -> one engine block hash per full block (bytes for vLLM, hex str for SGLang)."""

    block_size: int

    def hashes(self, token_ids: Sequence[int] | np.ndarray) -> list[Any]: ...


def _full_blocks(token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    if block_size <= 0:
        raise ValueError(f"block size must be > 0, got {block_size}")
    ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(t) for t in token_ids]
    return ids[: len(ids) // block_size * block_size]


def vllm_sha256(obj: Any) -> bytes:
    """vLLM's default block hash function: sha256 of the pickled object."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_none_hash(seed: str | None = None) -> bytes:
    """The parent hash of a prompt's first block, as vLLM's init_none_hash computes it for sha256."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED)
    return vllm_sha256(seed)


class VllmBlockHasher:
    """vLLM v1's default (sha256) request block hasher for text prompts, optionally with a LoRA adapter
    and a cache salt. ``seed`` must equal the engine's PYTHONHASHSEED if it sets one."""

    def __init__(self, block_size: int, *, seed: str | None = None, lora_name: str | None = None,
                 cache_salt: str | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block size must be > 0, got {block_size}")
        self.block_size = block_size
        self.none_hash = vllm_none_hash(seed)
        self.lora_name = lora_name
        self.cache_salt = cache_salt

    def _extra_keys(self, first: bool) -> tuple[Any, ...] | None:
        # generate_block_hash_extra_keys: lora keys + (mm keys) + cache salt (block 0) + (prompt embeds)
        extra: list[Any] = [self.lora_name] if self.lora_name else []
        if first and self.cache_salt:
            extra.append(self.cache_salt)
        return tuple(extra) if extra else None

    def hashes(self, token_ids: Sequence[int] | np.ndarray, parent: bytes | None = None) -> list[bytes]:
        """Hashes of the full blocks; ``parent`` continues a chain (the hash of the block before token 0)."""
        ids = _full_blocks(token_ids, self.block_size)
        bs = self.block_size
        prev = parent or self.none_hash
        out = []
        for start in range(0, len(ids), bs):
            extra = self._extra_keys(first=start == 0 and parent is None)
            prev = vllm_sha256((prev, tuple(ids[start : start + bs]), extra))
            out.append(prev)
        return out


class SglangPageHasher:
    """SGLang's HiCache page keys (hex sha256, chained over uint32-LE token ids)."""

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page size must be > 0, got {page_size}")
        self.block_size = page_size

    def hashes(self, token_ids: Sequence[int] | np.ndarray, prior_hash: str | None = None) -> list[str]:
        """Keys of the full pages; ``prior_hash`` continues a chain (the key of the page before token 0)."""
        ids = _full_blocks(token_ids, self.block_size)
        if any(t < 0 or t >= 1 << 32 for t in ids):
            raise ValueError("SGLang hashes token ids as uint32: every id must be in [0, 2^32)")
        raw = np.asarray(ids, dtype="<u4").tobytes()
        step = self.block_size * 4
        prev = bytes.fromhex(prior_hash) if prior_hash else b""
        out = []
        for i in range(0, len(raw), step):
            digest = hashlib.sha256(prev + raw[i : i + step]).digest()
            out.append(digest.hex())
            prev = digest
        return out
