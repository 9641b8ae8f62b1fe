"""The connector's vLLM version shim (connectors/vllm/compat.py): which versions it accepts, and that an
unsupported vLLM stops the engine at start-up (vLLM's own connector factory loading the connector) with a
message naming the version found and the supported ones."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tests/run.sh installs it)")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from kvtier.connectors.vllm import compat  # noqa: E402


@pytest.mark.parametrize("text,expected", [("0.32.0", (0, 32)), ("0.33.0", (0, 33)), ("0.33.1", (0, 33)),
                                           ("0.33.2.dev14+g1a2b3c.cpu", (0, 33)), ("0.32.0+cpu", (0, 32)),
                                           ("0.34.0", (0, 34))])
def test_supported_versions_parse(text, expected):
    assert compat.check_version(text) == expected


@pytest.mark.parametrize("text", ["0.31.2", "0.35.0", "1.0.0", "0.9"])
def test_unsupported_version_names_found_and_supported(text):
    with pytest.raises(compat.UnsupportedVllmVersion) as e:
        compat.check_version(text)
    assert f"this is vLLM {text}" in str(e.value)
    assert "0.32, 0.33, 0.34" in str(e.value)


def test_garbage_version_is_a_clear_error():
    with pytest.raises(compat.UnsupportedVllmVersion, match="cannot read vLLM's version 'banana'"):
        compat.check_version("banana")


def test_installed_vllm_is_supported():
    import vllm

    assert compat.VLLM_VERSION == compat.check_version(vllm.__version__)


def test_planner_matches_the_installed_version(tmp_path):
    """The harness's KV cache planning goes through the shim: one config per worker, with the blocks asked."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm_engine import tiny_model, vllm_config

    config = vllm_config(tiny_model(tmp_path / "m"), {})
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(3)}
    config.cache_config.num_gpu_blocks_override = 40
    configs = compat.plan_kv_cache_configs(config, [specs, specs], [spec.page_size_bytes * 3 * 40] * 2)
    assert [c.num_blocks for c in configs] == [40, 40]
    assert configs[0].kv_cache_groups[0].layer_names == list(specs)


def test_unsupported_vllm_fails_engine_start_up():
    """vLLM's factory resolving the connector (what the engine core does at start-up) raises the shim's error
    when the installed vLLM says it is 0.31 (its version string patched in a fresh interpreter)."""
    code = textwrap.dedent("""
        import vllm
        vllm.__version__ = "0.31.1"
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        cfg = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.connectors.vllm",
                               kv_role="kv_both")
        try:
            KVConnectorFactory.get_connector_class(cfg)
        except Exception as e:
            print(type(e).__name__, "|", e)
        else:
            print("loaded")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    assert last.startswith("UnsupportedVllmVersion |"), last
    assert "this is vLLM 0.31.1" in last and "0.32, 0.33, 0.34" in last


def test_connector_refuses_sleep_mode():
    from kvtier.connectors.vllm.connector import KVTierConnector

    assert KVTierConnector.supports_sleep_mode(None) is False


# ---- the fields the connector reads of vLLM's objects, read off the real classes (issue 16) --------------------


def test_engine_ranks_read_a_real_parallel_config():
    from vllm.config import ParallelConfig

    p = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=1, prefill_context_parallel_size=2,
                       data_parallel_size=3, data_parallel_rank=2)
    ranks = compat.engine_ranks(p)
    assert ranks == compat.EngineRanks(tp_size=2, pp_size=1, pcp_size=2, dp_rank=2, dp_size=3, rank=0)
    assert ranks.world_size == 4  # tp x pp x pcp: the workers of one data-parallel engine


def test_request_fields_read_a_real_request():
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus
    from vllm_engine import make_request

    req = make_request("r", [1] * 32)
    assert (compat.request_transfer_params(req), compat.request_session_id(req), compat.request_stop_reason(req)) \
        == (None, None, None)
    req = make_request("r", [1] * 32, kvtier={"ttl_s": 5})
    req.session_id, req.stop_reason, req.status = "s-1", 128008, RequestStatus.FINISHED_STOPPED
    assert compat.request_transfer_params(req) == {"kvtier": {"ttl_s": 5}}
    assert (compat.request_session_id(req), compat.request_stop_reason(req)) == ("s-1", 128008)
    assert req.get_finished_reason() == FinishReason.STOP


@pytest.mark.parametrize("written,name", [("auto", "auto"), ("DUMMY", "dummy"), ("safetensors", "safetensors")])
def test_load_format_name_reads_a_real_load_config(written, name):
    from vllm.config import LoadConfig

    assert compat.load_format_name(LoadConfig(load_format=written)) == name


def test_connector_modules_read_vllm_objects_only_through_compat():
    """No getattr default on a vLLM object left in the connector modules: compat.py declares each field."""
    import re
    from pathlib import Path

    root = Path(compat.__file__).parent
    found = {p.name: re.findall(r"getattr\((?:request|parallel|load|model|vllm_config)\b[^)]*\)", p.read_text())
             for p in root.glob("*.py") if p.name != "compat.py"}
    assert not {k: v for k, v in found.items() if v}
