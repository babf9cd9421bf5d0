#!/usr/bin/env bash
# Set up from scratch and serve the SAO recipe on the embedded CPU model (SmolLM2-135M-Instruct).
# Extra arguments are Hydra overrides, e.g. scripts/demo.sh server.port=8901
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/reef serve +recipe=sao "$@"
