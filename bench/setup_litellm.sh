#!/usr/bin/env bash
# Install the LiteLLM proxy into its own venv (bench/.venv-litellm), never into the project's .venv:
# LiteLLM pins many packages (pydantic, httpx, openai...) that must not leak into Reef's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x bench/.venv-litellm/bin/litellm ]; then
  python3 -m venv bench/.venv-litellm
  bench/.venv-litellm/bin/pip install --quiet --upgrade pip
  bench/.venv-litellm/bin/pip install --quiet 'litellm[proxy]'
fi
LITELLM_LOCAL_MODEL_COST_MAP=True bench/.venv-litellm/bin/python -c "import litellm, importlib.metadata as m; print('litellm', m.version('litellm'))"
