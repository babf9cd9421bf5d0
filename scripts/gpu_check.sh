#!/usr/bin/env bash
# Time a training step and a weight publish of the embedded engine + trainer on CUDA with a real-size
# random-init model (no download), full weights and LoRA, and print a table.
#
#   bash scripts/gpu_check.sh                    # 0.5b-shaped model on cuda
#   bash scripts/gpu_check.sh --size 1.5b
#   bash scripts/gpu_check.sh --device cpu --size small   # checks the script on a machine without a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [[ " $* " != *" --device cpu "* ]] && ! command -v nvidia-smi >/dev/null; then
  echo "gpu_check: no nvidia-smi on this machine (use --device cpu --size small to check the script)" >&2
  exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec nice -n 0 "$PYTHON" scripts/gpu_check.py "$@"
