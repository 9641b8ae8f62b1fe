"""The weights fingerprint of the checkpoint a vLLM server loads (kvtier/weights.py), for the workers' namespace.

``weights_fingerprint`` in kv_connector_extra_config: ``auto`` (the default) reads the checkpoint's files as
kvtier.weights describes; ``off`` leaves the weights out of the namespace (blocks stored before this version of
kvtier stay reachable; a checkpoint replaced under the same name then gives stale hits); any other string is the
fingerprint itself (an id of the checkpoint the operator controls, e.g. a git commit: routers can then build
the namespace without the files). Runs once per worker at start-up; a few stat calls.
"""

from __future__ import annotations

from typing import Any

from kvtier.weights import WeightsFingerprint, fingerprint_weights

from .compat import load_format_name


def model_weights(vllm_config: Any, setting: str) -> WeightsFingerprint:
    """The fingerprint for ``vllm_config``'s model (VllmConfig: model_config, load_config)."""
    if setting == "off":
        return WeightsFingerprint("", "weights_fingerprint off")
    if setting != "auto":
        return WeightsFingerprint(setting, "weights_fingerprint from kv_connector_extra_config")
    model, load = vllm_config.model_config, vllm_config.load_config
    load_format = load_format_name(load)
    # What changes the KV computed from the same files: the compute dtype, a quantization chosen at load.
    extra = {"dtype": str(model.dtype), "quantization": str(model.quantization or "")}
    return fingerprint_weights(str(model.model), revision=model.revision, load_format=load_format,
                               download_dir=load.download_dir, extra=extra)
