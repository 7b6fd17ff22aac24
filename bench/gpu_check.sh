#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py, then vLLM's where installed): one CUDA GPU, under 8 + 8.5 minutes; the figures print and go to ${OUT:-.}/gpu_check.json.
#   bash bench/gpu_check.sh                # the README marks each of its figures as measured on a GPU
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here: run python bench/gpu_check.py --tiny on CPU'"
timeout 470 python bench/gpu_check.py --out "${OUT:-.}/gpu_check.json" "$@"
# vLLM as the sampler (vllm_engine.py), where this python has vLLM (the GPU build: pip install vllm==0.32.*): its
# tokens/s against rollout.generate and HF generate on the 0.5B shape in bf16, and its sampler-trainer gap in bf16.
if python -c "import vllm" 2>/dev/null; then
  timeout 200 python bench/rollout_bench.py --engine vllm --preset 0.5b --device cuda --dtype bfloat16 --repeats 3
  timeout 150 python mismatch.py --engine vllm --device cuda --variations baseline sampler_bf16 both_bf16 \
    --json "${OUT:-.}/mismatch_vllm.json"
  # the trainer with the engine asleep between rollouts (sleep mode) and a bf16 engine beside bf16 autocast
  timeout 150 python trainer.py --rollout-engine vllm --rollout-dtype bfloat16 --dtype bfloat16 --device cuda \
    --rollout-is token --steps 4 --eval-every 2 --out-dir "${OUT:-.}/vllm_run" --overwrite
else
  echo "vLLM is not installed in this python: its GPU figures are skipped (pip install vllm==0.32.*)"
fi

