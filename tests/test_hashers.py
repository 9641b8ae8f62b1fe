"""Engine-compatible hashers: byte-level constructions written out independently, known-answer vectors, chain
properties, and (where the engines are installed) a cross-check against the engines' own functions."""

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.hashers import SglangPageHasher, VllmBlockHasher, vllm_none_hash, vllm_sha256
from kvtier.keys import Namespace


def pickle5_block(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The pickle (protocol 5) stream of (parent32, (t0, t1, t2), None), assembled by hand from the opcodes, so
    the test does not trust the pickle module to be what vLLM hashes."""
    body = b"C" + bytes([len(parent)]) + parent + b"\x94"  # SHORT_BINBYTES, MEMOIZE
    body += b"".join(b"K" + bytes([t]) for t in tokens) + b"\x87\x94"  # BININT1 x3, TUPLE3, MEMOIZE
    body += b"N\x87\x94."  # NONE, TUPLE3, MEMOIZE, STOP
    return b"\x80\x05\x95" + struct.pack("<Q", len(body)) + body  # PROTO 5, FRAME <len>


def test_vllm_block_hash_is_sha256_of_the_pickled_tuple():
    parent = bytes(range(32))
    assert vllm_sha256((parent, (1, 2, 3), None)) == hashlib.sha256(pickle5_block(parent, (1, 2, 3))).digest()
    h = VllmBlockHasher(3, seed="s")
    first = h.hashes([1, 2, 3])[0]
    assert first == hashlib.sha256(pickle5_block(h.none_hash, (1, 2, 3))).digest()


def test_vllm_known_answers():
    # NONE_HASH for vLLM's default seed (PYTHONHASHSEED unset, sha256) and for PYTHONHASHSEED=0.
    assert vllm_none_hash("vllm-none-hash").hex() == \
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    assert vllm_none_hash("0").hex() == "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c"
    assert [x.hex() for x in VllmBlockHasher(4, seed="vllm-none-hash").hashes(list(range(10)))] == [
        "9da1c53089c000ad1a79a77c143b68dda00e2a85315bc1f690bbd03ba4a195dd",
        "1c9b6c0620e875631f1c5395ed56f2243aa113f88fc842f04fbb0654074b8d43",
    ]
    salted = VllmBlockHasher(4, seed="vllm-none-hash", lora_name="sql-lora", cache_salt="tenant-a")
    assert [x.hex() for x in salted.hashes(list(range(8)))] == [
        "80c57659e529483308a1a2430035289e2124b7c1f5066a40a459a98f0036f4c4",
        "18c523523ea4f9a751c91949751c69b81e1923a069825142d1faefd09371cf07",
    ]


def test_vllm_seed_follows_pythonhashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert vllm_none_hash() == vllm_none_hash("vllm-none-hash")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert vllm_none_hash() == vllm_none_hash("0")


def test_vllm_extra_keys_lora_every_block_salt_first_block_only():
    plain, lora = VllmBlockHasher(2, seed="x"), VllmBlockHasher(2, seed="x", lora_name="a")
    salt = VllmBlockHasher(2, seed="x", cache_salt="t")
    tokens = [5, 6, 7, 8]
    p = plain.hashes(tokens)
    assert lora.hashes(tokens)[0] == vllm_sha256((plain.none_hash, (5, 6), ("a",)))
    assert lora.hashes(tokens)[1] == vllm_sha256((lora.hashes(tokens)[0], (7, 8), ("a",)))
    s = salt.hashes(tokens)
    assert s[0] == vllm_sha256((plain.none_hash, (5, 6), ("t",)))
    assert s[1] == vllm_sha256((s[0], (7, 8), None)) and s[0] != p[0]


@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=50), bs=st.integers(1, 8), cut=st.integers(0, 10))
@settings(max_examples=100, deadline=None)
def test_chains_extend_and_only_full_blocks_hash(tokens, bs, cut):
    for hasher, tail in ((VllmBlockHasher(bs, seed="p"), "parent"), (SglangPageHasher(bs), "prior_hash")):
        full = hasher.hashes(tokens)
        assert len(full) == len(tokens) // bs
        # numpy ids hash like Python ints (vLLM pickles ints; numpy ints would pickle differently).
        assert hasher.hashes(np.asarray(tokens, np.int64)) == full
        k = min(cut, len(full))
        if k:
            rest = hasher.hashes(tokens[k * bs :], **{tail: full[k - 1]})
            assert full[:k] + rest == full


def test_sglang_page_key_is_chained_sha256_of_uint32_le_tokens():
    h = SglangPageHasher(2)
    keys = h.hashes([1, 2, 3, 4, 5])
    first = hashlib.sha256(struct.pack("<2I", 1, 2)).hexdigest()
    assert keys == [first, hashlib.sha256(bytes.fromhex(first) + struct.pack("<2I", 3, 4)).hexdigest()]
    assert SglangPageHasher(4).hashes([2**32 - 1, 0, 7, 65536]) == \
        ["ddb0e92fcbb97e96d5f9571ebbaa3aa410c5a39bfa5e5ee2504adc7ec5b7f9ba"]
    with pytest.raises(ValueError, match="uint32"):
        h.hashes([-1, 0])


def test_router_keys_fold_engine_hashes_like_connectors():
    ns = Namespace("m")
    hashes = VllmBlockHasher(4, seed="q").hashes(range(16))
    assert ns.keys(hashes) == [ns.key(x) for x in hashes]
    pages = SglangPageHasher(4).hashes(range(16))
    assert ns.keys(pages) == [ns.key(p) for p in pages] and len(set(ns.keys(pages) + ns.keys(hashes))) == 8


def test_matches_vllm_when_installed(monkeypatch):
    kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="vllm is not installed here (the vLLM "
                              "connector issue installs it in CI)")
    from vllm.utils.hashing import sha256

    monkeypatch.setenv("PYTHONHASHSEED", "kvtier-test")
    kcu.init_none_hash(sha256)
    tokens = list(range(100, 164))
    ours = VllmBlockHasher(16).hashes(tokens)
    prev, theirs = None, []
    for i in range(0, 64, 16):
        prev = kcu.hash_block_tokens(sha256, prev, tokens[i : i + 16], None)
        theirs.append(bytes(prev))
    assert ours == theirs


def test_matches_sglang_when_installed():
    storage = pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed here")
    tokens = list(range(7, 7 + 64 * 3))
    prev, theirs = None, []
    for i in range(0, len(tokens), 64):
        prev = storage.get_hash_str(tokens[i : i + 64], prior_hash=prev)
        theirs.append(prev)
    assert SglangPageHasher(64).hashes(tokens) == theirs
