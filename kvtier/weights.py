"""A cheap fingerprint of a model checkpoint, folded into the key namespace, so a checkpoint changed in place
(new weights under the same model name or path) never finds the KV blocks of the old one in the SSD tier or a
pool: the KV a model computes depends on its weights, and a block key only on the tokens.

What it reads, without reading any weight:

* a local directory (``--model /models/x``): the bytes of ``config.json`` (every ``*.json`` at the top, which
  covers quantization and generation configs) and, for every weight file (``*.safetensors``, ``*.bin``,
  ``*.pt``, ``*.pth``, ``*.gguf``, ``*.npz``, ``*.msgpack``, at the top or one directory down), its name, size
  and mtime. A file written again (new weights) changes its mtime even when its size stays; a copy of the same
  files elsewhere changes mtimes too, which costs a cold cache, never a stale hit. A file that is a symlink
  (the Hugging Face cache's snapshots) contributes the name of its target instead of its mtime: the hub names
  blobs by their content hash, so an updated hub model changes the fingerprint and a re-download does not;
* a single file (a ``.gguf``): its name, size and mtime;
* a hub id (``meta-llama/Llama-3.1-8B``) that is in the local Hugging Face cache: the snapshot directory the
  revision resolves to (named by the commit), read as a local directory. Not in the cache (or no
  ``huggingface_hub``), or a remote URL (s3://): nothing can be read, ``value`` is "" and ``source`` says why;
  callers then key by name and revision only (and should say so: a checkpoint replaced under that name then
  gives stale hits);
* ``load_format="dummy"`` (random weights, for benchmarks): the fingerprint says "dummy", so blocks of a dummy
  run are never served to a run with real weights, nor the other way round.

``extra`` folds in what changes the KV computed from the same files (the dtype, a quantization chosen at load
time). The value is 16 hex digits, reproducible across processes and restarts (no clock, no pid). Pure
function of the file system; a few stat calls per weight file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")


@dataclass(frozen=True)
class WeightsFingerprint:
    """``value``: 16 hex digits, or "" when nothing could be read; ``source``: what it was computed from."""

    value: str
    source: str


def fingerprint_weights(model: str, *, revision: str | None = None, load_format: str = "auto",
                        download_dir: str | None = None, extra: Mapping[str, str] | None = None) -> WeightsFingerprint:
    """The fingerprint of the checkpoint vLLM (or SGLang) loads as ``model`` (see the module docstring)."""
    h = hashlib.sha256()
    for k, v in sorted((extra or {}).items()):
        h.update(f"extra {k}={v}\n".encode())
    path, via = _resolve(model, revision, download_dir)
    if load_format == "dummy":
        h.update(b"dummy weights\n")
        if path is not None:
            _configs(path, h)
        return WeightsFingerprint(h.hexdigest()[:16], "dummy weights (load_format=dummy)")
    if path is None:
        return WeightsFingerprint("", via)
    if path.is_file():
        _stat_into(h, path, path.name)
        return WeightsFingerprint(h.hexdigest()[:16], f"{via}: {path.name} (name, size, mtime)")
    n_configs = _configs(path, h)
    files = _weight_files(path)
    for f in files:
        _stat_into(h, f, f.relative_to(path).as_posix())
    if not files and not n_configs:
        return WeightsFingerprint("", f"{via}: {path} holds no config and no weight files")
    return WeightsFingerprint(h.hexdigest()[:16], f"{via}: {n_configs} config files, {len(files)} weight files "
                                                  "(names, sizes, mtimes)")


def _resolve(model: str, revision: str | None, download_dir: str | None) -> tuple[Path | None, str]:
    """(the local path of the checkpoint, how it was found) or (None, why not)."""
    if "://" in model:
        return None, f"{model} is remote: its files cannot be fingerprinted here"
    p = Path(model).expanduser()
    if p.exists():
        return p, f"local {'file' if p.is_file() else 'directory'} {p}"
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None, f"{model} is not a local path and huggingface_hub is not installed"
    try:
        snap = snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception as e:  # the hub library raises types of its own (not cached, not a valid id, offline)
        return None, f"{model} is not a local path and not in the Hugging Face cache ({type(e).__name__})"
    return Path(snap), f"hub cache snapshot {Path(snap).name} of {model}"


def _configs(path: Path, h: hashlib._Hash) -> int:
    """Fold every top-level *.json of a directory in (their bytes); how many."""
    if not path.is_dir():
        return 0
    n = 0
    for f in sorted(path.glob("*.json")):
        if f.is_file() and not f.name.startswith("tokenizer"):  # tokenizers change token ids, hence keys anyway
            try:
                h.update(f"config {f.name}\n".encode())
                h.update(f.read_bytes())
                n += 1
            except OSError:
                continue
    return n


def _weight_files(path: Path) -> list[Path]:
    out = [f for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES]
    for sub in path.iterdir():
        if sub.is_dir() and not sub.name.startswith("."):
            out += [f for f in sub.iterdir() if f.suffix in WEIGHT_SUFFIXES]
    return sorted(out)


def _stat_into(h: hashlib._Hash, f: Path, name: str) -> None:
    try:
        st = f.stat()
    except OSError:
        h.update(f"missing {name}\n".encode())
        return
    if f.is_symlink():  # a hub cache blob: named by its content hash, which says more than its mtime
        h.update(json.dumps([name, st.st_size, os.path.basename(os.readlink(f))]).encode() + b"\n")
    else:
        h.update(json.dumps([name, st.st_size, st.st_mtime_ns]).encode() + b"\n")


__all__ = ["WEIGHT_SUFFIXES", "WeightsFingerprint", "fingerprint_weights"]
