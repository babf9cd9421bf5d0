#!/usr/bin/env bash
# Set up from scratch (scripts/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${REEF_VENV:-.venv}
# A third-party recipe package, installed the way a user would install one.
"$VENV/bin/python" -m pip install -q tests/fixtures/reef-example-thirdparty
export LITELLM_LOCAL_MODEL_COST_MAP=True
exec "$VENV/bin/python" -m pytest "$@"
