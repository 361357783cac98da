"""Host us per launch of the 512^2 FP16 TMA GEMM on this CPU, compiled for an H100
through the stand-in driver, the launcher a no-op: triton's JIT launch against the
launch layer's direct one. Alternating, best of 7 rounds of 3000 calls."""

import time

import torch
from triton.compiler.compiler import CompiledKernel

from mpgemm.kernels import gemm_tma, launches
from mpgemm.kernels.aot import _hopper_target
from mpgemm.kernels.launches import intercept, jit_function, launch_options

CompiledKernel._init_handles = lambda self: None
CompiledKernel.run = property(lambda self: lambda *a: None)
a, b = (torch.randn(512, 512, dtype=torch.float16) for _ in range(2))
c = torch.empty(512, 512, dtype=torch.float16)
flags = dict(
    COMPUTE_BF16=False, INTERPRETED=False, HAS_BIAS=False, ACTIVATION=None, STORE_ACT_GRAD=False
)
captured = []
with intercept(lambda k, g, ar, kw, cf: captured.append((k, g, ar, kw))):
    gemm_tma.launch_tma_gemm(
        a, b, c, bias=None, g=None, layout=(False, False), sms=132, flags=flags
    )
kernel, grid, args, kwargs = captured[0]
config = kernel.configs[0]
jit = jit_function(kernel)
opts = launch_options(kernel, args, kwargs, config)
kind = ("cpu", *opts.items())
cases = {
    "JIT[grid]": lambda: jit[grid](*args, **opts),
    "launches._run, cached binary": lambda: launches._run(jit, grid, args, opts, kind),
}
with _hopper_target():
    launches._chosen[launches._kind(kernel, args, kwargs)] = (
        config,
        launches._options(kwargs, config),
    )
    best = {k: float("inf") for k in cases}
    for _ in range(7):
        for name, fn in cases.items():
            for _ in range(100):
                fn()
            t0 = time.perf_counter()
            for _ in range(3000):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / 3000 * 1e6)
for name, us in best.items():
    print(f"{name}: {us:.1f} us")
