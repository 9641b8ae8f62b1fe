"""The GPU kernels compile without a GPU, so a broken kernel fails CI: the CUDA library with nvcc (and loads
through ctypes), the Triton kernel for NVIDIA (sm_90) and AMD (gfx942) targets.

Running them needs a GPU: tests/test_kernels_copy.py runs every layout through the cuda and triton backends
there (bench/gpu_check.sh).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from kvtier.kernels import native_build
from kvtier.kernels import cuda

needs_nvcc = pytest.mark.skipif(native_build.find_nvcc() is None, reason="nvcc is not installed here")


@pytest.mark.slow  # a compiler build
@needs_nvcc
def test_nvcc_builds_the_kernels_and_ctypes_loads_them(tmp_path):
    path = native_build.build_cuda_library(out_dir=tmp_path)  # the default architectures: what CI ships
    assert path.parent == tmp_path and path.name.startswith(native_build.LIBRARY)
    lib = cuda.load(path)
    assert lib.kvtier_cuda_abi_version() == 1
    sms = lib.kvtier_cuda_sm_count()
    if torch.cuda.is_available():
        assert sms > 0
    else:  # the runtime reports "no driver/device" as an error code, never a crash
        assert sms < 0 and cuda.error_string(lib, -sms).startswith(f"CUDA error {-sms}: ")
    # Cached: the same sources, flags and compiler reuse the library without running nvcc again.
    mtime = path.stat().st_mtime_ns
    assert native_build.build_cuda_library(out_dir=tmp_path) == path and path.stat().st_mtime_ns == mtime
    assert [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@needs_nvcc
def test_a_broken_kernel_fails_the_build_with_nvccs_message(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "packcopy.cu").write_text("extern \"C\" int broken( { return 0; }\n")
    monkeypatch.setattr(native_build, "source_dir", lambda: src)
    with pytest.raises(native_build.BuildError, match=r"nvcc failed \(exit \d+\)[\s\S]*error"):
        native_build.build_cuda_library(["90"], out_dir=tmp_path / "out")
    assert not any((tmp_path / "out").iterdir())  # no half-written library left behind


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "find_nvcc", lambda: None)
    with pytest.raises(native_build.BuildError, match="nvcc not found"):
        native_build.build_cuda_library(out_dir=tmp_path)


def test_architectures_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_CUDA_ARCH", "8.0; 90,100")
    assert native_build.target_archs() == ["80", "90", "100"]
    monkeypatch.delenv("KVTIER_CUDA_ARCH")
    if not torch.cuda.is_available():
        assert native_build.target_archs() == list(native_build.DEFAULT_ARCHS)


# Compiled in a fresh interpreter: the test process runs Triton in interpreter mode (TRITON_INTERPRET=1),
# where kernels are not compiled at all.
_COMPILE = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvtier.kernels import triton_copy as T
sig = {"frags": "*i64", "ids": "*i64", "rows": "*i64", "nfrags": "i64", "nblocks": "i64",
       "SCATTER": "constexpr", "ELEM": "constexpr", "W": "constexpr", "BLOCK": "constexpr"}
for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
    for scatter, width in ((False, 8), (True, 2)):
        src = ASTSource(fn=T._copy_fragments, signature=sig,
                        constexprs={"SCATTER": scatter, "ELEM": T._ELEM[width], "W": width, "BLOCK": T._BLOCK})
        kernel = triton.compile(src, target=target)
        print(target.backend, scatter, width, sorted(kernel.asm))
"""


@pytest.mark.slow  # a compiler build
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")
def test_triton_kernel_compiles_for_nvidia_and_amd():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 4
    assert all("cubin" in x for x in lines if x.startswith("cuda")), lines
    assert all("hsaco" in x for x in lines if x.startswith("hip")), lines


def test_a_hung_nvcc_is_killed_with_a_clear_error(tmp_path, monkeypatch):
    nvcc = tmp_path / "nvcc"  # answers --version like nvcc, then hangs on the build
    nvcc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'Cuda compilation tools, release 0.0'; exit 0; }\n"
                    "exec sleep 30\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(native_build, "NVCC_TIMEOUT_S", 0.5)
    with pytest.raises(native_build.BuildError, match=r"nvcc did not finish building .* within 0 s \(killed\)"):
        native_build.build_cuda_library(["90"], out_dir=tmp_path / "out", nvcc=str(nvcc))
    assert not any((tmp_path / "out").iterdir())  # no half-written library left behind


@pytest.mark.slow
def test_the_wheel_ships_the_cuda_sources_and_finds_them(tmp_path):
    """A non-editable install must still build its kernels: the .cu files are package data, and source_dir()
    finds them inside the installed package, not in a checkout."""
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(root)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("kvtier-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    assert {f"kvtier/_cuda_src/{name}" for name in native_build.CUDA_SOURCES} <= names
    # The extracted wheel first on the path (as an installed one would be), run from elsewhere.
    probe = "from kvtier.kernels import native_build as n; print(n.source_dir())"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode == 0, r.stderr[-3000:]
    found = Path(r.stdout.strip())
    assert found == tmp_path / "site" / "kvtier" / "_cuda_src"
    assert all((found / name).is_file() for name in native_build.CUDA_SOURCES)
