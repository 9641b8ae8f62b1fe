"""Engine-compatible block hashers: token ids -> the exact block hashes vLLM or SGLang computes for them.

A router that wants to ask "who holds this prompt's prefix" must name the blocks exactly as the engine that
stored them did. Connectors fold the engine's own block hashes into kvtier keys (``Namespace.keys``), so a
router does ``ns.keys(hasher.hashes(token_ids))`` with the hasher of that engine and the namespace the
connector used (``vllm_namespace`` for KVTierConnector, ``sglang_namespace`` for KVTierHiCacheStorage) and
gets the same keys.

* vLLM 0.33 (v1, ``--prefix-caching-hash-algo sha256``, the default): block i's hash is
  ``sha256(pickle.dumps((parent, tuple(tokens_i), extra_keys), HIGHEST_PROTOCOL))`` with parent = the
  previous block's hash, and for block 0 ``NONE_HASH = sha256(pickle.dumps(seed))`` where seed is
  $PYTHONHASHSEED if set, else "vllm-none-hash" (vllm/v1/core/kv_cache_utils.py: hash_block_tokens,
  init_none_hash, get_request_block_hasher, generate_block_hash_extra_keys; vllm/utils/hashing.py: sha256).
  ``extra_keys`` is None for a plain text request; with a LoRA adapter ("lora", name, path) is on every
  block, and ("cache_salt", salt) is appended on block 0 only. Only full blocks get a hash. (Checked against
  the real vllm 0.33.0 functions, Request included; older vLLM used bare names and salts.)
* SGLang 0.5.23 (HiCache storage): page i's key is ``sha256(prior || uint32-LE tokens_i).hexdigest()``, prior
  the previous page's digest; a page with a token id >= 2^32 hashes ``prior || 0xff || uint64-LE tokens``
  instead. The first page's prior is empty, or, for a request with an ``extra_key`` or ``cache_salt``, the
  namespace seed sha256("sglang-cache-namespace-v1" || per part: 0x00 if absent, else 0x01 || u64-LE length
  || utf-8). (python/sglang/srt/mem_cache/utils.py: get_hash_str, storage_namespace_seed,
  get_storage_hash_str; cpp_utils/hash_binding.cpp: hash_page.) Only full pages get a key.

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

from kvtier.keys import Namespace

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
    """vLLM 0.33's default (sha256) request block hasher for text prompts, optionally with a LoRA adapter
    (its name and path, as the engine's LoRARequest has them) and a cache salt. ``seed`` must equal the
    engine's PYTHONHASHSEED if it sets one."""

    def __init__(self, block_size: int, *, seed: str | None = None, lora_name: str | None = None,
                 lora_path: str = "", cache_salt: str | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block size must be > 0, got {block_size}")
        self.block_size = block_size
        self.none_hash = vllm_none_hash(seed)
        self.lora = ("lora", lora_name, lora_path) if lora_name else None
        self.cache_salt = cache_salt

    def _extra_keys(self, first: bool) -> tuple[Any, ...] | None:
        # generate_block_hash_extra_keys: lora keys + (mm keys) + cache salt (block 0) + (prompt embeds)
        extra: list[Any] = [self.lora] if self.lora else []
        if first and self.cache_salt:
            extra.append(("cache_salt", self.cache_salt))
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


def vllm_namespace(model: str, layout_fingerprint: str, *, rank: int = 0, world_size: int = 1,
                   revision: str | None = None, hash_algo: str = "sha256", weights: str = "", cache_group: int = 0,
                   group_kind: str = "") -> Namespace:
    """The namespace KVTierConnector's worker of TP/PP ``rank`` (of ``world_size``) stores its keys under.

    ``model`` is the ``model`` config key if set, else the served model as vLLM names it (``--model``);
    ``layout_fingerprint`` is that rank's ``BlockLayout.fingerprint`` (the worker logs it); ``revision`` the
    model revision (None when not given), ``hash_algo`` vLLM's ``--prefix-caching-hash-algo`` and ``weights``
    the checkpoint's fingerprint (kvtier.weights; the worker logs it as ``weights ...``; "" when it has none).
    ``cache_group`` is vLLM's KV cache group index and ``group_kind`` its kind in a hybrid model ("" for a
    single-group model, whose keys are as they were before hybrid models were stored).
    The one place this fold is written: the connector builds its namespace here too.
    """
    extra = (f"revision={revision};hash={hash_algo}" + (f";weights={weights}" if weights else "")
             + (f";group={group_kind}" if group_kind else ""))
    return Namespace(model, layout_fingerprint, rank=rank, world_size=world_size, cache_group=cache_group,
                     extra=extra)


def sglang_namespace(model: str, host_fingerprint: str, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                     pp_size: int = 1, cp_rank: int = 0, cp_size: int = 1, rank_replicated: bool = False) -> Namespace:
    """The namespace KVTierHiCacheStorage (kvtier.connectors.sglang) stores an SGLang rank's pages under.

    ``model`` is the ``model`` config key if set, else SGLang's storage model name (the served model name);
    ``host_fingerprint`` the fingerprint of that rank's host pool layout (the backend logs it at start-up as
    ``fp ...``). MHA pages are one TP rank's heads: the namespace carries ``tp_rank`` of ``tp_size``. MLA
    pages (``rank_replicated``) are the same on every TP rank: no TP rank or size, so every rank reads the
    one copy TP rank 0 wrote. Pipeline stages and attention context-parallel ranks hold different bytes and
    always count. The one place this fold is written: the backend builds its namespace here too.
    """
    rank, world = (0, 1) if rank_replicated else (tp_rank, tp_size)
    return Namespace(model, host_fingerprint, rank=rank, world_size=world, cache_group=0,
                     extra=f"engine=sglang;pp={pp_rank}/{pp_size};cp={cp_rank}/{cp_size}")


class SglangPageHasher:
    """SGLang's HiCache page keys (hex sha256, chained), for requests with an optional ``extra_key`` and
    ``cache_salt`` as the engine's request has them."""

    def __init__(self, page_size: int, *, extra_key: str | None = None, cache_salt: str | None = None) -> None:
        if page_size <= 0:
            raise ValueError(f"page size must be > 0, got {page_size}")
        self.block_size = page_size
        self.seed = sglang_namespace_seed(extra_key, cache_salt)

    def hashes(self, token_ids: Sequence[int] | np.ndarray, prior_hash: str | None = None) -> list[str]:
        """Keys of the full pages; ``prior_hash`` continues a chain (the key of the page before token 0)."""
        ids = _full_blocks(token_ids, self.block_size)
        if any(t < 0 or t >= 1 << 63 for t in ids):
            raise ValueError("SGLang hashes token ids as non-negative int64 values")
        prior = prior_hash if prior_hash is not None else self.seed
        prev = bytes.fromhex(prior) if prior else b""
        bs = self.block_size
        out = []
        for i in range(0, len(ids), bs):
            page = ids[i : i + bs]
            if max(page) < 1 << 32:
                data = np.asarray(page, dtype="<u4").tobytes()
            else:  # "wide" pages: a 0xff tag (an odd length keeps them apart from uint32 pages), then uint64s
                data = b"\xff" + np.asarray(page, dtype="<u8").tobytes()
            digest = hashlib.sha256(prev + data).digest()
            out.append(digest.hex())
            prev = digest
        return out


def sglang_namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """The prior of a request's first page when it has an extra key or a cache salt (else None)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
        else:
            encoded = part.encode("utf-8")
            digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()
