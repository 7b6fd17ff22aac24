#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): one CUDA GPU, under 8 minutes; the figures print and go to ${OUT:-.}/gpu_check.json.
#   bash bench/gpu_check.sh                # the README marks each of its figures as measured on a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here: run python bench/gpu_check.py --tiny on CPU'"
timeout 470 python bench/gpu_check.py --out "${OUT:-.}/gpu_check.json" "$@"
