#!/usr/bin/env bash
# What a lent GPU should do (the device tool runs this in the repo root), in stages that
# fit its 10-minute limit per call:
#   bash bench/gpu_check.sh tests    the test suite on compiled kernels (not the interpreter)
#   bash bench/gpu_check.sh bench    the benchmark suite, its JSON, report and figure
#   bash bench/gpu_check.sh train    the main job on the TensorFlow guide's MLP and on the
#                                    small MLP that mixed precision slows down
# With no argument, all three. Raw output lands in $OUT (or bench/results/ when unset).
set -uo pipefail
out=${OUT:-bench/results}
stages=${*:-tests bench train}
for stage in $stages; do
  case $stage in tests|bench|train) ;;
    *) echo "gpu_check.sh: unknown stage $stage (tests, bench, train)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
pip install -q --no-build-isolation --no-deps -e .
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
for stage in $stages; do
  case $stage in
    tests)
      python -m pytest -q 2>&1 | tee "$out/pytest_gpu.txt" ;;
    bench)
      python -m pytest bench --benchmark-only -q --benchmark-json="$out/bench.json" 2>&1 \
        | tail -30 | tee "$out/bench.txt"
      python bench/report.py "$out/bench.json" --out "$out" 2>&1 | tee "$out/report.txt" ;;
    train)
      mpgemm train --mode all --data synthetic --features 784 --samples 65536 \
        --hidden 4096,4096 --batch-size 8192 --steps 200 --no-progress \
        --out "$out/train_guide_mlp" 2>&1 | tee "$out/train_guide_mlp.txt"
      mpgemm train --mode all --data synthetic --features 784 --samples 60000 --hidden 128 \
        --batch-size 128 --steps 1000 --no-progress \
        --out "$out/train_small_mlp" 2>&1 | tee "$out/train_small_mlp.txt" ;;
  esac
done
