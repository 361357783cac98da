"""Intercepted launches (mpgemm.kernels.launches): recorded, not run, with what a GPU
would compile for them; the count of binaries a cold cache needs."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import mpgemm  # noqa: E402
from mpgemm.kernels import gemm, gemm_tma  # noqa: E402
from mpgemm.kernels.launches import (  # noqa: E402
    count_compiles,
    count_launches,
    intercepting,
    record_to,
)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_recorded_launch_runs_nothing_and_says_what_it_compiles(tmp_path):
    path = tmp_path / "launches.jsonl"
    a, b = torch.randn(64, 48), torch.randn(48, 32)
    assert not intercepting()
    with record_to(str(path)):
        assert intercepting() and mpgemm.backend(torch.device("cpu")) == "triton"
        out = mpgemm.matmul(a, b)
    assert not intercepting()
    assert torch.isnan(out).all()  # allocations are NaN-poisoned: no kernel wrote them
    [record] = _records(path)
    assert record["kernel"] == "_gemm_kernel"
    assert record["tune_key"][:3] == [64, 32, 64]  # M, N, K, each to a power of two
    flags = {name: record["specialization"][name] for name in gemm._PRUNE_FLAGS}
    assert flags["ALIGNED"] is True
    # Every config the GPU would tune over for it (8 of them; 1 in the tests stage).
    width = {"N_BUCKET": record["tune_key"][1]}
    assert len(record["tiles"]) == len(gemm._prune_configs(gemm.GPU_CONFIGS, width, **flags))
    assert record["specialization"]["a_ptr"] == ["torch.float32", True]
    assert record["specialization"]["stride_ak"] == "1"


def test_a_ragged_batch_reuses_the_tuned_config(tmp_path):
    path = tmp_path / "launches.jsonl"
    w = torch.randn(32, 48)
    with record_to(str(path)):
        for batch in (128, 96, 65):  # a full batch, a ragged last one, a new size
            mpgemm.linear(torch.randn(batch, 48), w)
    records = _records(path)
    assert len({json.dumps(r["tune_key"]) for r in records}) == 1
    # One key: its configs are compiled and timed once; the other sizes compile only
    # the chosen config again if their specialisation differs (65 is not a multiple
    # of 16, 96 is).
    assert count_compiles(records) == len(records[0]["tiles"]) + 1


def test_a_training_step_records_its_gemms_and_loss_scaling(tmp_path):
    path = tmp_path / "launches.jsonl"
    model = mpgemm.convert(
        torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    )
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters()))
    with record_to(str(path)):
        loss = model(torch.randn(16, 48)).float().sum()
        optimizer.scale_loss(loss).backward()
        optimizer.step()
    kernels = [r["kernel"] for r in _records(path)]
    # 2 forward GEMMs, 3 backward (the first layer's input needs no gradient), Adam
    # (which checks the scaled gradients itself) and the scale update. The head's
    # backward GEMMs read the FP32 logits' gradient: the pointer kernel's; the others
    # the TMA kernel's.
    assert kernels.count("_gemm_tma_kernel") == 3 and kernels.count("_gemm_kernel") == 2
    assert {"_adam_kernel", "_update_scale_kernel"} <= set(kernels)


@pytest.mark.unpoisoned
def test_count_launches_counts_kernels_not_views_or_allocations():
    a = torch.randn(16, 8)
    with count_launches() as count:
        b = torch.empty(8, 16)  # an allocation: none
        a.view(8, 16).t().add_(1.0)  # two views (none), then an add
        flat = a.t().reshape(128)  # a transpose can only be flattened by a copy
        mpgemm.matmul(a.half(), b)  # a cast, then one GEMM launch (stubbed)
    assert count.torch == {"aten.add_": 1, "aten.clone": 1, "aten._to_copy": 1}, count.torch
    assert count.triton == {"_gemm_kernel": 1} and count.total == 4
    assert flat.shape == (128,)


def _step_launches(mode, hidden, batch, device):
    """(launches, what launched) in the third step of ``mpgemm train``'s ``mode``: the
    first two build optimizer state and the 16-bit weight copies."""
    from mpgemm.app.train import Recipe, TrainConfig, build_mlp

    torch.manual_seed(0)
    # (The recipe's device matters to autocast only: "meta" is not one it takes.)
    config = TrainConfig(hidden=hidden, batch_size=batch, device="cpu")
    recipe = Recipe(mode, build_mlp(784, hidden, 10).to(device), config)
    if mode != "mpgemm":
        for group in recipe.optimizer.param_groups:
            group["foreach"] = True  # torch's default on a GPU (elsewhere: a for loop)
    x, y = torch.randn(batch, 784, device=device), torch.randint(0, 10, (batch,), device=device)
    with count_launches() as count:
        for _ in range(2):
            recipe.step(x, y)
    with count_launches() as count:
        recipe.step(x, y)
    return count.total, {**count.triton, **count.torch}


@pytest.mark.unpoisoned
@pytest.mark.parametrize(
    "hidden, batch", [((128,), 128), ((4096, 4096), 8192)], ids=["small MLP", "guide MLP"]
)
def test_a_training_step_launches_no_more_kernels_than_fp32(hidden, batch):
    """Issue 13's target: an mpgemm step (forward, loss, backward, unscale, Adam, scale
    update) launches no more kernels than the FP32 step with torch's foreach Adam, so
    that small models are not lost to launch overhead. mpgemm's kernels are stubbed
    (nothing runs), FP32's ops run on the "meta" device: no arithmetic either way."""
    ours, what = _step_launches("mpgemm", hidden, batch, "cpu")
    fp32, fp32_what = _step_launches("fp32", hidden, batch, "meta")
    assert ours <= fp32, f"mpgemm {ours} launches: {what}; FP32 {fp32}: {fp32_what}"
    # torch's one launch in the step: the input's cast to the compute dtype. Nothing of
    # ours finishes in a torch op: the bias gradient's sum, the step counts and the
    # loss's mean are in the kernels (arrival counters), the loss scaling in autograd's
    # seed; the inf flag is zeroed by the scale update that reads it, for the next step.
    assert {name for name in what if name.startswith("aten.")} == {"aten._to_copy"}
    assert what["_cross_entropy_forward_kernel"] == what["_cross_entropy_backward_kernel"] == 1


