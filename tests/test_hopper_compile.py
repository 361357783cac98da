"""Every shipped kernel and autotune config compiles for an H100 (sm_90a) with the
ptxas inside the triton wheel: GEMMs with wgmma in the PTX and no register spills; the
loss-scaling kernels with no spills, vector loads and no approximate FP32 math. This
runs the GPU compiler, which the interpreter never does, and needs no GPU."""

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
    gemms = [r for r in reports if "layout" in r["variant"]]
    scaling = [r for r in reports if "kernel" in r["variant"]]
    assert {r["variant"]["layout"] for r in gemms} == {"forward", "grad_input", "grad_weight"}
    assert {r["variant"]["compute_bf16"] for r in gemms} == {False, True}
    bad = [r for r in gemms if not (r["wgmma"] and r["spill_bytes"] == 0)]
    assert not bad, bad
    kinds = {r["variant"]["kernel"] for r in scaling}
    assert kinds == {"unscale", "scale_update", "sgd", "adam"}
    bad = [r for r in scaling if not r["ok"] or r["spill_bytes"] or r["approx_fp32"]]
    assert not bad, bad
    aligned = [r for r in scaling if ["ALIGNED", True] in r["variant"]["flags"]]
    assert aligned and all(r["vector_loads"] > 0 for r in aligned)
