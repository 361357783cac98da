"""The GPU benchmark scripts run end to end (on tiny CPU shapes here) and write JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gemm_sweep.py"


def test_gemm_sweep_writes_rows(tmp_path):
    out = tmp_path / "sweep.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["environment"]["torch"]
    assert len(result["rows"]) >= 2
    for row in result["rows"]:
        assert all(ms > 0 for ms in row["ms"].values())
        assert row["ratio_to_cublas"] > 0


def test_scaling_bench_writes_rows(tmp_path):
    out = tmp_path / "scaling.json"
    script = SCRIPT.with_name("scaling_bench.py")
    run = subprocess.run(
        [sys.executable, str(script), "--out", str(out)],
        env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["copy_gb_per_s"] > 0
    assert {row["set"].split("_")[-1] for row in result["unscale"]} == {"fp32", "fp16"}
    for row in result["unscale"]:
        assert all(ms > 0 for ms in row["ms"].values()) and row["speedup_vs_torch"] > 0
