#!/usr/bin/env bash
# GPU checks in one short run (< 5 min on one GPU): the gpu-marked tests, then
# kvblock's load into HBM vs a raw kvikio pread of the same bytes.
# Usage (on a machine with CUDA): bash perf/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, torch.version.cuda)"
# kvikio's wheel for torch's CUDA major (kvikio-cu12 or kvikio-cu13)
CU=$("$PY" -c "import torch; print(torch.version.cuda.split('.')[0])")
"$PY" -c "import kvikio" 2>/dev/null || "$PY" -m pip install -q "kvikio-cu$CU" || true
"$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider
"$PY" perf/gpu_bandwidth.py "$@"
