"""The README's main job: the demo trains FP32 and mpgemm twins that stay together.

Run without TRITON_INTERPRET, so CPU tensors take the reference path a laptop takes."""

import os
import subprocess
import sys


def test_demo_trains_and_tracks_fp32():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "mpgemm", "--steps", "60", "--device", "cpu"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "backend: reference" in run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if line.strip()[:1].isdigit()]
    steps = [int(row[0]) for row in rows]
    fp32, mixed = ([float(row[i]) for row in rows] for i in (1, 2))
    assert steps[0] == 1 and steps[-1] == 60
    assert mixed[-1] < 0.7 * mixed[0], "the mpgemm model did not learn"
    assert abs(mixed[-1] - fp32[-1]) < 0.05 * fp32[-1]
