"""Build native/cuda into a shared library with nvcc, on first use, cached per source, flags and compiler.

The CUDA kernels are plain CUDA with extern "C" launchers (no torch extension), so they build wherever nvcc
exists and load with ctypes into any torch build. The library lands in ``$KVTIER_CACHE_DIR`` (default
``~/.cache/kvtier``)/native under a name hashing the sources, the nvcc version and the flags, so a changed
kernel or another GPU gets its own build and concurrent builders never see a half-written file (each
writes a temporary file and renames it). ``python -m kvtier.kernels.native_build [--arch 90]`` builds it ahead of
time (e.g. in a container image).

Architectures: the current GPU's when torch sees one, else ``KVTIER_CUDA_ARCH`` (e.g. "80;90"), else
DEFAULT_ARCHS (what CI compiles). Each gets SASS, and the newest also PTX for GPUs newer than the build.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.resources
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvtier.envvars import ENV_CACHE_DIR, ENV_CUDA_ARCH

log = logging.getLogger(__name__)

CUDA_SOURCES = ("packcopy.cu",)
LIBRARY = "libkvtier_cuda"
DEFAULT_ARCHS = ("80", "90")
NVCC_TIMEOUT_S = 300.0  # a two-architecture build takes well under a minute; a hung nvcc must not hang a worker
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden")


class BuildError(RuntimeError):
    """nvcc is missing, or it failed (the message carries the end of its output)."""


def source_dir() -> Path:
    """The CUDA sources: shipped in the wheel as package data (kvtier._cuda_src), else native/cuda of this
    checkout (source trees, and editable installs made before the sources became package data)."""
    try:
        shipped = importlib.resources.files("kvtier._cuda_src")
        if shipped.is_dir():
            return Path(str(shipped))
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parents[2] / "native" / "cuda"


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("NVCC"), _in_cuda_home(), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "kvtier")
    return Path(root) / "native"


def target_archs() -> list[str]:
    env = os.environ.get(ENV_CUDA_ARCH, "")
    if env.strip():
        return [a.strip().replace(".", "") for a in env.replace(",", ";").split(";") if a.strip()]
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return [f"{major}{minor}"]
    except Exception as e:  # a broken CUDA install must not stop a CPU-only build
        log.debug("no GPU architecture from torch (%s); building for %s", e, DEFAULT_ARCHS)
    return list(DEFAULT_ARCHS)


def build_cuda_library(archs: Sequence[str] | None = None, *, out_dir: Path | None = None,
                       nvcc: str | None = None) -> Path:
    """Compile CUDA_SOURCES into one shared library (reusing a cached build) and return its path."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)")
    sources = [source_dir() / name for name in CUDA_SOURCES]
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise BuildError(f"CUDA sources not found: {', '.join(missing)} (this kvtier install lacks its "
                         "package data; reinstall it, or install from a source checkout)")
    archs = list(archs or target_archs())
    flags = [*NVCC_FLAGS]
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    newest = max(archs, key=int)
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    digest = hashlib.sha256()
    for s in sources:
        digest.update(s.read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(_nvcc_version(nvcc).encode())
    out_dir = out_dir or cache_dir()
    target = out_dir / f"{LIBRARY}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    cmd = [nvcc, *flags, "-o", tmp, *map(str, sources)]
    log.info("building the kvtier CUDA kernels for sm_%s: %s", ",".join(archs), " ".join(cmd))
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BuildError(f"nvcc did not finish building {target.name} within {NVCC_TIMEOUT_S:.0f} s (killed); "
                             "a hung or overloaded compiler? build ahead of time: python -m kvtier.kernels.native_build"
                             ) from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip()[-4000:]
            raise BuildError(f"nvcc failed (exit {proc.returncode}) building {target.name}:\n{tail}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _in_cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return os.path.join(home, "bin", "nvcc") if home else None


def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"cannot run {nvcc} --version: {e}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.kernels.native_build", description=__doc__.split("\n")[0])
    p.add_argument("--arch", action="append", help="GPU architecture, e.g. 90 (repeatable; default: see docs)")
    p.add_argument("--out-dir", type=Path, help=f"where to put the library (default {cache_dir()})")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(build_cuda_library(args.arch, out_dir=args.out_dir))
    except BuildError as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
