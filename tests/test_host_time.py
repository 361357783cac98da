"""bench/host_time.py: mpgemm's eager path timed on the CPU down to triton's JIT launch.
The stub must let every launch through mpgemm's own launch layer (which an
interceptor skips, and the reference path never reaches) and ``triton_gemm``'s
replays, and stop it at triton's, restoring triton and the launch layer's chosen
configs afterwards."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import mpgemm
from tests.bench_scripts import load

pytest.importorskip("triton")
host_time = load("host_time")


def test_launches_pass_the_launch_layer_and_stop_at_the_jit(monkeypatch):
    from triton.runtime.jit import JITFunction

    from mpgemm.kernels import launches
    from mpgemm.kernels.gemm_tma import tuned_gemm_tma_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(launches, "_chosen", {})
    before = {("a binary from before",): None}
    monkeypatch.setattr(launches, "_binaries", dict(before))
    a, b = (torch.randn(64, 64, dtype=torch.float16) for _ in range(2))
    original = JITFunction.run
    with host_time.triton_stubbed():
        for _ in range(2):  # tuned (the first config), then the chosen config directly
            assert mpgemm.matmul(a, b).shape == (64, 64)
        assert JITFunction.run is not original
        assert [kind[0] for kind in launches._chosen] == [tuned_gemm_tma_kernel]
        assert ("a binary from before",) not in launches._binaries  # its launcher would run
        launches._binaries[("a stand-in binary",)] = host_time._NoBinary()
    assert JITFunction.run is original
    # The stub's first-config choices and stand-in binaries are forgotten.
    assert launches._chosen == {} and launches._binaries == before


def test_compiled_kernels_reach_triton_gemms_replays(tmp_path):
    """With compiled kernels (the interpreter's launch through the JIT every time): the
    autotuner, the JIT with its choice, the cached binary, then ``triton_gemm``'s
    replay, as on a GPU. In a process of its own, without the interpreter."""
    script = "from tests.test_host_time import _replays_in_the_stub; print(_replays_in_the_stub())"
    output = _compiled(script, TRITON_CACHE_DIR=str(tmp_path))
    assert output.split() == ["[0,", "0,", "0,", "1]"]


def _compiled(script: str, cwd=None, **env: str) -> str:
    """The output of ``script`` run in a Python process of its own without the
    interpreter, with ``env`` added to the environment; it must succeed."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={**base, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _replays_in_the_stub() -> list[int]:
    """How many replays each of four eager products made within the stub."""
    from mpgemm.kernels import gemm

    relaunched: list[None] = []
    relaunch = gemm._relaunch
    gemm._relaunch = lambda *args: relaunched.append(relaunch(*args))
    a, b = (torch.randn(64, 64, dtype=torch.float16) for _ in range(2))
    counts = []
    with host_time.triton_stubbed():
        for _ in range(4):
            before = len(relaunched)
            mpgemm.matmul(a, b)
            counts.append(len(relaunched) - before)
    return counts


def test_a_commits_package_imports_in_place_of_the_installed_one(tmp_path):
    """``--against``'s tree: commit HEAD's package laid out as installed (kernels as
    ``mpgemm.kernels``), imported from ``PYTHONPATH`` ahead of the installed tree. (A
    git checkout's: a copy of the files without their history, as the GPU machines'
    may be, has no commit to take.)"""
    git = shutil.which("git")
    if git is None or subprocess.run([git, "rev-parse", "HEAD"], cwd=host_time.REPO).returncode:
        pytest.skip("not a git checkout")
    package = host_time.package_at("HEAD", tmp_path)
    script = "import mpgemm.kernels.gemm as g, mpgemm; print(mpgemm.__file__); print(g.__file__)"
    output = _compiled(script, cwd=tmp_path, PYTHONPATH=str(package))
    assert output.split() == [
        str(package / "mpgemm" / "__init__.py"),
        str(package / "mpgemm" / "kernels" / "gemm.py"),
    ]


def test_the_times_are_read_back_from_the_scripts_output():
    output = (
        "matmul 512^2 fp16: 24.1 us\n"
        "guide MLP step, batch 64: 1327.5 us\n"
        "tiny MLP step by phase, mpgemm (us): zero_grad 21, forward + loss 237, step 838\n"
    )
    assert host_time.parse_times(output) == {
        "matmul 512^2 fp16": 24.1,
        "guide MLP step, batch 64": 1327.5,
        "tiny MLP step, mpgemm: zero_grad": 21.0,
        "tiny MLP step, mpgemm: forward + loss": 237.0,
        "tiny MLP step, mpgemm: step": 838.0,
    }
