"""bench/host_time.py: mpgemm's eager path timed on the CPU down to triton's JIT launch.
The stub must let every launch through mpgemm's own launch layer (which an
interceptor skips, and the reference path never reaches) and ``triton_gemm``'s
replays, and stop it at triton's, restoring triton and the launch layer's chosen
configs afterwards."""

import os
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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = "from tests.test_host_time import _replays_in_the_stub; print(_replays_in_the_stub())"
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "TRITON_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["[0,", "0,", "0,", "1]"]


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
