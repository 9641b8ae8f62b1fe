"""Per-process paths: each engine process (a vLLM worker, an SGLang scheduler rank) owns its store, so a path
the store opens as its own gets a subdirectory naming the process's model and rank.

Two of the store's paths must never be shared by two processes: ``ssd_path`` (the SSD tier locks its
directory; a second rank would fail with DirectoryInUse) and ``dram_shm_path`` (the DRAM tier maps the file
as its private slots; two ranks would overwrite each other's blocks). A connector therefore opens

    <ssd_path>/<model dir>/<rank dir>/        e.g. /nvme/kvtier/Llama-3.1-8B-5d41402a/tp1of4/
    <dram_shm_path>/<model dir>/<rank dir>    e.g. /dev/shm/kvtier/Llama-3.1-8B-5d41402a/tp1of4

The names are stable across restarts (no process id, no engine id), so a restarted server finds each rank's
SSD blocks again. ``<model dir>``: the model's last path component and a short hash of the whole name and
revision (``model_dir``); ``<rank dir>`` is the connector's (vllm/paths.py, sglang/identity.py). Two servers
of one model on one host need different ``ssd_path``s (their ranks would have the same names).

Pure functions; no engine import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

from kvtier.config import Config, ConfigError

PER_WORKER_KEYS = ("ssd_path", "dram_shm_path")  # store keys naming something one process owns


def model_dir(model: str, revision: str | None = None) -> str:
    """A readable, filesystem-safe, collision-free directory name for a model (and revision)."""
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", model.rstrip("/").rsplit("/", 1)[-1]).strip("-.")[:48] or "model"
    digest = hashlib.sha256(f"{model}\x1f{revision or ''}".encode()).hexdigest()[:8]
    return f"{tail}-{digest}"


def per_worker(config: Config, model: str, rank: str) -> Config:
    """``config`` with every path of PER_WORKER_KEYS that is set moved to ``<path>/<model>/<rank>``.
    ConfigError if such a path is an existing file (the store's own mode takes ``dram_shm_path`` as a file)."""
    for key in PER_WORKER_KEYS:
        path = getattr(config, key)
        if path and Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"{key} {path} is a file, but the engine connector makes it a directory holding one "
                              f"{'file' if key == 'dram_shm_path' else 'directory'} per worker (<model>/<rank>): "
                              "remove the file or name another path")
    moved = {key: str(Path(getattr(config, key)) / model / rank) for key in PER_WORKER_KEYS if getattr(config, key)}
    return dataclasses.replace(config, **moved) if moved else config
