"""The launches made from C++ (``mpgemm.kernels.native_launch``).

Without a GPU: under a stand-in CUDA driver (``fake_driver``) that records what each
launch hands it, every replay the GEMMs make (TMA and pointer kernels, a batch, a
layer's forward and backward, split-K and its reduction, PDL) and every other launch
of a training step (the cross-entropy, the ReLU's backward, the unscale, Adam's and
SGD's steps, the scale's update) is made by Triton's own launcher and by its plan on
the same arguments, and the two records must be the same bytes
(``native_launch_check.py``: the grid, block, shared memory, stream, function, launch
attributes and every parameter, the tensor maps' encoding arguments included). What
``plan`` refuses, and what ``launch`` checks. A product ``mpgemm.matmul`` replays from
its entry (``functional._replay_key``), by either launcher, hands the driver what its
full path does. On a GPU: the plans' results, bit for bit against Triton's launcher's.
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from tests import fake_driver

HERE = Path(__file__).resolve().parent
CASES = 15

needs_compiler = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory) -> Path:
    return fake_driver.build(tmp_path_factory.mktemp("fake_cuda"))


def _checked(fake_cuda: Path, *args: str) -> list[dict]:
    """The JSON lines of ``native_launch_check.py`` run with ``args`` under the stand-in
    driver in ``fake_cuda``."""
    run = subprocess.run(
        [sys.executable, str(HERE / "native_launch_check.py"), *args],
        env=fake_driver.environment(
            fake_cuda,
            MPGEMM_SINGLE_CONFIG="1",
            MPGEMM_NATIVE_LAUNCH="1",
            TRITON_DEFAULT_FP_FUSION="1",
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


@needs_compiler
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a GPU's torch would load the stand-in as its driver; the GPU test below runs",
)
def test_every_planned_launch_hands_the_driver_what_tritons_launcher_does(fake_cuda):
    results = _checked(fake_cuda)
    assert len(results) == CASES + 4, results
    # A replay that cannot be planned launches by Triton's launcher every time, and is
    # asked for its plan once.
    unplanned, regridded, threaded, entry, *results = results
    assert unplanned == {
        "case": "a launch that cannot be planned",
        "plan_calls": 1,
        "launches": 5,
        "kept": [],
    }
    # A binary planned on one grid and launched on another takes the other.
    assert regridded == {
        "case": "a cached binary launched on another grid",
        "same": True,
        "grids": [[6, 1, 1]],
    }
    # A thread with no current context gets one from the plan's launch, as from
    # Triton's launcher (device 0's primary context).
    assert threaded == {
        "case": "a planned launch from a thread with no current context",
        "by_triton": 1,
        "by_plan": 1,
    }
    # A product made before goes from matmul's entry to its replay, none of the full
    # path's layers between, by either launcher: the launches the full path makes, byte
    # for byte (split-K's two: the partials, their reduction). Each: the full path's
    # calls from the entry, then without the kept decisions; the launches; the same.
    kinds = ["TMA", "pointer", "TMA, B transposed, BF16 to FP32", "pointer, mixed dtypes"]
    kinds.append("pointer, transposed product")
    assert entry["case"] == "matmul's replay at its entry"
    assert entry["products"] == {
        f"{kind}, {launcher}": [0, 1, 1, True] for launcher in ("triton", "plans") for kind in kinds
    } | {f"split-K, {launcher}": [0, 1, 2, True] for launcher in ("triton", "plans")}
    for result in results:
        assert result["planned"] >= 1, result
        assert result["same"], result
    by_case = {r["case"]: r for r in results}
    # The layer's forward and weight gradient by their replays' plans, its ReLU's
    # backward by its binary's; split-K's two launches (the partials, their reduction)
    # each by its own; every launch of a training step (its 5 GEMMs, the cross-entropy's
    # 2, the ReLU's backward, the unscale, the optimizer step, the scale's update).
    assert by_case["Linear relu forward and backward, TMA"]["planned"] == 3
    split = by_case["10-class head's backward, split-K"]
    assert split["launches"] > split["planned"]
    # A tensor map encoded at an address is kept for the plan's next launch at that
    # address, and encoded anew at another: the same bytes either way.
    assert by_case["matmul, TMA"]["encodes"] == [2, 0]
    assert by_case["matmul, TMA, operands alternating between two pairs"]["encodes"] == [2, 2]
    assert by_case["training step, Adam"]["planned"] == 11
    assert by_case["training step, SGD with momentum"]["planned"] == 11
    pdl = by_case["matmul with programmatic dependent launch, TMA"]
    assert pdl["attributes"] == pdl["launches"]
    assert all(r["attributes"] == 0 for r in results if r is not pdl)


def test_a_launcher_that_does_not_build_is_warned_of_and_left_out(monkeypatch):
    """Where the helper cannot be built (no compiler, no ninja), native launches are off
    even when asked for, with one warning: every launch keeps Triton's launcher."""
    from torch.utils import cpp_extension

    from mpgemm.kernels import native_launch

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(native_launch, "_ENABLED", True)
    native_launch.module.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="launcher did not build.*Ninja is required"):
            assert not native_launch.enabled()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the answer is kept
            assert not native_launch.enabled()
    finally:
        native_launch.module.cache_clear()


