#!/usr/bin/env bash
# Everything a lent GPU should do in one call (the device tool runs this in the repo root):
# install, run the test suite on compiled kernels (not the interpreter), then the GEMM
# sweep and the loss-scaling benchmark (unscale GB/s, host syncs per step). Raw output lands in $OUT (or bench/results/ when OUT is unset).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
pip install -q --no-build-isolation --no-deps -e .
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
unset TRITON_INTERPRET
python -m pytest -q 2>&1 | tee "$out/pytest_gpu.txt"
python bench/gemm_sweep.py --out "$out/gemm_sweep.json" 2>&1 | tee "$out/gemm_sweep.txt"
python bench/scaling_bench.py --out "$out/scaling_bench.json" 2>&1 | tee "$out/scaling_bench.txt"
