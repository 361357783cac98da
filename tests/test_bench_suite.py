"""The benchmark suite runs end to end on the CPU (small shapes, mpgemm's reference
path) with timings on, writes pytest-benchmark's JSON with the derived metrics, and
``bench/report.py`` turns that into a table and a figure."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_suite_json_and_report(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(BENCH), "--benchmark-only", "-q",
         "-p", "no:cacheprovider", f"--benchmark-json={out}"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["machine_info"]["mpgemm"]["torch"]
    groups = {b["group"] for b in data["benchmarks"]}
    assert groups == {"gemm", "linear", "unscale", "step"}
    ours = [b for b in data["benchmarks"] if b["extra_info"]["impl"].startswith("mpgemm")]
    for bench in ours:
        info = bench["extra_info"]
        assert info["ratio_to"] and all(r > 0 for r in info["ratio_to"].values()), info
        assert info.get("tflops", 0) > 0 or info.get("gb_per_s", 0) > 0, info
    step = [b for b in ours if b["group"] == "step"][0]["extra_info"]
    assert set(step["ratio_to"]) == {"autocast_foreach", "autocast_fused", "fp32"}
    gemm = [b["extra_info"] for b in ours if b["group"] == "gemm"]
    assert {i["impl"] for i in gemm} == {"mpgemm", "mpgemm_from_fp32"}
    assert all(set(i["ratio_to"]) == {"torch_fp16", "autocast", "fp32"} for i in gemm)

    report = subprocess.run(
        [sys.executable, str(BENCH / "report.py"), str(out), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert report.returncode == 0, report.stderr
    table = (tmp_path / "report.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith("| case")]
    assert len(rows) == len(ours)
    assert "### gemm" in table and "x torch_fp16" in table
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
