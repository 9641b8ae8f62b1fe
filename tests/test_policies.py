import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies import EvictionPolicy, known_policies, make_policy, policy_class
from kvtier.policies.lru import LRUPolicy


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_registry_lists_builtins_and_rejects_unknown():
    assert {"lru", "s3fifo"} <= set(known_policies())
    with pytest.raises(ValueError, match=r"unknown eviction policy 'lfru'; known: .*lru.*s3fifo"):
        policy_class("lfru")
    with pytest.raises(ValueError, match="cannot load eviction policy 'nope.mod:X'"):
        policy_class("nope.mod:X")


def test_import_path_loading():
    assert policy_class("kvtier.policies.lru:LRUPolicy") is LRUPolicy
    assert policy_class("kvtier.policies.lru.LRUPolicy") is LRUPolicy
    assert isinstance(make_policy("lru", 4), EvictionPolicy)


def test_lru_order():
    p = make_policy("lru", 4)
    p.insert([k(1), k(2), k(3)])
    p.access([k(1)])
    assert p.victims(1, set()) == [k(2)]
    assert p.victims(5, {k(3)}) == [k(1)]  # k(3) protected: only one victim available
    assert len(p) == 1


def test_s3fifo_keeps_reused_keys_and_drops_one_hit_wonders():
    p = make_policy("s3fifo", 10)
    hot = [k(i) for i in range(5)]
    p.insert(hot)
    p.access(hot)  # each hot key hit once while in the small queue
    cold = [k(i) for i in range(100, 120)]
    for c in cold:  # a scan of one-hit wonders, evicting one key per insert as a full tier would
        p.insert([c])
        if len(p) > 10:
            (v,) = p.victims(1, set())
            assert v not in hot
    assert all(h in p._freq for h in hot)


def test_s3fifo_ghost_readmits_into_main():
    p = make_policy("s3fifo", 10)
    p.insert([k(1)])
    assert p.victims(1, set()) == [k(1)]
    p.insert([k(1)])
    assert k(1) in p._main


@pytest.mark.parametrize("name", ["lru", "fifo", "s3fifo", "arc", "chain-lru", "pnu"])
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "access", "remove", "evict"]),
                              st.lists(st.integers(0, 30), max_size=6), st.integers(0, 5)), max_size=60),
       protected=st.sets(st.integers(0, 30), max_size=10))
def test_policy_invariants(name, ops, protected):
    """Victims are tracked, unprotected, distinct, at most n; fewer than n only if nothing else is evictable."""
    p = make_policy(name, 16)
    tracked: set[bytes] = set()
    prot = {k(i) for i in protected}
    for op, ids, n in ops:
        keys = list(dict.fromkeys(k(i) for i in ids))
        if op == "insert":
            new = [x for x in keys if x not in tracked]
            p.insert(new)
            tracked |= set(new)
        elif op == "access":
            p.access(keys)
        elif op == "remove":
            p.remove(keys)
            tracked -= set(keys)
        else:
            v = p.victims(n, prot)
            assert len(v) == len(set(v)) <= n
            assert set(v) <= tracked and not set(v) & prot
            if len(v) < n:
                assert tracked - set(v) <= prot
            tracked -= set(v)
        assert len(p) == len(tracked)


def test_fifo_ignores_hits():
    p = make_policy("fifo", 4)
    p.insert([k(1), k(2), k(3)])
    p.access([k(1)])
    assert p.victims(1, set()) == [k(1)]  # LRU would take k(2)
    assert p.victims(5, {k(3)}) == [k(2)]
    assert len(p) == 1


class CountingSet(set):
    """A protected set that counts membership checks (how many keys an eviction looked at)."""

    checks = 0

    def __contains__(self, key: object) -> bool:
        self.checks += 1
        return super().__contains__(key)


@pytest.mark.parametrize("name", ["lru", "fifo"])
def test_protected_head_is_not_rescanned(name):
    p = make_policy(name, 2000)
    keys = [k(i) for i in range(2000)]
    p.insert(keys)
    protected = CountingSet(keys[:1000])  # the oldest half is pinned
    assert p.victims(4, protected) == keys[1000:1004]
    first, protected.checks = protected.checks, 0
    assert first == 1004
    assert p.victims(4, protected) == keys[1004:1008]
    assert protected.checks == 4  # the pinned keys went to the back: not looked at again
    assert p.victims(2000, protected) == keys[1008:]  # the rest, each looked at once
    assert p.victims(1, protected) == [] and len(p) == 1000


def test_lru_protected_keys_count_as_recently_used():
    p = make_policy("lru", 4)
    p.insert([k(1), k(2), k(3)])
    assert p.victims(1, {k(1)}) == [k(2)]
    assert p.victims(1, set()) == [k(3)]  # k(1), passed while pinned, is now the most recently used
