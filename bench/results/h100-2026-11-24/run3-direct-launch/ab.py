"""A/B in one process: launches through triton's JIT (as at d0d5208) against the launch
layer's direct launcher calls (the working tree), alternating, 4 rounds. Host us to
enqueue one call (300 queued calls for the GEMM, medians) and, for steps, the host
enqueue and wall ms of a synchronised call (profile_gpu._times, medians of 20)."""

import json
import sys
import time

import torch

sys.path.insert(0, "bench")
import profile_gpu as pg  # noqa: E402

import mpgemm  # noqa: E402
from mpgemm.kernels import launches  # noqa: E402

new_run = launches._run


def old_run(jit, grid, args, kwargs, kind):
    jit[grid](*args, **kwargs)


def queued_us(fn, calls=300):
    for _ in range(20):
        fn()
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(runs)[2]


a = torch.randn(512, 512, device="cuda").half()
b = torch.randn(512, 512, device="cuda").half()
cases = {
    "small mpgemm": pg.step_case("mpgemm", 128, (128,), False),
    "guide mpgemm": pg.step_case("mpgemm", 8192, (4096, 4096), False),
    "unscale 200": pg._unscale(),
    "matmul 4096": pg._matmul(4096),
}
rows = []
for rnd in range(4):
    for name, run in (("jit", old_run), ("direct", new_run)):
        launches._run = run
        row = {
            "round": rnd,
            "path": name,
            "matmul 512 queued us": queued_us(lambda: mpgemm.matmul(a, b)),
        }
        for case, fn in cases.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            host, wall = pg._times(fn)
            row[f"{case} host ms"] = host
            row[f"{case} wall ms"] = wall
        rows.append(row)
        print(json.dumps(row), flush=True)
launches._run = new_run
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
keys = [k for k in rows[0] if k not in ("round", "path")]
print(f"{'case':28s} {'jit (min of rounds)':>20s} {'direct':>10s}")
for k in keys:
    j = min(r[k] for r in rows if r["path"] == "jit")
    d = min(r[k] for r in rows if r["path"] == "direct")
    print(f"{k:28s} {j:20.3f} {d:10.3f}  {d / j:.2f}x")
print("binaries cached:", len(launches._binaries))
