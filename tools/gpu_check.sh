#!/usr/bin/env bash
# The GPU check of issue 17 in one short run (well under 8 minutes) on a bare CUDA machine without network:
#   1. the device machine's own python3 with its preinstalled PyTorch; packages megapipe needs that the image
#      lacks travel as wheels in .whl/ (see the device tool's README) and are installed into /tmp/site;
#   2. the GPU tests (tests/gpu);
#   3. tools/bench_gpu.py: llama3-1b at seq 4096, bf16, the largest micro-batch that fits: tokens/s, MFU, peak
#      memory, and HF transformers' LlamaForCausalLM step on the same GPU and config for the ratio.
# Results: $OUT/gpu_check.json (OUT defaults to ./gpu_check_out). Without CUDA it runs the CPU-side part of
# each stage, says where it stopped, and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check: installing the carried wheels failed"; exit 1; }
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
"$PY" - <<'PY' || exit 1
import torch, transformers
print(f"gpu_check: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"CUDA {'available: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'not available'}")
PY
"$PY" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/tests_gpu.log"
tests_rc=${PIPESTATUS[0]}
"$PY" tools/bench_gpu.py --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/bench_gpu.log"
bench_rc=${PIPESTATUS[0]}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device here: the GPU tests were skipped and the measurements stopped before the GPU part"
fi
exit $(( tests_rc != 0 || bench_rc != 0 ))
