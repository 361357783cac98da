"""Forward GEMM throughput of mpgemm against cuBLAS, one table per run.

    python bench/gemm_sweep.py [--out results.json]

Rows (M x K x N, FP16 operands, FP16 output):
- squares 1024 to 8192 and the MLP shapes 8192 x 4096 x 4096 and 8192 x 784 x 4096:
  ``mpgemm.matmul`` against ``torch.matmul`` on FP16 tensors (cuBLAS);
- FP32 master weights at the MLP shapes: mpgemm converting the FP32 operand inside the
  kernel, against a cast to FP16 first (``w.half()``, timed) then the FP16 kernel.

On a GPU every timing is the median of ``triton.testing.do_bench`` (CUDA events, warm-up
first, so autotuning and compilation stay out), baseline and mpgemm in the same run.
Without a GPU the same code runs tiny shapes on the CPU so that it cannot rot; those
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import median_ms

import mpgemm
from mpgemm.report import environment

GPU_SQUARES = [1024, 2048, 4096, 8192]
MLP_SHAPES = [(8192, 4096, 4096), (8192, 784, 4096)]


def tflops(m: int, k: int, n: int, ms: float) -> float:
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def measure_shape(m: int, k: int, n: int, device: torch.device) -> dict:
    a = torch.randn(m, k, device=device, dtype=torch.float16)
    b = torch.randn(k, n, device=device, dtype=torch.float16)
    w32 = torch.randn(k, n, device=device)
    timings = {
        "cublas_fp16": median_ms(lambda: torch.matmul(a, b), device),
        "mpgemm_fp16": median_ms(lambda: mpgemm.matmul(a, b), device),
        "mpgemm_fp32_weight_in_kernel": median_ms(lambda: mpgemm.matmul(a, w32), device),
        "mpgemm_fp32_weight_cast_first": median_ms(lambda: mpgemm.matmul(a, w32.half()), device),
    }
    return {
        "shape": [m, k, n],
        "ms": timings,
        "tflops": {name: tflops(m, k, n, ms) for name, ms in timings.items()},
        "ratio_to_cublas": timings["cublas_fp16"] / timings["mpgemm_fp16"],
        "in_kernel_cast_speedup": timings["mpgemm_fp32_weight_cast_first"]
        / timings["mpgemm_fp32_weight_in_kernel"],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the environment and rows as JSON here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        shapes = [(s, s, s) for s in GPU_SQUARES] + MLP_SHAPES
    else:
        shapes = [(64, 48, 32), (33, 130, 7)]
    env = environment(device)
    rows = [measure_shape(m, k, n, device) for m, k, n in shapes]
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(f"{'M x K x N':>18} {'cuBLAS TF/s':>12} {'mpgemm TF/s':>12} {'ratio':>6} "
          f"{'FP32-w in-kernel/cast-first':>28}")
    for row in rows:
        shape = " x ".join(map(str, row["shape"]))
        t = row["tflops"]
        print(f"{shape:>18} {t['cublas_fp16']:>12.1f} {t['mpgemm_fp16']:>12.1f} "
              f"{row['ratio_to_cublas']:>6.2f} {row['in_kernel_cast_speedup']:>28.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
