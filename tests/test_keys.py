import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.keys import KEY_BYTES, Namespace, check_keys


def test_keys_are_16_bytes_and_deterministic():
    ns = Namespace("llama", "fp1")
    keys = ns.keys([b"\x01" * 32, 7, "abc"])
    assert all(type(k) is bytes and len(k) == KEY_BYTES for k in keys)
    assert keys == Namespace("llama", "fp1").keys([b"\x01" * 32, 7, "abc"])
    assert len(set(keys)) == 3


@pytest.mark.parametrize("change", [
    {"model": "other"}, {"layout": "fp2"}, {"rank": 1}, {"world_size": 4}, {"cache_group": 1}, {"extra": "salt"},
])
def test_namespace_fields_separate_keys(change):
    base = dict(model="llama", layout="fp1", rank=0, world_size=2, cache_group=0, extra="")
    a, b = Namespace(**base), Namespace(**{**base, **change})
    hashes = [b"h" * 32, 12345, "page"]
    assert not set(a.keys(hashes)) & set(b.keys(hashes))


def test_hash_types_do_not_collide():
    ns = Namespace("m")
    # The int 97 and the byte string b"a" (0x61 == 97) and the str "a" must be three different keys.
    assert len({ns.key(97), ns.key(b"a"), ns.key("a"), ns.key(b"\x61\x00\x00\x00\x00\x00\x00\x00")}) == 4


def test_negative_and_large_int_hashes():
    ns = Namespace("m")
    keys = ns.keys([-1, 2**200, -(2**70), 0])
    assert len(set(keys)) == 4


def test_rank_must_fit_world():
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        Namespace("m", rank=2, world_size=2)


def test_bad_hash_type():
    with pytest.raises(TypeError, match="bytes, int or str"):
        Namespace("m").keys([1.5])


@given(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=200), st.integers(1, 32))
def test_chain_is_prefix_closed(tokens, block_size):
    ns = Namespace("m")
    keys = ns.chain(tokens, block_size)
    assert len(keys) == len(tokens) // block_size
    # A prefix of the tokens yields a prefix of the keys; extending from a parent gives the same chain.
    half = (len(tokens) // block_size // 2) * block_size
    assert ns.chain(tokens[:half], block_size) == keys[: half // block_size]
    if half:
        assert ns.chain(tokens[half:], block_size, parent=keys[half // block_size - 1]) == keys[half // block_size:]


def test_chain_depends_on_every_earlier_token():
    ns = Namespace("m")
    a = np.arange(64)
    b = a.copy()
    b[3] += 1
    ka, kb = ns.chain(a, 16), ns.chain(b, 16)
    assert all(x != y for x, y in zip(ka, kb))  # block 0 differs, so every later key differs
    c = a.copy()
    c[40] += 1
    kc = ns.chain(c, 16)
    assert ka[:2] == kc[:2] and ka[2] != kc[2] and ka[3] != kc[3]


def test_check_keys_names_the_bad_key():
    with pytest.raises(ValueError, match="key 1: expected 16 bytes, got bytes of length 3"):
        check_keys([b"x" * 16, b"abc"])
    with pytest.raises(ValueError, match="key 0"):
        check_keys(["x" * 16])
