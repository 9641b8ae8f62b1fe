"""The vLLM connector across restarts, with vLLM's real scheduler and the worker connector over CPU KV, and a
real SSD tier: an engine stopped by SIGTERM (handled as vLLM's worker process handles it) writes DRAM's blocks
down with the default ssd_offload on_evict, so the restarted engine loads the prefix from the SSD (kill -9 of
the same engine, the negative control, leaves nothing); and a checkpoint changed in place (new weights under
the same path) gets no hit from the old checkpoint's SSD blocks, while the unchanged one does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it from tests/requirements-vllm.txt)")

from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from test_vllm_connector_modes import record_hit_sources, request_b  # noqa: E402
from vllm_engine import BLOCK, Engine, save_a_then_drop_hbm, tiny_model, vllm_config, worker_side  # noqa: E402

ENGINE = str(Path(__file__).parent / "vllm_sigterm_engine.py")


def ssd_opts(tmp_path: Path) -> dict:
    return {"ssd_path": str(tmp_path / "ssd"), "ssd_capacity": "16MiB", "ssd_segment_bytes": "1MiB"}


def first_engine(model_dir: str, ipc: str, opts: dict, sig: int) -> str:
    """Run an engine process that saves request A, stop it with ``sig``; its log."""
    extra = {"dram_capacity": "4MiB", "staging_bytes": "64KiB", "ipc_dir": ipc, **opts}
    proc = subprocess.Popen([sys.executable, ENGINE, model_dir, json.dumps(extra)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    try:
        line = proc.stdout.readline()
        assert line.strip() == "saved", proc.stderr.read()[-3000:]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return err


def loads_from_ssd(second) -> list[dict]:
    sources = record_hit_sources(second)
    b = request_b()
    second.add(b)
    second.run([b])  # every loaded block is checked bit-exact against what the forward computes
    assert second.load_errors == set()
    return sources


def test_sigterm_of_an_engine_writes_dram_down_and_the_restart_loads_from_the_ssd(engine, model, ipc_dir, tmp_path):
    opts = ssd_opts(tmp_path)  # ssd_offload: the default on_evict
    log = first_engine(model, ipc_dir, opts, signal.SIGTERM)
    second = engine(**opts)
    assert loads_from_ssd(second) == [{CacheHitSource.DISK: 5 * BLOCK}]
    assert worker_side(second).store.stats()["tiers"]["ssd"]["hits"] == 5
    assert "close: wrote" in log and "to ssd" in log, log[-3000:]  # and the engine said what it wrote


def test_kill_9_of_the_same_engine_leaves_nothing_on_the_ssd(engine, model, ipc_dir, tmp_path):
    """The negative control: what the restart found above came from the shutdown's write-down."""
    opts = ssd_opts(tmp_path)
    first_engine(model, ipc_dir, opts, signal.SIGKILL)
    second = engine(**opts)
    assert loads_from_ssd(second) == []  # no external hit: recomputed


def test_a_checkpoint_changed_in_place_gets_no_hit_from_the_old_weights(ipc_dir, tmp_path):
    model_dir = tmp_path / "model"  # a checkpoint of this test's own, rewritten below
    tiny_model(model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(b"old weights" * 100)
    opts = {**ssd_opts(tmp_path), "ssd_offload": "write_through"}

    def run(extra: dict) -> Engine:
        return Engine(vllm_config(str(model_dir), {"dram_capacity": "4MiB", "staging_bytes": "64KiB",
                                                     "ipc_dir": ipc_dir, **extra}))

    old = run(opts)
    try:
        save_a_then_drop_hbm(old)
        assert worker_side(old).store.flush(10)
        old_namespace = worker_side(old).namespace
    finally:
        old.close()
    same = run(opts)  # the control: the same checkpoint finds its blocks
    try:
        assert loads_from_ssd(same) == [{CacheHitSource.DISK: 5 * BLOCK}]
    finally:
        same.close()
    time.sleep(0.01)
    weights.write_bytes(b"new weights" * 100)  # fine-tuned in place: same names, same size
    new = run(opts)
    try:
        assert loads_from_ssd(new) == []  # recomputed, not the old model's KV
        assert worker_side(new).namespace != old_namespace
    finally:
        new.close()


def test_dummy_weights_never_share_blocks_with_real_ones(tmp_path):
    from types import SimpleNamespace

    from kvtier.connectors.vllm.weights import model_weights

    model_dir = tmp_path / "model"
    tiny_model(model_dir)
    cfg = lambda fmt: SimpleNamespace(  # noqa: E731 - what model_weights reads of a VllmConfig
        model_config=SimpleNamespace(model=str(model_dir), revision=None, dtype="float16", quantization=None),
        load_config=SimpleNamespace(load_format=fmt, download_dir=None))
    real, dummy = model_weights(cfg("auto"), "auto"), model_weights(cfg("dummy"), "auto")
    assert real.value and dummy.value and real.value != dummy.value and "dummy" in dummy.source
    assert model_weights(cfg("auto"), "ckpt-2026-11").value == "ckpt-2026-11"
    assert model_weights(cfg("auto"), "off").value == ""
