"""Engine-compatible hashers: byte-level constructions written out independently, known-answer vectors, chain
properties, and (where the engines are installed) a cross-check against the engines' own functions."""

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys.hashers import SglangPageHasher, VllmBlockHasher, vllm_none_hash, vllm_sha256
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
    # Checked once against vllm 0.33.0's own Request + get_request_block_hasher (see the test at the end).
    salted = VllmBlockHasher(4, seed="vllm-none-hash", lora_name="sql-lora", lora_path="/adapters/sql",
                             cache_salt="tenant-a")
    assert [x.hex() for x in salted.hashes(list(range(8)))] == [
        "0435da4bd542e3ef8e9630d05dbbe503ecb90d0086b64885f23205ace8a56d43",
        "acdf0a66cd49e9fdd4ee915568e92f5cfb8926356747ed472c3d89a83250977b",
    ]


def test_vllm_seed_follows_pythonhashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert vllm_none_hash() == vllm_none_hash("vllm-none-hash")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert vllm_none_hash() == vllm_none_hash("0")


def test_vllm_extra_keys_lora_every_block_salt_first_block_only():
    plain, lora = VllmBlockHasher(2, seed="x"), VllmBlockHasher(2, seed="x", lora_name="a", lora_path="/p")
    salt = VllmBlockHasher(2, seed="x", cache_salt="t")
    tokens = [5, 6, 7, 8]
    p = plain.hashes(tokens)
    lk = ("lora", "a", "/p")
    assert lora.hashes(tokens)[0] == vllm_sha256((plain.none_hash, (5, 6), (lk,)))
    assert lora.hashes(tokens)[1] == vllm_sha256((lora.hashes(tokens)[0], (7, 8), (lk,)))
    s = salt.hashes(tokens)
    assert s[0] == vllm_sha256((plain.none_hash, (5, 6), (("cache_salt", "t"),)))
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
    with pytest.raises(ValueError, match="non-negative int64"):
        h.hashes([-1, 0])


def test_sglang_wide_pages_and_namespace_seed():
    # A token id past uint32 switches that page to the tagged uint64 encoding; the chain continues.
    keys = SglangPageHasher(2).hashes([1, 2**40, 3, 4])
    wide = hashlib.sha256(b"\xff" + struct.pack("<2Q", 1, 2**40)).digest()
    assert keys == [wide.hex(), hashlib.sha256(wide + struct.pack("<2I", 3, 4)).hexdigest()]
    # An extra key or a cache salt seeds the chain with the request namespace.
    seed = hashlib.sha256(b"sglang-cache-namespace-v1" + b"\x00" + b"\x01" + struct.pack("<Q", 4) + b"salt")
    salted = SglangPageHasher(2, cache_salt="salt").hashes([1, 2])
    assert salted == [hashlib.sha256(seed.digest() + struct.pack("<2I", 1, 2)).hexdigest()]
    assert SglangPageHasher(2, extra_key="salt").hashes([1, 2]) != salted  # which part it is matters


def test_router_keys_fold_engine_hashes_like_connectors():
    ns = Namespace("m")
    hashes = VllmBlockHasher(4, seed="q").hashes(range(16))
    assert ns.keys(hashes) == [ns.key(x) for x in hashes]
    pages = SglangPageHasher(4).hashes(range(16))
    assert ns.keys(pages) == [ns.key(p) for p in pages] and len(set(ns.keys(pages) + ns.keys(hashes))) == 8


def test_matches_vllm_when_installed(monkeypatch):
    kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="vllm is not installed here (the vLLM "
                              "connector issue installs it in CI)")
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.request import Request

    tokens = list(range(100, 100 + 16 * 5 + 3))
    for seed in (None, "0"):
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        kcu.init_none_hash(sha256)
        hasher = kcu.get_request_block_hasher(16, sha256)
        for lora, salt in ((None, None), (LoRARequest("sql-lora", 1, "/adapters/sql"), "tenant-a")):
            req = Request(request_id="r", prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                          pooling_params=None, block_hasher=hasher, cache_salt=salt, lora_request=lora)
            ours = VllmBlockHasher(16, lora_name=lora and lora.lora_name, lora_path=lora.lora_path if lora else "",
                                   cache_salt=salt).hashes(tokens)
            assert [bytes(b) for b in req.block_hashes] == ours, (seed, lora, salt)


def test_matches_sglang_when_installed():
    utils = pytest.importorskip("sglang.srt.mem_cache.utils", reason="sglang is not installed here")
    tokens = list(range(7, 7 + 64 * 3)) + [2**33] * 64
    assert SglangPageHasher(64).hashes(tokens) == utils.get_hash_str(tokens, None, page_size=64)
    seed = utils.storage_namespace_seed("lora-7", "tenant")
    assert SglangPageHasher(64, extra_key="lora-7", cache_salt="tenant").hashes(tokens) == \
        utils.get_hash_str(tokens, seed, page_size=64)
