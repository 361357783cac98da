"""Every shipped kernel and autotune config compiles for an H100 (sm_90a) with the
ptxas inside the triton wheel: wgmma in the PTX, no register spills. This runs the GPU
compiler, which the interpreter never does, and needs no GPU."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_every_kernel_compiles_for_hopper_with_wgmma_and_no_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "mpgemm.kernels.aot"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert reports, run.stderr[-2000:]
    layouts = {r["variant"]["layout"] for r in reports}
    assert layouts == {"forward", "grad_input", "grad_weight"}
    assert {r["variant"]["compute_bf16"] for r in reports} == {False, True}
    bad = [r for r in reports if not (r["wgmma"] and r["spill_bytes"] == 0)]
    assert not bad, bad