@needs_compiler
@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in driver is for no GPU")
def test_the_host_time_benchmark_times_both_launchers():
    """bench/native_launch_time.py at its smoke scale: a row per case, each time with
    Triton's launcher and with the plans."""
    run = subprocess.run(
        [sys.executable, str(HERE.parent / "bench" / "native_launch_time.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| ")]
    cases = [row[0].lstrip("| ") for row in rows[2:]]
    assert cases == [
        "matmul 512^2 fp16 (TMA)",
        "matmul 512^2 fp16 (TMA), full path",
        "matmul 500x509x500 fp16 (pointer)",
        "matmul 500x509x500 fp16 (pointer), full path",
        "Linear relu forward+backward",
        "tiny MLP step",
        "small MLP step",
    ]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows[2:])


@needs_compiler
@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in driver is for no GPU")
def test_drawn_layers_hand_the_driver_what_tritons_launcher_does(fake_cuda):
    """Eight layers drawn (``native_launch_check.py --random``: sizes, dtypes, a
    transposed weight, bias, activation, output dtype, gradients), forward and backward:
    every planned launch the same bytes as Triton's launcher's."""
    results = _checked(fake_cuda, "--random", "7", "8")
    assert len(results) == 8, results
    assert all(r["same"] and r["planned"] >= 1 for r in results), results


def _binary(**metadata) -> types.SimpleNamespace:
    fields = dict(
        num_ctas=1,
        num_warps=4,
        shared=0,
        global_scratch_size=0,
        profile_scratch_size=0,
        launch_pdl=False,
        launch_cooperative_grid=False,
        tensordesc_meta=None,
    )
    fields.update(metadata)
    signature = {"x_ptr": "*fp16", "n": "i32", "BLOCK": "constexpr"}
    return types.SimpleNamespace(
        compiled=types.SimpleNamespace(
            metadata=types.SimpleNamespace(**fields),
            src=types.SimpleNamespace(signature=signature),
            function=1,
        ),
        tail=[],  # every value given positionally
    )


@pytest.mark.parametrize(
    "metadata, values, grid",
    [
        ({"num_ctas": 2}, None, (4,)),  # a cluster
        ({"global_scratch_size": 64}, None, (4,)),  # scratch memory to allocate
        ({"profile_scratch_size": 64}, None, (4,)),
        ({"shared": 228 * 1024 + 1}, None, (4,)),  # triton 3.9 adds an attribute
        ({}, None, (0,)),  # an empty grid, which Triton's launcher skips
        ({}, None, (1, 1, 1, 1)),
        ({}, ("x", 16, 64), (4,)),  # a pointer that is no tensor
        ({}, ("t", 1.5, 64), (4,)),  # a float where an integer goes
        ({}, ("t", True, 64), (4,)),  # a bool: not in the launch layer's key
        ({}, ("t", 16), (4,)),  # fewer values than parameters
        ({}, ("t", 2**31, 64), (4,)),  # an integer wider than its i32
    ],
)
def test_a_launch_the_plan_cannot_repeat_keeps_tritons_launcher(metadata, values, grid):
    from mpgemm.kernels import native_launch

    x = torch.empty(16, dtype=torch.float16)
    values = tuple(x if v == "t" else v for v in values or ("t", 16, 64))
    assert native_launch.plan(_binary(**metadata), grid, values, (x,)) is None


