"""Loss scaling on a GPU: the fused unscale + inf check against torch's, and host
synchronisations per training step.

    python bench/scaling_bench.py [--out results.json]

1. Unscale + check, in place, of two gradient sets: the parameters of a 4096-wide
   4-layer MLP (FP32) and 100M elements in 200 tensors (FP32 and FP16); also our
   check alone (what a fused optimizer step needs). Reported: time, GB/s (bytes read
   and written), the ratio to ``torch._amp_foreach_non_finite_check_and_unscale_`` on
   the same tensors in the same run, and the fraction of the bandwidth a plain
   device-to-device copy reaches on this GPU in this run.
2. Host synchronisations in one training step of an MLP, counted with
   ``torch.cuda.set_sync_debug_mode("warn")``: torch.amp.GradScaler with Adam (foreach,
   and fused=True) against mpgemm.LossScaleOptimizer and mpgemm.GradScaler with
   mpgemm.optim.Adam.

Without a GPU the same code runs tiny sizes on the CPU so that it cannot rot; those
numbers mean nothing (and there is no sync counter).
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from timing import median_ms

import mpgemm
from mpgemm.report import environment
from mpgemm.scaling import unscale_


def gradient_sets(device: torch.device) -> dict[str, list[torch.Tensor]]:
    if device.type == "cuda":
        width, layers, many, count = 4096, 4, 500_000, 200
    else:
        width, layers, many, count = 64, 4, 5_000, 20
    mlp = []
    for _ in range(layers):
        mlp += [torch.randn(width, width, device=device), torch.randn(width, device=device)]
    sets = {f"mlp_{width}x{layers}_fp32": mlp}
    for dtype, name in ((torch.float32, "fp32"), (torch.float16, "fp16")):
        sets[f"{count}x{many}_{name}"] = [
            torch.randn(many, device=device, dtype=dtype) for _ in range(count)
        ]
    return sets


def measure_unscale(name: str, grads: list[torch.Tensor], device: torch.device) -> dict:
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    found = torch.zeros((), device=device)
    # inv_scale 1.0 keeps the values unchanged however many times the timer repeats.
    inv = torch.ones((), device=device)
    ms = {
        "torch": median_ms(
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv), device
        ),
        "mpgemm": median_ms(lambda: unscale_(grads, found, inv), device),
        "mpgemm_check_only": median_ms(lambda: unscale_(grads, found, None), device),
    }
    moved = {"torch": 2 * nbytes, "mpgemm": 2 * nbytes, "mpgemm_check_only": nbytes}
    return {
        "set": name,
        "tensors": len(grads),
        "elements": sum(g.numel() for g in grads),
        "ms": ms,
        "gb_per_s": {k: moved[k] / (ms[k] * 1e-3) / 1e9 for k in ms},
        "speedup_vs_torch": ms["torch"] / ms["mpgemm"],
    }


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a device-to-device copy (read + write) of 1 GB: the reachable peak."""
    n = 2**28 if device.type == "cuda" else 2**20
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def _training_step_recipes(device: torch.device):
    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
        ).to(device)

    def torch_recipe(fused):
        model = mlp()
        optimizer = torch.optim.Adam(model.parameters(), fused=fused, foreach=not fused)
        scaler = torch.amp.GradScaler(device.type)

        def step(x, y):
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        return step

    def wrapper_recipe():
        model = mpgemm.convert(mlp())
        optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters()))

        def step(x, y):
            optimizer.zero_grad()
            optimizer.scale_loss(torch.nn.functional.cross_entropy(model(x), y)).backward()
            optimizer.step()

        return step

    def scaler_recipe():
        model = mpgemm.convert(mlp())
        optimizer = mpgemm.optim.Adam(model.parameters())
        scaler = mpgemm.GradScaler(device.type)

        def step(x, y):
            optimizer.zero_grad()
            scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            scaler.step(optimizer)
            scaler.update()

        return step

    return {
        "torch GradScaler + Adam(foreach)": lambda: torch_recipe(False),
        "torch GradScaler + Adam(fused=True)": lambda: torch_recipe(True),
        "mpgemm LossScaleOptimizer(mpgemm.optim.Adam)": wrapper_recipe,
        "mpgemm GradScaler + mpgemm.optim.Adam": scaler_recipe,
    }


def count_syncs(device: torch.device) -> dict[str, int]:
    """Synchronising CUDA calls in one training step, after three warm-up steps."""
    if device.type != "cuda":
        return {}
    x = torch.randn(128, 256, device=device)
    y = torch.randint(0, 10, (128,), device=device)
    counts = {}
    for name, make in _training_step_recipes(device).items():
        step = make()
        for _ in range(3):
            step(x, y)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step(x, y)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[name] = sum("synchroniz" in str(w.message) for w in caught)
    return counts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the environment and results as JSON here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)
    peak = copy_bandwidth(device)
    rows = [measure_unscale(name, g, device) for name, g in gradient_sets(device).items()]
    syncs = count_syncs(device)
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(f"device-to-device copy: {peak:.0f} GB/s")
    print(f"{'gradients':>22} {'torch GB/s':>11} {'mpgemm GB/s':>12} {'x torch':>8} "
          f"{'of copy':>8} {'check-only GB/s':>16}")
    for row in rows:
        gb = row["gb_per_s"]
        print(f"{row['set']:>22} {gb['torch']:>11.0f} {gb['mpgemm']:>12.0f} "
              f"{row['speedup_vs_torch']:>8.2f} {gb['mpgemm'] / peak:>8.0%} "
              f"{gb['mpgemm_check_only']:>16.0f}")
    for name, count in syncs.items():
        print(f"host syncs per step: {count:>3}  {name}")
    result = {"environment": env, "copy_gb_per_s": peak, "unscale": rows, "syncs": syncs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
