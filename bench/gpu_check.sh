#!/usr/bin/env bash
# GPU checks of the packed-block copy kernels, in one go, for a machine with an NVIDIA GPU (made for the
# nvidia-h200 device machine: its python3 holds CUDA torch, triton, pytest, hypothesis, numpy and xxhash, and
# nothing can be downloaded there, so kvtier installs offline with no dependencies).
#
#   bench/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu-check-out)
#
# 1. installs this checkout (editable, offline, no deps) and builds native/cuda with nvcc for this GPU;
# 2. runs the kernel tests on the GPU: every engine layout through the cuda, triton and torch backends, packed
#    rows in device memory, pinned host memory (the kernel writes them directly), pageable host memory and
#    DRAM-tier style address tables (staged), hypothesis properties;
# 3. runs `kvtier bench kernels` for the vLLM 0.33 and SGLang layouts: GPU rows beside one contiguous copy_
#    (d2d, d2h, h2d), the cuda backend's direct and staged host paths, and the CPU rows.
# Output goes to the terminal and to OUT_DIR (log.txt, bench-*.json). About 3-5 minutes on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-check-out}}
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
nvcc --version | tail -n 2 || true
"$PY" -c 'import sys, torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA GPU: nothing to check here")'

echo "== install kvtier (editable, offline, no dependencies) and build the CUDA kernels"
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
"$PY" -m kvtier.kernels.native_build

echo "== kernel tests on the GPU"
"$PY" -m pytest -q -p no:cacheprovider -o addopts="" -ra tests/test_kernels_copy.py tests/test_kernels_map.py \
  tests/test_kernels_build.py || echo "!! kernel tests FAILED (see above)"

echo "== benchmarks"
for engine in vllm sglang; do
  "$PY" -m kvtier bench kernels --engine "$engine" --block-sizes 16,64 --total 256MiB --gpu-total 2GiB \
    --rounds 5 --threads 4 --json "$out/bench-$engine.json" || echo "!! bench --engine $engine FAILED"
done
echo "== done: $out"