@pytest.mark.unpoisoned
@pytest.mark.parametrize("activation", [torch.nn.GELU, torch.nn.SiLU], ids=["gelu", "silu"])
def test_a_stored_preactivation_costs_the_backward_no_zeros(activation):
    """A GELU or SiLU layer's forward also returns z (G, non-differentiable), for act'(z):
    its backward gets no gradient of zeros for it, which autograd would otherwise make
    (an FP32 tensor of the layer's output shape, filled every step). So its step too
    launches no torch op but the input's cast."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), activation(), torch.nn.Linear(128, 10))
    mpgemm.convert(model)
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters()))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step():
        optimizer.zero_grad()
        optimizer.backward(mpgemm.cross_entropy(model(x), y))
        optimizer.step()

    with count_launches():
        step()
        step()
    with count_launches() as count:
        step()
    assert count.torch == {"aten._to_copy": 1}, count.torch


@pytest.mark.unpoisoned
def test_16_bit_parameters_are_rewritten_from_their_masters_in_one_launch():
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4))).half()
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.SGD(model.parameters(), lr=0.1))
    loss = model(torch.randn(8, 32, dtype=torch.float16)).float().sum()
    optimizer.scale_loss(loss).backward()
    with count_launches() as count:
        optimizer.step()
    assert count.torch.get("aten._foreach_copy_") == 1 and "aten.copy_" not in count.torch


def _gemm(key, spec, tiles=range(8)):
    return {
        "kernel": "_gemm_kernel",
        "tune_key": key,
        "tiles": [f"tile {t}" for t in tiles],
        "specialization": spec,
    }


def test_count_compiles():
    plain = {"kernel": "_adam_kernel", "tune_key": None, "tiles": []}
    records = [
        _gemm([1, 2, 3], {"a": "d16"}),
        _gemm([1, 2, 3], {"a": "d16"}),  # the same launch again: nothing new
        _gemm([1, 2, 3], {"a": "i"}),  # same key, new specialisation: the chosen config
        _gemm([4, 2, 3], {"a": "i"}, tiles=(8, 9)),  # a new key: every kept config
        # Another key whose specialisation an earlier key's shares: its configs that
        # the earlier one compiled are the same binaries (tiles 6 and 7), the rest new.
        _gemm([8, 2, 3], {"a": "d16"}, tiles=(6, 7, 10)),
        {**plain, "specialization": {"n": "i"}},
        {**plain, "specialization": {"n": "i"}},
        {**plain, "specialization": {"n": "1"}},
    ]
    assert count_compiles(records) == 8 + 1 + 2 + 1 + 2


def test_precompile_fills_the_compile_cache_from_threads(tmp_path):
    # What the bench and train stages do before their runs (MPGEMM_PRECOMPILE=1), here
    # for an H100 through the stand-in driver the compile check uses: every config the
    # launch would autotune over lands in triton's cache, and nothing runs.
    script = (
        "import torch, mpgemm\n"
        "from mpgemm.kernels.aot import _hopper_target\n"
        "with _hopper_target():\n"
        "    out = mpgemm.matmul(torch.randn(64, 48), torch.randn(48, 32))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MPGEMM_PRECOMPILE="1", TRITON_CACHE_DIR=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    flags = dict(STORE_PREACT=False, K_SUMS=None, RELU_GRAD=False, ALIGNED=True)
    expected = len(gemm._prune_configs(gemm.GPU_CONFIGS, {"N_BUCKET": 32}, **flags))
    assert len(list(tmp_path.rglob("*.cubin"))) == expected


def test_a_recorded_tma_launch_names_its_descriptors_by_dtype(tmp_path):
    path = tmp_path / "launches.jsonl"
    a, b = torch.randn(64, 48).half(), torch.randn(48, 32).half()
    with record_to(str(path)):
        mpgemm.matmul(a, b)
    [record] = _records(path)
    assert record["kernel"] == "_gemm_tma_kernel"
    # A descriptor's block shape is the config's: the binary depends on its dtype.
    assert record["specialization"]["a_desc"] == ["descriptor", "torch.float16"]
    c = torch.empty(64, 32, dtype=torch.float16)
    flags = dict(
        HAS_BIAS=False, ACTIVATION=None, STORE_PREACT=False, RELU_GRAD=False, C_ALIGNED=True
    )
    named = {"c_ptr": c, "N_BUCKET": 32}  # (N is 32)
    kept = gemm_tma._prune_configs(gemm_tma.GPU_CONFIGS, named, **flags)
    assert len(record["tiles"]) == len(kept)


def test_an_autotuner_runs_once_per_launch_kind_then_its_choice_directly(device, monkeypatch):
    """After the autotuner has chosen for a launch kind, launches of the kind run the
    JIT function with its config, sizes in the same buckets of its key included (so the
    kinds kept stay few); a new kind (here a dtype) goes through it again."""
    from triton.runtime.autotuner import Autotuner

    from mpgemm.kernels import launches

    monkeypatch.setattr(launches, "_chosen", {})
    # On a GPU, binaries cached by earlier tests' launches would skip the autotuner.
    monkeypatch.setattr(launches, "_binaries", {})
    runs = []
    tuner_run = Autotuner.run

    def counted(self, *args, **kwargs):
        runs.append(self)
        return tuner_run(self, *args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", counted)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=g).to(device, torch.float16) for s in ((64, 48), (48, 32)))
    first = mpgemm.matmul(a, b)
    assert len(runs) == 1
    again = mpgemm.matmul(a, b)
    assert len(runs) == 1
    assert torch.equal(first, again)
    assert torch.isfinite(again).all()  # written: allocations are NaN-poisoned
    fewer_rows = mpgemm.matmul(a[:60], b)  # M 60 and 64 share their bucket
    assert len(runs) == 1 and len(launches._chosen) == 1
    assert torch.equal(fewer_rows, first[:60])
    mpgemm.matmul(a, b, out_dtype=torch.float32)
    assert len(runs) == 2 and len(launches._chosen) == 2
    # The record a benchmark keeps of them: a kind each, C's dtype telling them apart.
    chosen = launches.chosen_configs()
    assert [c["kernel"] for c in chosen] == [runs[0].fn.__name__] * 2
    assert [str(torch.float32) in c["kind"] for c in chosen] == [False, True]
    assert all(c["config"] == str(runs[0].best_config) for c in chosen)


def _times(x_ptr, y_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, FACTOR * tl.load(x_ptr + offsets, mask=mask), mask=mask)


def test_the_record_of_a_choice_has_every_config_the_autotuner_timed(device, monkeypatch):
    """Where the autotuner times configs for a launch kind, ``chosen_configs`` keeps
    each one's median beside the choice (a failed config's as None); a kind it did not
    time (a constexpr apart, which the autotuner's key leaves out: its own cache
    answered) has no timings, not another kind's."""
    from mpgemm.kernels import launches

    monkeypatch.setattr(launches, "_chosen", {})
    monkeypatch.setattr(launches, "_timed", {})
    medians = iter([0.5, float("inf"), 0.25])

    def bench(kernel_call, quantiles=None, **kwargs):
        kernel_call()
        median = next(medians)
        return [median, median, median]

    configs = [triton.Config({"BLOCK": block}, num_warps=4) for block in (16, 32, 64)]
    kernel = triton.autotune(configs, key=["n"], do_bench=bench)(triton.jit(_times))
    x = torch.arange(100, dtype=torch.float32, device=device)
    y = torch.full_like(x, float("nan"))
    grid = lambda meta: (triton.cdiv(100, meta["BLOCK"]),)  # noqa: E731
    launches.launch(kernel, grid, x, y, 100, FACTOR=2)
    assert torch.equal(y, 2 * x)
    [entry] = launches.chosen_configs()
    assert entry["config"] == str(configs[2])
    assert entry["timings"] == [
        ["BLOCK 16, warps 4, stages 3", 0.5],
        ["BLOCK 32, warps 4, stages 3", None],
        ["BLOCK 64, warps 4, stages 3", 0.25],
    ]
    launches.launch(kernel, grid, x, y, 100, FACTOR=3)
    assert torch.equal(y, 3 * x)
    assert [e.get("timings") is None for e in launches.chosen_configs()] == [False, True]


