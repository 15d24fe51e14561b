#!/usr/bin/env bash
# GPU check (see scripts/gpu_check.py): bf16 tree-packed vs flat training step, a 32k-token path and the
# engine at 1 and 64 clients on one CUDA device, with a random Qwen2-0.5B-shaped policy (nothing downloaded).
# Usage: scripts/gpu_check.sh [--cpu-smoke]   (--cpu-smoke: tiny sizes on CPU, to test the script itself)
# Stops after 10 minutes whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
exec timeout --signal=TERM --kill-after=10 600 "$PYTHON" scripts/gpu_check.py "$@"