@pytest.mark.parametrize(
    "padding, meta",
    [
        ("nan", {}),
        ("zero", {"fp4_padded": True}),
        ("zero", {"is_im2col": True}),
    ],
)
def test_a_descriptor_no_mpgemm_kernel_makes_is_not_planned(padding, meta):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from mpgemm.kernels import native_launch

    x = torch.empty(32, 64, dtype=torch.float16)
    descriptor = TensorDescriptor(x, [32, 64], [64, 1], [16, 32], padding=padding)
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [16, 32], **meta}
    assert native_launch._tensor_map(descriptor, meta, 0) is None
    # What it takes: (32, 64) rows of 128 bytes, its 16 x 32 tile, innermost first.
    taken = TensorDescriptor(x, [32, 64], [64, 1], [16, 32])
    plain = {k: v for k, v in meta.items() if k not in ("fp4_padded", "is_im2col")}
    assert native_launch._tensor_map(taken, plain, 5) == (
        "map",
        5,
        6,
        (64, 32),
        (128,),
        (32, 16),
        3,
        0,
    )


def test_a_plan_whose_sources_are_not_the_launchs_tensors_is_refused():
    from mpgemm.kernels import native_launch

    x, y = torch.empty(16, dtype=torch.float16), torch.empty(16, dtype=torch.float16)
    assert native_launch.plan(_binary(), (4,), (x, 16, 64), (y,)) is None
    assert native_launch.plan(_binary(), (4,), (x, 16, 64), ()) is None  # too few
    assert native_launch.plan(_binary(), (4,), (x, 16, 64), (x, y)) is None  # too many


@needs_compiler
def test_a_plan_is_made_and_its_launch_checks_what_it_is_given():
    from mpgemm.kernels import native_launch

    x = torch.empty(16, dtype=torch.float16)
    planned = native_launch.plan(_binary(), (4,), (x, 16, 64), (x,))
    assert planned is not None
    with pytest.raises(TypeError, match="takes 1 sources, not 2"):
        native_launch.launch(planned, 0, x, x)
    with pytest.raises(ValueError, match="PyCapsule"):
        native_launch.launch("not a plan", 0, x)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver here: the launch says so, rather than crash
        with pytest.raises(RuntimeError, match="cannot open libcuda.so.1"):
            native_launch.launch(planned, 0, x)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
def test_replays_by_the_plans_compute_what_tritons_launcher_does(monkeypatch):
    """On a GPU: GEMM replays made by their plans give the bits that Triton's launcher
    gives on the same operands (the same binary, config and grid), call after call on
    new data; and so do a layer's and a head's gradients (split-K's reduction among
    their launches)."""
    import mpgemm
    from mpgemm.kernels import gemm, native_launch

    if native_launch.module() is None:
        pytest.skip("the C++ launcher did not build")
    by_plans = 0
    relaunch = gemm.native_relaunch

    def counted(*args):
        nonlocal by_plans
        by_plans += 1
        relaunch(*args)

    monkeypatch.setattr(gemm, "native_relaunch", counted)
    f16, device = torch.float16, torch.device("cuda")
    shapes = {
        "TMA": ((256, 512), (512, 384)),
        "TMA, A transposed": ((512, 256), (512, 384)),
        "pointer": ((250, 509), (509, 381)),
        "batched": ((2, 4, 128, 64), (2, 4, 64, 128)),
    }

    def products(a_shape, b_shape, native: bool) -> list[torch.Tensor]:
        # Once the first calls have launched and replayed, a replay while enabled makes
        # the plan and the rest replay by it.
        monkeypatch.setattr(native_launch, "_ENABLED", native)
        torch.manual_seed(0)
        out = []
        for _ in range(4):
            a = torch.randn(a_shape, device=device, dtype=f16)
            b = torch.randn(b_shape, device=device, dtype=f16)
            out.append(mpgemm.matmul(a.mT if a_shape == (512, 256) else a, b))
        return out

    for name, (a_shape, b_shape) in shapes.items():
        before = by_plans
        plain, planned = products(a_shape, b_shape, False), products(a_shape, b_shape, True)
        assert by_plans - before >= 2, name
        for x, y in zip(plain, planned, strict=True):
            assert torch.equal(x, y), name

    def trained(native: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(native_launch, "_ENABLED", native)
        torch.manual_seed(0)
        layer = mpgemm.Linear(512, 256, activation="relu", device=device)
        head = mpgemm.Linear(256, 10, device=device)
        for _ in range(4):
            x = torch.randn(4096, 512, device=device)
            head(layer(x)).float().sum().backward()
        return [p.grad for p in (*layer.parameters(), *head.parameters())]

    before = by_plans
    for plain, planned in zip(trained(False), trained(True), strict=True):
        assert torch.equal(plain, planned)
    assert by_plans > before
