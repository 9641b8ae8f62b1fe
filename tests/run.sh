#!/usr/bin/env bash
# Install everything the tests need into .venv (idempotent), then run them.
#   tests/run.sh            the default suite
#   tests/run.sh --slow     soak, crash-loop and benchmark tests (a separate CI step)
#   tests/run.sh -k dram    extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip

# torch: the CPU build where there is no GPU. A bare "torch" requirement would pull a multi-GB CUDA build.
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q torch
  else
    pip install -q torch==2.13.0 || pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
pip install -q -e '.[test]'
# triton: the kernel tests run the Triton backend in its interpreter on CPU tensors. Optional: where it cannot
# install, those tests skip with a reason and the rest still run. A GPU torch build brings its own triton.
if ! python -c "import triton" 2>/dev/null; then
  pip install -q 'triton==3.9.0' || echo "tests/run.sh: triton did not install; Triton kernel tests will skip" >&2
fi

# vllm: the vLLM connector tests run against the real vLLM 0.33 classes on the CPU. --no-deps with pinned
# requirements keeps pip from replacing the CPU torch with vLLM's CUDA build. Optional like triton: where it
# cannot install, those tests skip with a reason and the rest still run.
if ! python -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"; then
  pip install -q --no-deps 'vllm==0.33.0' -r tests/requirements-vllm.txt \
    || echo "tests/run.sh: vllm did not install; vLLM connector tests will skip" >&2
fi
export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"

if [ "${1:-}" = "--slow" ]; then
  shift
  exec python -m pytest -m slow "$@"
fi
exec python -m pytest "$@"
