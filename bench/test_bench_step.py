"""step: a whole training step of an MLP (forward, loss, backward, unscale, optimizer
step, scale update), as ``mpgemm train`` runs it: mpgemm (convert +
LossScaleOptimizer(mpgemm.optim.Adam)), eager and replayed as a CUDA graph
(``mpgemm_cuda_graph``, GPU only), against autocast + GradScaler with Adam (foreach,
and fused=True) and FP32 Adam. Work: 6 x batch x (sum of in x out) flops.
On a GPU, ``host_syncs`` counts the synchronising CUDA calls of one step
(``torch.cuda.set_sync_debug_mode``). Every eager implementation reports ``launches``,
the kernels one step launches (``mpgemm.kernels.launches.count_launches``: torch ops
that launch one, and mpgemm's Triton launches), and ``host_us``, the host's
microseconds per step (the calls, unsynchronised) with mpgemm's Triton kernels stubbed
below its launch layer (triton's JIT launch a no-op): for mpgemm, the per-step cost
that no kernel speed can remove. torch's ops are not
stubbed: on a GPU they only queue work, on a CPU they compute as they are called, so
there the baselines' host time includes their arithmetic. On a CPU, too, torch's
optimizers step tensor by tensor (foreach is their GPU default), so their launch
counts there are not a GPU's."""

import time
import warnings

import pytest
import torch
from harness import GPU_SCALE, ON_GPU, SYNC_WARNING
from host_time import triton_stubbed

from mpgemm.app.train import Recipe, TrainConfig, build_mlp
from mpgemm.kernels.launches import count_launches, intercepting

pytestmark = pytest.mark.benchmark(group="step")

# (name, batch, hidden widths); inputs of 784 features, 10 classes.
MODELS = (
    [("guide", 8192, (4096, 4096)), ("small", 128, (128,))]
    + [(f"width4096 batch{b}", b, (4096, 4096)) for b in (256, 1024, 4096, 16384)]
    if GPU_SCALE
    else [("tiny", 32, (64,)), ("tiny batch128", 128, (64, 64))]
)
FEATURES, CLASSES = (784, 10) if GPU_SCALE else (48, 10)
# impl -> (mpgemm train's mode, torch optimizer fused)
IMPLS = {
    "mpgemm": ("mpgemm", False),
    "mpgemm_cuda_graph": ("mpgemm_cuda_graph", False),
    "autocast_foreach": ("autocast", False),
    "autocast_fused": ("autocast", True),
    "fp32": ("fp32", False),
}
# What the targets read (``bench/report.py``; ``MPGEMM_BENCH_TARGETS=1`` runs it
# alone): the guide's and the small MLP's steps (at the CPU's scale the first model),
# eager and graphed, against autocast with fused Adam and FP32.
TARGET_CASES = {"guide", "small"} if GPU_SCALE else {MODELS[0][0]}
TARGET_IMPLS = {"mpgemm", "mpgemm_cuda_graph", "autocast_fused", "fp32"}


def _host_syncs(step) -> int:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def _launches(step) -> int:
    with count_launches() as count:
        step()
    return count.total


def _host_us_stubbed(step, rounds: int = 5) -> float:
    """Host microseconds per step while mpgemm's launches are stubbed out below its own
    launch layer (``host_time.triton_stubbed``: triton's JIT launch is a no-op)."""
    with triton_stubbed():
        step()  # the stubbed path's first call (its own lookups) stays out
        start = time.perf_counter()
        for _ in range(rounds):
            step()
        return (time.perf_counter() - start) / rounds * 1e6


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_training_step(run_case, device, model, impl):
    name, batch, hidden = model
    mode, fused = IMPLS[impl]
    cuda_graph = mode == "mpgemm_cuda_graph"
    if cuda_graph and not ON_GPU:
        pytest.skip("CUDA graphs need a GPU")
    if cuda_graph and intercepting():
        # Compiling ahead (MPGEMM_PRECOMPILE=1): the eager case compiles the same
        # kernels. A capture there once failed (cudaErrorStreamCaptureInvalidated) with
        # triton's compile threads running, and took the later cases with it
        # (bench/results/h100-2026-11-24/run3-*/bench/stage.log).
        pytest.skip("no capture while launches are intercepted")
    config = TrainConfig(hidden=hidden, batch_size=batch, device=str(device))
    torch.manual_seed(0)
    net = build_mlp(FEATURES, hidden, CLASSES).to(device)
    recipe = Recipe(mode, net, config, fused_torch_optimizer=fused)
    x = torch.randn(batch, FEATURES, device=device)
    y = torch.randint(0, CLASSES, (batch,), device=device)
    widths = (FEATURES, *hidden, CLASSES)
    flops = 6 * batch * sum(a * b for a, b in zip(widths, widths[1:], strict=False))
    host_syncs = None
    if ON_GPU:
        for _ in range(5):  # compile, autotune (and capture) before counting syncs
            recipe.step(x, y)
        host_syncs = _host_syncs(lambda: recipe.step(x, y))
    # Counted before the timed rounds: stubbed steps leave the parameters as they were.
    launches = host_us = None
    # Not while launches are recorded (``gpu_check.sh plan``): baselines are skipped
    # there, and would run at a GPU's sizes on the CPU.
    if not cuda_graph and not intercepting():  # a replay is one graph launch
        recipe.step(x, y)  # optimizer state and weight copies exist from here on
        launches = _launches(lambda: recipe.step(x, y))
        host_us = _host_us_stubbed(lambda: recipe.step(x, y))
    run_case(
        lambda: recipe.step(x, y),
        case=name,
        impl=impl,
        flops=flops,
        wall_clock=True,
        batch=batch,
        host_syncs=host_syncs,
        launches=launches,
        host_us=host_us,
    )
