#!/usr/bin/env bash
# The GPU runbook; bench/gpu_check.py says what each stage does and writes.
#   bash bench/gpu_check.sh plan [STAGE ...]        on any machine: compiles, files, time
#   bash bench/gpu_check.sh targets|bench|train|tests   on the GPU, one device call each
#   GPU_CHECK_DRY_RUN=1 OUT=DIR bash bench/gpu_check.sh STAGE   the same on the CPU, toy scale
# On the device machine python3 is the interpreter that holds torch; PYTHON overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" bench/gpu_check.py "$@"