def _probe(
    x_ptr,
    y_ptr,
    n,
    scale,
    flag,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr = 64,
    NEG: tl.constexpr = False,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    value = tl.load(x_ptr + offsets, mask=mask)
    if flag:
        value = value * scale
    if NEG:
        value = -value
    tl.store(y_ptr + offsets, value + MODE, mask=mask)


def test_the_gemm_launches_hand_the_launcher_what_the_autotuner_would(tmp_path):
    """Each launch ``triton_gemm`` makes (the TMA kernel plain, with a transposed
    weight, bias and ReLU, and beside A's row sums; the pointer kernel on an FP32
    operand, and computing C.T with B.T's column sums; split-K with its reduction, and
    of C.T with the column sums (a head's weight gradient);
    batches of products: the TMA kernel's from a storage offset with B broadcast, the
    pointer kernel's over merged batch dimensions and over two that do not merge, and
    a launch per outer index),
    compiled for an H100 through the stand-in driver with one config per launch:
    ``launch`` hands the launcher what triton's autotuner (or JIT) hands it, through the
    autotuner, the JIT with the chosen config and the cached binary alike (descriptors
    compared by their fields). Then ``triton_gemm``'s replay of each call (split-K's
    two launches included; a launch per outer batch index is not replayed) hands the
    launchers what the cached binaries' launches did, sums A's rows where they did, and
    steps aside while launches are intercepted or the binaries swapped out. In a
    process of its own, as above."""
    # One config each: nothing to time.
    assert _compared_apart("_compare_gemm_launches", tmp_path, MPGEMM_SINGLE_CONFIG="1") == 64


def _stand_in_driver():
    """The compile check's stand-in driver (an H100's target, device 0, stream 0),
    with a benchmarker: triton 3.6's autotuner times even one config when it caches
    its results, and a call and a constant time stand in for the timing."""
    from mpgemm.kernels.aot import _HopperDriver

    class Driver(_HopperDriver):
        def get_benchmarker(self):
            def bench(kernel_call, quantiles=None, **kwargs):
                kernel_call()
                return [1.0] * len(quantiles) if quantiles else 1.0

            return bench

    return Driver()


def _compare_gemm_launches():
    from triton.runtime import driver
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mpgemm.kernels import gemm, launches
    from mpgemm.kernels.gemm import triton_gemm

    calls = _record_launchers()

    def fields(arg):
        if isinstance(arg, TensorDescriptor):
            base = arg.base
            return (base.data_ptr(), base.dtype, arg.shape, arg.strides, arg.block_shape)
        if isinstance(arg, torch.Tensor):
            return id(arg)
        return arg  # by value: an integer above 256 is an object of its own

    def fresh(arg):  # a descriptor as the launch sites make one, before any pre-hook
        if isinstance(arg, TensorDescriptor):
            placeholder = [1, 16, 16] if len(arg.shape) == 3 else [16, 16]
            return TensorDescriptor(arg.base, arg.shape, arg.strides, placeholder)
        return arg

    def role(arg, outputs):
        """A launcher argument of a call that returned ``outputs``: an input by address,
        an output by position, split-K's partials as such, a descriptor by its tensor
        and fields, else the value."""
        if isinstance(arg, TensorDescriptor):
            return (role(arg.base, outputs), arg.shape, arg.strides, arg.block_shape)
        if not isinstance(arg, torch.Tensor):
            return arg
        address = arg.data_ptr()
        made = [i for i, t in enumerate(outputs) if t is not None and t.data_ptr() == address]
        if made:
            where: tuple = ("output", made[0])
        else:
            where = ("input", address) if address in inputs else ("partials",)
        return (*where, arg.dtype, arg.shape, arg.stride())

    # What triton_gemm does besides launching: replays, and A's row sums (torch's).
    relaunched: list[bool] = []
    summed: list[bool] = []
    relaunch, row_sums = gemm._relaunch, gemm._row_sums

    def counted(*args):
        relaunched.append(True)
        relaunch(*args)

    def sum_counted(*args):
        summed.append(True)
        row_sums(*args)

    gemm._relaunch, gemm._row_sums = counted, sum_counted

    g = torch.Generator().manual_seed(0)
    half = torch.float16
    a, b = torch.randn(64, 64, generator=g).to(half), torch.randn(64, 32, generator=g).to(half)
    weight, bias = torch.randn(48, 64, generator=g).to(half), torch.randn(48, generator=g)
    tall = torch.randn(16, 4096, generator=g).to(half), torch.randn(4096, 16, generator=g).to(half)
    a32 = a.float()
    head = torch.randn(10, 4096, generator=g)  # FP32 (the loss's gradient), 10 classes
    features = torch.randn(4096, 64, generator=g).to(half)
    rows = torch.randn(8, 64, generator=g)  # FP32 and 8 rows: C.T = B.T @ A.T
    products = [
        lambda: triton_gemm(a, b, compute_dtype=half, out_dtype=half),
        lambda: triton_gemm(
            a, weight.t(), compute_dtype=half, out_dtype=half, bias=bias, activation="relu"
        ),
        lambda: triton_gemm(a32, b, compute_dtype=half, out_dtype=torch.float32),
        lambda: triton_gemm(*tall, compute_dtype=half, out_dtype=torch.float32),  # split-K
        # A head's weight gradient: split-K of C.T = B.T @ A.T, with A's row sums.
        lambda: triton_gemm(
            head, features, compute_dtype=half, out_dtype=torch.float32, rowsum_a=True
        ),
        # A's row sums beside the TMA kernel, and in the pointer kernel's transpose.
        lambda: triton_gemm(a.t(), b, compute_dtype=half, out_dtype=half, rowsum_a=True),
        lambda: triton_gemm(rows, b.t(), compute_dtype=half, out_dtype=half, rowsum_a=True),
        # Batches of products: the TMA kernel with B broadcast (batch stride 0), the
        # pointer kernel on FP32 batches from a (2, 3) batch that merges into one, over
        # a (3, 2) batch that does not (one launch, OUTER), and over three dimensions
        # that do not merge (a launch per outer index: not replayed).
        lambda: triton_gemm(batch, b.expand(3, 64, 32), compute_dtype=half, out_dtype=half),
        lambda: triton_gemm(grid32, b.expand(2, 3, 64, 32), compute_dtype=half, out_dtype=half),
        lambda: triton_gemm(
            grid32.transpose(0, 1), b.expand(3, 2, 64, 32), compute_dtype=half, out_dtype=half
        ),
        lambda: triton_gemm(
            cube.permute(2, 1, 0, 3, 4),
            b.expand(2, 2, 3, 64, 32),
            compute_dtype=half,
            out_dtype=half,
        ),
    ]
    batch = torch.randn(4, 64, 64, generator=g).to(half)[1:]  # its storage from an offset
    grid32 = torch.randn(2, 3, 64, 64, generator=g)
    cube = torch.randn(3, 2, 2, 64, 64, generator=g)
    inputs = {t.data_ptr() for t in (a, b, weight, bias, *tall, a32, head, features, rows)}
    inputs |= {batch.data_ptr(), grid32.data_ptr(), cube.data_ptr()}
    compared = 0
    driver.set_active(_stand_in_driver())
    for product in products:
        for cached in (False, False, True):  # the autotuner, the JIT, the binary
            captured: list[tuple] = []
            with launches.intercept(lambda *launch_args, to=captured: to.append(launch_args)):
                product()
            for kernel, grid, args, kwargs, _ in captured:
                ours = tuple(map(fresh, args))
                kernel[grid](*args, **kwargs)
                launches.launch(kernel, grid, *ours, **kwargs)
                (their_kernel, theirs), (kernel_run, mine) = calls[-2], calls[-1]
                assert kernel_run is their_kernel  # the same binary
                assert mine[:6] == theirs[:6]  # grid, stream, function, packed metadata
                if cached:  # no launch hooks: no launch metadata
                    assert mine[6:9] == (None, None, None)
                assert list(map(fields, mine[9:])) == list(map(fields, theirs[9:]))
                compared += 1
        # Un-intercepted, the cached binaries' launches, then ``triton_gemm``'s replay of
        # them: the same launcher arguments, each tensor the same input, the same output
        # of its call, or split-K's partials.
        made, sums = [], []
        for _ in range(2):
            before = len(calls)
            summed.clear()
            outputs = product()
            made.append([(kernel, given, outputs) for kernel, given in calls[before:]])
            sums.append(len(summed))
        assert sums[0] == sums[1]
        # Each call replays but the last, a launch per outer index.
        assert len(relaunched) == (product is not products[-1])
        relaunched.clear()
        for (kernel, direct, out), (kernel_run, replayed, out_again) in zip(*made, strict=True):
            assert kernel_run is kernel and replayed[:9] == direct[:9]
            assert [role(x, out) for x in direct[9:]] == [role(x, out_again) for x in replayed[9:]]
            compared += 1
        # A replay is no way around interception.
        captured = []
        with launches.intercept(lambda *launch_args, to=captured: to.append(launch_args)):
            product()
        assert len(captured) == len(made[0]) and relaunched == []
        # Nor around binaries swapped out (``bench/host_time.py``'s stand-ins).
        binaries, launches._binaries = launches._binaries, {}
        before = len(calls)
        product()
        assert relaunched == [] and len(calls) - before == len(made[0])
        launches._binaries = binaries
    print("compared", compared)


def test_a_training_step_launches_the_same_when_its_gemms_replay(tmp_path):
    """A training step (an MLP with bias + ReLU layers, a 10-class head, the loss
    scaling and Adam), compiled for an H100 through the stand-in driver, launchers
    recorded: with ``triton_gemm``'s replays, every GEMM of the step replays, and the
    step hands the launchers what it does with every launch decided anew (each
    launch's binary, grid, stream and arguments: tensors by dtype, shape and strides,
    descriptors by their fields, the rest by value). In a process of its own."""
    assert _compared_apart("_compare_step_launches", tmp_path, MPGEMM_SINGLE_CONFIG="1") > 10


def _compare_step_launches():
    from triton.runtime import driver
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mpgemm import functional
    from mpgemm.app.train import Recipe, TrainConfig, build_mlp
    from mpgemm.kernels import gemm

    calls = _record_launchers()
    driver.set_active(_stand_in_driver())
    functional._intercepting = lambda: True  # CPU tensors take the kernel path
    relaunched: list[None] = []
    relaunch, replayable = gemm._relaunch, gemm.current
    gemm._relaunch = lambda *args: relaunched.append(relaunch(*args))

    def described(arg):
        if isinstance(arg, TensorDescriptor):
            return (arg.base.dtype, arg.shape, arg.strides, arg.block_shape)
        if isinstance(arg, torch.Tensor):
            return (arg.dtype, arg.shape, arg.stride())
        return arg

    def step(replays: bool) -> list[tuple]:
        gemm.current = replayable if replays else (lambda launched: False)
        before = len(calls)
        recipe.step(x, y)
        return [
            (kernel, given[:6], [described(arg) for arg in given[9:]])
            for kernel, given in calls[before:]
        ]

    torch.manual_seed(0)
    hidden = (48, 32)
    recipe = Recipe("mpgemm", build_mlp(64, hidden, 10), TrainConfig(hidden=hidden))
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for _ in range(3):  # the autotuner, the JIT, then the cached binaries
        step(replays=False)
    decided = step(replays=False)
    assert relaunched == []
    replayed = step(replays=True)
    gemms = [kernel for kernel, _ in calls[-len(replayed) :] if "gemm" in kernel.name]
    assert len(relaunched) == len(gemms) > 0
    assert replayed == decided
    print("compared", len(replayed))


def test_dependent_launch_reaches_every_launch_of_a_step_and_leaves_with_it(tmp_path):
    """With programmatic dependent launch enabled (``mpgemm.kernels.dependent_launch``),
    every launch of a training step (its GEMMs replayed, the loss, loss scaling and
    Adam) runs a binary compiled with PDL, which waits for the prior grid before it
    touches memory; the same kernels in the same order as without. Disabled again, no
    launch repeats a PDL binary. Compiled for an H100 through the stand-in driver,
    launchers recorded, in a process of its own."""
    assert _compared_apart("_compare_pdl_step", tmp_path, MPGEMM_SINGLE_CONFIG="1") > 10


def _compare_pdl_step():
    from triton.runtime import driver

    from mpgemm import functional
    from mpgemm.app.train import Recipe, TrainConfig, build_mlp
    from mpgemm.kernels import dependent_launch

    calls = _record_launchers()
    driver.set_active(_stand_in_driver())
    functional._intercepting = lambda: True  # CPU tensors take the kernel path

    def step() -> list:
        before = len(calls)
        recipe.step(x, y)
        return [kernel for kernel, _ in calls[before:]]

    def waits(kernel) -> bool:
        return "griddepcontrol.wait" in kernel.asm["ptx"]

    torch.manual_seed(0)
    hidden = (48, 32)
    recipe = Recipe("mpgemm", build_mlp(64, hidden, 10), TrainConfig(hidden=hidden))
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    # The first step is no reference: with a fresh cache, triton 3.6's autotuner times
    # each new key's one config (as it does when it caches results), a launch more each
    # (an H200, bench/results/h200-2026-11-26/run9-two-failures).
    first = step()
    plain = step()
    assert not any(k.metadata.launch_pdl or waits(k) for k in first + plain)
    dependent_launch.enable(True)
    for _ in range(3):  # the JIT, then the cached binaries and the replays
        dependent = step()
    assert [k.name for k in dependent] == [k.name for k in plain]
    assert all(k.metadata.launch_pdl and waits(k) for k in dependent)
    dependent_launch.enable(False)
    after = step()
    assert [k.name for k in after] == [k.name for k in plain]
    assert not any(k.metadata.launch_pdl for k in after)
    print("compared", len(dependent))


def test_calls_that_differ_in_any_part_of_the_signature_never_share_a_replay(tmp_path):
    """``triton_gemm`` calls of one shape that differ in one thing each (the epilogue,
    A's row sums, the dtypes, an operand's layout or alignment, the output's strides, a
    bias broadcast from one value, a ReLU's output and column sums, the kernel asked
    for), compiled for an H100 through
    the stand-in driver, launchers recorded: called over and over in turn with replays,
    each call hands the launcher what it does when every launch is decided anew. A
    signature that missed what tells two of them apart would replay one's launch for
    the other. In a process of its own."""
    assert _compared_apart("_compare_signatures", tmp_path, MPGEMM_SINGLE_CONFIG="1") == 75


def _compare_signatures():
    from triton.runtime import driver
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mpgemm.kernels import gemm

    calls = _record_launchers()
    driver.set_active(_stand_in_driver())
    replayable = gemm.current
    g = torch.Generator().manual_seed(0)
    half, bf16 = torch.float16, torch.bfloat16
    a, b = torch.randn(64, 64, generator=g).to(half), torch.randn(64, 32, generator=g).to(half)
    bias = torch.randn(32, generator=g)
    shifted = torch.randn(64 * 64 + 1, generator=g).to(half)[1:].view(64, 64)  # 2 bytes off
    wide = torch.randn(64, 96, generator=g).to(half)
    relu_y = torch.randn(64, 32, generator=g).relu().to(half)
    kinds = {
        "plain": dict(),
        "fp32 out": dict(out_dtype=torch.float32),
        "bf16 compute": dict(compute_dtype=bf16),
        "row sums": dict(rowsum_a=True),
        "bias": dict(bias=bias),
        "bias relu": dict(bias=bias, activation="relu"),
        "bias gelu": dict(bias=bias, activation="gelu", store_preact=True),
        "bias gelu, no G": dict(bias=bias, activation="gelu"),
        "silu": dict(activation="silu", store_preact=True),
        "one bias value": dict(bias=bias[:1].expand(32)),
        "more rows": dict(a=torch.randn(80, 64, generator=g).to(half)),
        "longer K": dict(a=wide, b=torch.randn(96, 32, generator=g).to(half)),
        "fp32 a": dict(a=a.float()),
        "fp32 b": dict(b=b.float()),
        # B's and C's strides, not their shapes
        "fewer columns": dict(b=b[:, :16], out=torch.empty(64, 32, dtype=half)[:, :16]),
        "b unaligned": dict(b=torch.randn(64 * 32 + 1, generator=g).to(half)[1:].view(64, 32)),
        "out unaligned": dict(out=torch.empty(64 * 32 + 1, dtype=half)[1:].view(64, 32)),
        "a unaligned": dict(a=shifted),
        "a transposed": dict(a=a.t().contiguous().t()),
        "b transposed": dict(b=b.t().contiguous().t()),
        "strided out": dict(out=torch.empty(64, 48, dtype=half)[:, :32]),
        "pointer kernel": dict(kernel="pointer"),
        # C the gradient at a ReLU's input, from its output y (an input gradient's
        # epilogue), with the ReLU's bias gradient (C's column sums) or without, and y
        # laid out otherwise than C
        "relu grad": dict(relu_output=relu_y),
        "relu grad, column sums": dict(relu_output=relu_y, colsum_c=True),
        "relu grad, y transposed": dict(relu_output=relu_y.t().contiguous().t()),
    }

    def product(kind: str):
        options = {"a": a, "b": b, "compute_dtype": half, "out_dtype": half, **kinds[kind]}
        with gemm.use_kernel(options.pop("kernel", "auto")):
            return gemm.triton_gemm(options.pop("a"), options.pop("b"), **options)

    def described(arg):
        if isinstance(arg, TensorDescriptor):
            return (arg.base.data_ptr(), arg.shape, arg.strides, arg.block_shape)
        if isinstance(arg, torch.Tensor):  # outputs are new each call
            return (arg.dtype, arg.shape, arg.stride(), arg.data_ptr() & 15)
        return arg

    def launched(kind: str) -> list[tuple]:
        before = len(calls)
        product(kind)
        return [(k, given[:6], [described(x) for x in given[9:]]) for k, given in calls[before:]]

    gemm.current = lambda replay: False
    for _ in range(3):  # the autotuner, the JIT, then the cached binaries
        for kind in kinds:
            launched(kind)
    decided = {kind: launched(kind) for kind in kinds}
    gemm.current = replayable
    gemm._replays.clear()
    relaunched: list[None] = []
    relaunch = gemm._relaunch
    gemm._relaunch = lambda *args: relaunched.append(relaunch(*args))
    compared = 0
    for _ in range(3):
        for kind in kinds:
            assert launched(kind) == decided[kind], kind
            compared += 1
    assert len(relaunched) == 2 * len(kinds)  # each kind replays from its second call
    print("compared", compared)


def _desc_probe(in_desc, y_ptr, n, BLOCK: tl.constexpr):
    tile = in_desc.load([0, 0])
    offsets = tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(y_ptr + offsets, tile, mask=offsets < n)


def _tile_sum_probe(in_desc, y_ptr):
    # The descriptor's block shape alone sizes the tile: no constexpr says it.
    tl.store(y_ptr, tl.sum(tl.sum(in_desc.load([0, 0]), axis=1), axis=0))


def _set_probe_block(nargs):
    nargs["in_desc"].block_shape = [nargs["BLOCK"], nargs["BLOCK"]]


def test_a_launch_hands_the_launcher_what_the_jit_would(tmp_path):
    """``launch`` on a compiled JIT function (for an H100 through the compile check's
    stand-in driver, the launcher recorded instead of run) calls the binary the JIT
    chooses with the JIT's grid, stream and arguments, for each specialisation
    (alignment, an integer 1, a multiple of 16 or neither, positional constexprs, a
    descriptor's block shape), met first or again after others, and an autotuned
    kernel's whose config pre-hook sets a descriptor's block shape (a JIT function with
    a pre-run hook goes through the JIT every time); without launch hooks it skips the
    launch metadata, and with one it passes what the JIT passes. In a process of its
    own: triton's interpreter leaves the language patched after a launch, which breaks
    compiling."""
    assert _compared_apart("_compare_launchers", tmp_path) == 22


def _compared_apart(comparison: str, cache_dir, **env: str) -> int:
    """Run ``comparison`` (a function of this module) in a process of its own, compiled
    (no interpreter) into ``cache_dir``, with ``env`` added; how many launches it
    compared."""
    env = {
        **{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        "TRITON_CACHE_DIR": str(cache_dir),
        **env,
    }
    script = f"from tests.test_launches import {comparison}; {comparison}()"
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    printed, count = run.stdout.split()
    assert printed == "compared"
    return int(count)


def _record_launchers() -> list[tuple]:
    """Make every compiled kernel's launcher append (the kernel, what it was given) to
    the list returned, instead of launching. No module is loaded (no driver): the
    function handle stays None for both paths compared."""
    from triton.compiler.compiler import CompiledKernel

    calls: list[tuple] = []
    CompiledKernel._init_handles = lambda self: None
    CompiledKernel.run = property(lambda kernel: lambda *given: calls.append((kernel, given)))
    return calls


def _compare_launchers():
    from triton import knobs
    from triton.runtime.jit import JITFunction
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mpgemm.kernels import launches
    from mpgemm.kernels.aot import _hopper_target

    calls = _record_launchers()
    jit = JITFunction(_probe)
    x = torch.randn(80)
    y = torch.empty(80)

    def grid(meta):
        return (triton.cdiv(meta["n"], meta["BLOCK"]),)

    def both(*args, **kwargs):
        """(the JIT's launch, ours): what each handed the launcher."""
        jit[grid](*args, **kwargs)
        launches.launch(jit, grid, *args, **kwargs)
        return calls[-2], calls[-1]

    compared = 0

    def same(ours, theirs):
        nonlocal compared
        (kernel, launched), (their_kernel, their_launched) = ours, theirs
        assert kernel is their_kernel
        assert launched[:6] == their_launched[:6]  # grid, stream, function, packed metadata
        assert [id(a) for a in launched[9:]] == [id(a) for a in their_launched[9:]]
        compared += 1
        return launched[6:9], their_launched[6:9]

    cases = [
        (x, y, 64, 2.0, True, 16),
        (x[1:], y, 64, 2.0, True, 16),  # 4 bytes off: not 16-byte aligned
        (x, y, 63, 2.0, True, 16),
        (x, y, 1, 2.0, True, 16),
        (x, y, 64, 2.0, True, 32),  # the constexpr MODE, given by position
        (x, y, 80, 0.5, False, 16, 32, False),  # BLOCK and a constexpr bool too
        (x, y, 80, 0.5, False, 16, 32, True),
    ]
    with _hopper_target():
        for args in cases:
            theirs, first = both(*args, num_warps=4)  # ours goes through the JIT
            same(first, theirs)
        binaries = {id(kernel) for kernel, _ in calls}
        assert len(binaries) == len(cases) == len(launches._binaries)
        for args in cases:
            theirs, ours = both(*args, num_warps=4)
            ours_hooks, their_hooks = same(ours, theirs)
            assert ours_hooks == (None, None, None)
            hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
            assert their_hooks[1:] == hooks
        assert {id(kernel) for kernel, _ in calls} == binaries
        assert len(launches._binaries) == len(cases)

        # An autotuned kernel whose config's pre-hook sets a descriptor's block shape
        # (as the TMA GEMM's does): the autotuner's launch, then ours through the JIT
        # with the chosen config, then ours from the cached binary, each with a
        # descriptor made anew at [16, 16].
        tuned = triton.autotune(
            configs=[triton.Config({"BLOCK": 32}, pre_hook=_set_probe_block)], key=["n"]
        )(JITFunction(_desc_probe))
        square = torch.randn(32, 32)
        for _ in range(3):
            their_desc, ours_desc = (
                TensorDescriptor(square, [32, 32], [32, 1], [16, 16]) for _ in range(2)
            )
            tuned[(1,)](their_desc, y, 64)
            launches.launch(tuned, (1,), ours_desc, y, 64)
            (kernel, launched), (their_kernel, their_launched) = calls[-1], calls[-2]
            assert kernel is their_kernel
            assert launched[:6] == their_launched[:6]
            assert launched[9] is ours_desc and their_launched[9] is their_desc
            assert ours_desc.block_shape == their_desc.block_shape == [32, 32]
            assert [id(a) for a in launched[10:]] == [id(a) for a in their_launched[10:]]
            compared += 1

        # A JIT function with a pre-run hook goes through the JIT at every launch, which
        # runs the hook (a cached binary's launcher would skip it).
        hooked, ran = JITFunction(_probe), []
        hooked.add_pre_run_hook(lambda *args, **kwargs: ran.append(args))
        for _ in range(3):
            launches.launch(hooked, grid, *cases[0], num_warps=4)
        assert len(ran) == 3

        # One kernel, descriptors of two block shapes, nothing else apart: a binary each,
        # the JIT's, for every launch (its binary was compiled for its block shape).
        tile_sum = JITFunction(_tile_sum_probe)
        for block in ([16, 16], [8, 8], [16, 16], [8, 8]):
            descriptors = [TensorDescriptor(square, [32, 32], [32, 1], block) for _ in range(2)]
            tile_sum[(1,)](descriptors[0], y)
            launches.launch(tile_sum, (1,), descriptors[1], y)
            (kernel, launched), (their_kernel, their_launched) = calls[-1], calls[-2]
            assert kernel is their_kernel
            assert launched[9] is descriptors[1] and their_launched[9] is descriptors[0]
            compared += 1

        seen = []
        knobs.runtime.launch_enter_hook.add(seen.append)
        theirs, ours = both(*cases[0], num_warps=4)
        ours_hooks, their_hooks = same(ours, theirs)
        assert ours_hooks[1:] == their_hooks[1:]
        assert ours_hooks[0].get() == their_hooks[0].get() != {}
    print("compared", compared)
