"""RDMA transport: what can be checked anywhere (why RDMA is unavailable, the pool still serving tcp, how
rows merge into work requests), and a real round trip that runs where pyverbs and an RDMA device exist."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bytecheck import assert_all_hits_exact
from conftest import blocks_for
from kvtier.transport import connect
from kvtier.transport import rdma
from kvtier.transport.base import PoolError
from kvtier.wire import verbs as rdma_verbs
from poolproc import PoolProcess

BB = 64 << 10
REASON = rdma.unavailable_reason()


def test_the_reason_rdma_is_unavailable_is_named(tmp_path):
    if REASON is None:
        pytest.skip("this host has RDMA")
    assert "pyverbs is not installed" in REASON or "no RDMA device" in REASON
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB) as p:
        with pytest.raises(PoolError, match="RDMA is not possible: " + REASON.split(" (")[0]):
            connect(p.tcp, BB, transport="rdma", timeout_s=2.0)
        conn = connect(p.tcp, BB, timeout_s=2.0)  # auto: falls back to the stream data port
        assert conn.transport == "stream"
        conn.close()


def test_a_pool_asked_for_a_missing_device_says_why_and_serves_tcp(tmp_path):
    with PoolProcess(tmp_path, capacity="4MiB", block_bytes=BB, args=("--rdma", "nodev0")) as p:
        assert "no RDMA (" in p.log()
        conn = connect(p.tcp, BB, timeout_s=2.0)
        assert "rdma" not in conn.info.transports and conn.transport == "stream"
        conn.close()


@given(runs=st.lists(st.tuples(st.integers(1, 5), st.booleans(), st.booleans()), min_size=1, max_size=8))
@settings(max_examples=200, deadline=None)
def test_work_requests_cover_every_row_once_and_merge_only_true_runs(runs):
    bb = 4096
    local, remote, la, ra = [], [], 1 << 20, 1 << 30
    for count, local_gap, remote_gap in runs:
        la += bb * local_gap
        ra += bb * remote_gap
        for _ in range(count):
            local.append(la)
            remote.append(ra)
            la += bb
            ra += bb
    local_a, remote_a = np.array(local, np.uint64), np.array(remote, np.uint64)
    starts, sizes = rdma._merge(local_a, remote_a, bb)
    assert sizes.sum() == len(local) * bb
    covered = []
    for s, size in zip(starts.tolist(), sizes.tolist()):
        n = size // bb
        assert (np.diff(local_a[s : s + n].astype(np.int64)) == bb).all()
        assert (np.diff(remote_a[s : s + n].astype(np.int64)) == bb).all()
        covered += range(s, s + n)
    assert covered == list(range(len(local)))


def test_device_specs():
    assert rdma_verbs.device_spec("mlx5_0:1:3") == ("mlx5_0", 1, 3)
    assert rdma_verbs.device_spec("mlx5_1") == ("mlx5_1", 1, 0)


@pytest.mark.skipif(REASON is not None, reason=f"RDMA round trip: {REASON}")
def test_round_trip_over_rdma(tmp_path, make_keys):  # pragma: no cover - needs an RDMA NIC
    with PoolProcess(tmp_path, capacity="16MiB", block_bytes=BB, args=("--rdma", "auto")) as p:
        conn = connect(p.tcp, BB, transport="rdma", timeout_s=2.0)
        keys = make_keys(64)
        src = blocks_for(keys, BB)
        rows = np.uint64(src.data_ptr()) + np.arange(64, dtype=np.uint64) * np.uint64(BB)
        assert conn.put(keys, rows) == [True] * 64  # through the bounce buffer
        out = torch.zeros_like(src)
        conn.register(out.data_ptr(), out.numel())  # zero-copy into registered memory
        hit = conn.get(keys, np.uint64(out.data_ptr()) + np.arange(64, dtype=np.uint64) * np.uint64(BB))
        assert_all_hits_exact(hit, out, src)
        conn.close()


def test_queue_pairs_enter_init_with_remote_read_and_write_allowed():
    # Distinct bits per flag name, so a dropped or swapped flag changes the mask.
    enums = SimpleNamespace(IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_ACCESS_REMOTE_READ=4,
                            IBV_ACCESS_REMOTE_ATOMIC=8, IBV_ACCESS_MW_BIND=16)
    assert rdma_verbs.remote_access(enums) == 1 | 2 | 4
    assert rdma_verbs.init_fields(enums, 3) == {"port_num": 3, "pkey_index": 0, "qp_access_flags": 1 | 2 | 4}


def test_the_access_flags_are_pyverbs_own():
    e = pytest.importorskip("pyverbs.enums", reason="pyverbs is not installed: its flag values cannot be checked")
    assert rdma_verbs.remote_access(e) == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE


@pytest.mark.skipif(REASON is not None, reason=f"a real queue pair: {REASON}")
def test_a_new_queue_pair_is_in_init_with_remote_access():  # pragma: no cover - needs an RDMA device
    from pyverbs import enums as e

    port = rdma_verbs.Port.open(None)
    qp = rdma_verbs.QueuePair(port)
    try:
        attr, _ = qp.qp.query(e.IBV_QP_STATE | e.IBV_QP_ACCESS_FLAGS)
        assert attr.qp_state == e.IBV_QPS_INIT
        assert attr.qp_access_flags & rdma_verbs.remote_access(e) == rdma_verbs.remote_access(e)
    finally:
        qp.close()
        port.close()
