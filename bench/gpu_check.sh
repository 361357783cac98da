#!/usr/bin/env bash
# Everything a lent GPU should do in one call (the device tool runs this in the repo root):
# install, run the test suite on compiled kernels (not the interpreter), then the
# benchmark suite and its report, and the main job on the TensorFlow guide's MLP and on
# the small MLP that mixed precision slows down. Raw output lands in $OUT (or
# bench/results/ when OUT is unset).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
pip install -q --no-build-isolation --no-deps -e .
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
unset TRITON_INTERPRET
python -m pytest -q 2>&1 | tee "$out/pytest_gpu.txt"
python -m pytest bench --benchmark-only -q --benchmark-json="$out/bench.json" 2>&1 | tail -30 | tee "$out/bench.txt"
python bench/report.py "$out/bench.json" --out "$out" 2>&1 | tee "$out/report.txt"
mpgemm train --mode all --data synthetic --features 784 --samples 65536 --hidden 4096,4096 \
  --batch-size 8192 --steps 200 --no-progress --out "$out/train_guide_mlp" 2>&1 | tee "$out/train_guide_mlp.txt"
mpgemm train --mode all --data synthetic --features 784 --samples 60000 --hidden 128 \
  --batch-size 128 --steps 1000 --no-progress --out "$out/train_small_mlp" 2>&1 | tee "$out/train_small_mlp.txt"
