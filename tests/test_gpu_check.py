"""The GPU runbook, ``bench/gpu_check.sh``, checked on the CPU: each stage's dry run
writes the files its GPU run writes, within what the device machine returns (at most 8
files, at most 2 folders down, names of letters, digits, '.', '_' and '-'); the bench
stage's JSON and report hold what the GPU-results issue reads; the plan counts the
bench and train stages' compiles at the GPU's sizes and keeps them inside their time
limit, and counts the tests stage's on one file."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.bench_scripts import load

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
gpu_check = load("gpu_check")

NAME = re.compile(r"[A-Za-z0-9._-]+")


def _run(*args, **env):
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**base, "PYTHON": sys.executable, **env},
    )


def _check_bench_results(out: Path):
    data = json.loads((out / "bench.json").read_text())
    assert data["machine_info"]["mpgemm"]["torch"]
    groups = {b["group"] for b in data["benchmarks"]}
    assert groups == {
        "gemm",
        "gemm_bf16",
        "gemm_batched",
        "linear",
        "unscale",
        "cross_entropy",
        "step",
    }
    ours = [b for b in data["benchmarks"] if b["extra_info"]["impl"].startswith("mpgemm")]
    for bench in ours:
        info = bench["extra_info"]
        assert info["ratio_to"] and all(r > 0 for r in info["ratio_to"].values()), info
        assert info.get("tflops", 0) > 0 or info.get("gb_per_s", 0) > 0, info
    step = [b for b in ours if b["group"] == "step"][0]["extra_info"]
    assert set(step["ratio_to"]) == {"autocast_foreach", "autocast_fused", "fp32"}
    assert step["timing"] == "wall clock"
    # Launches and host time per step for every eager implementation.
    steps = [b["extra_info"] for b in data["benchmarks"] if b["group"] == "step"]
    assert {i["impl"] for i in steps} == {"mpgemm", "autocast_foreach", "autocast_fused", "fp32"}
    assert all(i["launches"] > 0 and i["host_us"] > 0 for i in steps)
    gemm = [b["extra_info"] for b in ours if b["group"] == "gemm"]
    assert {i["impl"] for i in gemm} == {"mpgemm", "mpgemm_pointer", "mpgemm_from_fp32"}
    assert all(set(i["ratio_to"]) == {"torch_fp16", "autocast", "fp32"} for i in gemm)

    report = (out / "report.md").read_text()
    # The issue's targets first, then the groups' tables, the gemm group's first.
    targets, table = report.split("### gemm", 1)
    assert "### targets" in targets and "| FP16 GEMM, geomean over " in targets
    rows = [
        line
        for line in table.splitlines()
        if line.startswith("| ") and "---" not in line and not line.startswith("| case")
    ]
    assert len(rows) == len(ours) + len(steps)  # the step group's counts: a row each
    assert "| launches per step | host us per step, triton's launch stubbed |" in table
    assert "x torch_fp16" in table
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The log says each case's time as it goes, so a stage cut short still reports.
    assert "64x64x64 mpgemm: median" in (out / "bench.log").read_text()


def _check_target_results(out: Path):
    """The targets stage runs what the issue's targets read and nothing else: mpgemm and
    each target's baseline (the CUDA graph's step skips on a CPU), and the report's
    targets table from them."""
    data = json.loads((out / "bench.json").read_text())
    ran = {(b["group"], b["extra_info"]["impl"]) for b in data["benchmarks"]}
    assert ran == {
        ("gemm", "mpgemm"),
        ("gemm", "torch_fp16"),
        ("step", "mpgemm"),
        ("step", "autocast_fused"),
        ("step", "fp32"),
        ("unscale", "mpgemm"),
        ("unscale", "torch"),
        ("unscale", "device_copy"),
    }
    report = (out / "report.md").read_text()
    assert "### targets" in report
    assert re.search(r"\| unscale \+ inf check, 20x5000_fp16 \| torch \| \d+\.\d\d \|", report)


@pytest.mark.parametrize("stage", list(gpu_check.STAGES))
def test_dry_run_writes_the_stage_files_within_the_device_limits(stage, tmp_path):
    run = _run(stage, GPU_CHECK_DRY_RUN="1", OUT=str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == sorted(gpu_check.STAGES[stage].files)
    assert len(files) <= gpu_check.MAX_FILES
    for name in files:
        parts = name.split("/")
        assert len(parts) <= 3 and all(NAME.fullmatch(part) for part in parts), name
    assert "dry run" in (tmp_path / "env.txt").read_text()
    if stage == "bench":
        _check_bench_results(tmp_path)
    if stage == "targets":
        _check_target_results(tmp_path)
    if stage == "tests":
        assert re.search(r'tests="\d+"', (tmp_path / "junit.xml").read_text())


def test_unknown_stage_is_refused_before_anything_runs(tmp_path):
    run = _run("benchmark", OUT=str(tmp_path))
    assert run.returncode == 2 and "usage" in run.stderr
    assert not any(tmp_path.iterdir())


def test_a_stage_is_stopped_at_its_limit_and_keeps_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "GRACE_SECONDS", 5)
    command = gpu_check.Command(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
        "slow.log",
    )
    status = gpu_check._run(command, tmp_path, gpu_check.time.monotonic() + 2, dict(os.environ))
    assert status != 0
    log = (tmp_path / "slow.log").read_text()
    assert "started" in log and "stopped at the stage's limit" in log


# The stages that compile ahead, and the bench stage nearest its limit. The tests stage's
# workload is the test suite itself: planning it here would run the whole suite a second
# time (a third of CI's time), so its plan is checked on one file below, and in full by
# the GPU session's ``plan``.
PLANNED = ["bench", "train"]


def test_plan_counts_compiles_and_fits_the_bench_and_train_stages_in_their_limit():
    run = _run("plan", *PLANNED)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    pattern = re.compile(r"stage (\w+): (\d+) compiles, (\d+) files, estimate (\d+) s")
    found = {m.group(1): m for m in map(pattern.fullmatch, lines) if m}
    assert list(found) == PLANNED, run.stdout
    for name, match in found.items():
        assert int(match.group(2)) > 0, name
        assert int(match.group(3)) == len(gpu_check.STAGES[name].files) <= gpu_check.MAX_FILES
        assert int(match.group(4)) <= gpu_check.STAGE_SECONDS, match.group(0)


def test_the_tests_stage_plan_counts_one_binary_per_launch():
    """The tests stage runs the suite with one autotune config per launch: its plan, on
    one file's tests, counts compiles and no config to time."""
    stage = dataclasses.replace(
        gpu_check.STAGES["tests"],
        workloads=lambda: gpu_check._tests_workloads("tests/test_matmul.py"),
    )
    compiles, tuned = gpu_check.plan_stage(stage)
    assert compiles > 0 and tuned == 0


def test_plan_refuses_an_unknown_stage():
    run = _run("plan", "bench", "benchmark")
    assert run.returncode == 2 and "usage" in run.stderr and not run.stdout


def _interpreted_rows(script: str, *args: str) -> list[dict]:
    """The JSON rows a bench script prints, run with the kernels interpreted; it must
    exit 0 (every check it makes passed)."""
    run = subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT / "bench",
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_the_optimizer_sweep_runs_every_launch_shape_to_the_same_bits():
    """bench/sweep_optim.py, the script a GPU session runs for the optimizers' gap, on
    tiny shapes through the interpreter: every launch shape writes the default's bits;
    ``--against`` a copy of the kernels' module, importing a copy of the tensor table's
    (as a session passes an earlier revision's), times both, alternating, to the same
    bits."""
    rows = _interpreted_rows(
        "sweep_optim.py",
        "--smoke",
        f"--against={ROOT / 'kernels' / 'fused_optim.py'}",
        f"--against-table={ROOT / 'kernels' / 'tensor_table.py'}",
    )
    # Per optimizer, (block, warps, register cap, blocks a program): 1024, 2048 and 4096
    # elements a block on 4 or 8 warps, uncapped, then 1 to 16 blocks a program, then
    # four capped; with the weights' FP16 copies and without copies; then torch's fused
    # step. The interpreter has no binary whose registers a row could give; the smoke
    # test's launch is too small for more than one block a program of its own choice.
    caps = [None] * 11 + [80, 64, 80, 64]
    per_program = [1] * 6 + [1, 2, 4, 8, 16] + [1] * 4
    for name, block in (("adam", rows[:31]), ("sgd", rows[31:62])):
        ours = block[:-1]
        assert len(ours) == 30 and all(r["same_bits_as_default"] and r["us"] > 0 for r in ours)
        assert all(r["optimizer"] == name for r in ours)
        assert [r["copies"] for r in ours] == [True] * 15 + [False] * 15
        assert [r["maxnreg"] for r in ours] == caps * 2
        assert [r["blocks_per_program"] for r in ours] == per_program * 2
        assert all(r["registers"] is None and r["spills"] is None for r in ours)
        assert block[-1]["impl"] == f"torch fused {name}"
    # Three rounds of (unscaled, scaled) x (installed, against).
    against = rows[62:]
    assert [(r["round"], r["scaled"], r["impl"]) for r in against] == [
        (i, scaled, impl)
        for i in range(3)
        for scaled in (False, True)
        for impl in ("mpgemm", "mpgemm against")
    ]
    assert all(r["same_bits_as_default"] and r["us"] > 0 for r in against)


def test_the_adam_probe_streams_and_steps_every_placement_to_the_same_bits():
    """bench/probe_adam.py, a GPU session's probe of Adam's DRAM time, on tiny shapes
    through the interpreter: per placement (the allocator's, then carved with each
    stagger) the 1/1, 3/3 and 4/4 streams, then mpgemm's and torch's fused Adam, each
    writing the bits it wrote on the allocator's tensors."""
    rows = _interpreted_rows("probe_adam.py", "--smoke")
    placements = ["allocator"] + [f"carved +{s}" for s in (0, 4352, 2**20 + 4352)]
    impls = ["stream 1/1", "stream 3/3", "stream 4/4", "mpgemm adam", "torch fused adam"]
    assert [(r["placement"], r["impl"]) for r in rows] == [
        (placement, impl) for placement in placements for impl in impls
    ]
    assert all(r["us"] > 0 and r["gb_per_s"] > 0 for r in rows)
    assert [len(r["offsets"]) for r in rows[:5]] == [1, 3, 4, 5, 5]
    assert all(r["same_bits_as_allocator"] for r in rows if "adam" in r["impl"])


def test_the_profile_reports_a_failed_section_and_runs_the_next(tmp_path):
    """bench/profile_gpu.py, a GPU session's profile (this file is not run on a GPU): a
    section that raises (here, every one: no GPU) is written to profile.md with its
    traceback and the next still runs; a misspelt section name stops it before anything
    runs."""

    def profile(out, sections):
        return subprocess.run(
            [sys.executable, "profile_gpu.py", str(out), sections],
            cwd=ROOT / "bench",
            capture_output=True,
            text=True,
            timeout=300,
        )

    run = profile(tmp_path / "a", "launch,idle")
    assert run.returncode == 1 and "2 section(s) failed: launch, idle" in run.stderr
    report = (tmp_path / "a" / "profile.md").read_text()
    assert "## launch: failed" in report and "## idle: failed" in report
    assert report.count("Traceback") == 2
    run = profile(tmp_path / "b", "launch,guide mpgemn")
    assert run.returncode == 1 and "no section guide mpgemn" in run.stderr
    assert not (tmp_path / "b" / "profile.md").exists()


def test_the_profile_ends_with_the_tiles_chosen_and_the_autotuners_timings(tmp_path, monkeypatch):
    """The profile's last part: the config each launch kind ran, and every config the
    autotuner timed for it, as the bench report lays them out."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from mpgemm.kernels import gemm_tma, launches

    profile_gpu = load("profile_gpu")
    kernel, config = gemm_tma._gemm_tma_kernel, gemm_tma.GPU_CONFIGS[0]
    kind = (kernel, 4096, 1024, 8192)
    monkeypatch.setattr(launches, "_chosen", {kind: (config, {})})
    monkeypatch.setattr(launches, "_timed", {kind: [(config, 0.1076)]})
    profile_gpu.write_autotuned(tmp_path)
    lines = (tmp_path / "profile.md").read_text().splitlines()
    chosen = lines[lines.index("### autotuned") + 4]
    assert chosen.startswith("| 1 | _gemm_tma_kernel | 4096, 1024, 8192 |")
    row = lines[lines.index("### autotuner timings") + 4]
    assert row == f"| 1 | {launches.config_text(config)} | 0.1076 | 1.00 |"
    monkeypatch.setattr(launches, "_chosen", {})
    profile_gpu.write_autotuned(tmp_path / "none")  # (nothing chosen: nothing written)
    assert not (tmp_path / "none" / "profile.md").exists()


def test_the_activation_ab_runs_both_kernels_to_the_same_results():
    """bench/ab_activation.py, the A/B a GPU session runs for the activation backward,
    on small shapes through the interpreter against the installed module's own file:
    three alternating rounds per activation, dZ bit for bit, the bias gradients close."""
    rows = _interpreted_rows("ab_activation.py", str(ROOT / "kernels" / "activation.py"), "--smoke")
    timed = [r for r in rows if "us" in r]
    assert [(r["activation"], r["round"], r["impl"]) for r in timed] == [
        (name, i, impl)
        for name in ("relu", "gelu")
        for i in range(3)
        for impl in ("mpgemm", "mpgemm against")
    ]
    assert all(r["us"] > 0 for r in timed)
    checks = [r for r in rows if "us" not in r]
    assert checks == [
        dict(activation=name, dz_same_bits=True, bias_grad_close=True) for name in ("relu", "gelu")
    ]


def test_the_graph_ab_steps_every_variant_to_the_same_bits():
    """bench/ab_graph.py, the A/B a GPU session runs for the graphed steps' variants, on
    a small eager step through the interpreter (where PDL stays off, as the rows say):
    two alternating rounds of the shipped recipe, the variants and the control, then
    each one's median against the shipped recipe's, its weights the shipped recipe's
    bit for bit (gradients zeroed in place or set to None step alike; the launches from
    C++, which the interpreter does not make, alike), but for the ReLU's backward
    unfused, whose bias gradients are summed in another order."""
    rows = _interpreted_rows("ab_graph.py", "--smoke")
    impls = [
        "as shipped",
        "grads zeroed in place",
        "pdl",
        "relu backward fused",
        "native launch",
        "as shipped, control",
    ]
    timed, summaries = rows[:-5], rows[-5:]
    assert [(r["round"], r["impl"]) for r in timed] == [(i, n) for i in range(2) for n in impls]
    assert all(r["us"] > 0 and r["pdl"] is False and r["mode"] == "mpgemm" for r in timed)
    assert [s["impl"] for s in summaries] == impls[1:]
    assert all(s["shipped_speedup"] > 0 and s["mode"] == "mpgemm" for s in summaries)
    assert all(s["same_bits"] for s in summaries if s["impl"] != "relu backward fused")


def test_the_graph_abs_compile_only_mode_launches_each_variants_kernels(tmp_path):
    """``ab_graph.py --once``, which bench/warm_cache.py compiles ahead: each variant's
    step with its settings on, so that the launches recorded include PDL's, for every
    kernel the step launches, and the ReLU's backward fused into an input gradient."""
    path = tmp_path / "launches.jsonl"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "CUDA_VISIBLE_DEVICES": "",
        "MPGEMM_RECORD_LAUNCHES": str(path),
    }
    run = subprocess.run(
        [sys.executable, "ab_graph.py", "--once", "--smoke"],
        cwd=ROOT / "bench",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_pdl = {
        pdl: {r["kernel"] for r in records if bool(r["specialization"].get("launch_pdl")) is pdl}
        for pdl in (False, True)
    }
    assert by_pdl[True] and by_pdl[True] == by_pdl[False]
    assert any(r["specialization"].get("RELU_GRAD") for r in records)


def test_the_session_script_archives_each_part_and_skips_what_cannot_run(tmp_path):
    """bench/gpu_session.sh, a device call's parts in order, as a dry run on the CPU: the
    profile (every section fails here: no GPU) is archived with its log; the activation
    A/B is skipped without an earlier kernel file; the Adam probe runs interpreted (its
    ncu not: no GPU) and is archived with its rows, as the graphed steps' A/B is, and
    the targets stage with the launches from C++ on; a part that needs more time than
    is left is skipped; an unknown part stops the call before anything runs. A warm
    cache carried (bench/warm_cache.py) is installed first (here: not, for want of a
    GPU to compile for), and the binaries compiled beyond it are counted last."""
    warm = tmp_path / "warm.tar.xz"
    warm.write_bytes(b"")

    def session(*parts, seconds=300):
        env = {
            **os.environ,
            "GPU_CHECK_DRY_RUN": "1",
            "OUT": str(tmp_path / "out"),
            "SCRATCH": str(tmp_path / "scratch"),  # (empty)
            "SESSION_SECONDS": str(seconds),
            "PYTHON": sys.executable,
            "WARM": str(warm),
            "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        }
        return subprocess.run(
            ["bash", str(ROOT / "bench" / "gpu_session.sh"), *parts],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    run = session("profile", "ab", "adam", "graph", "native")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("warm cache not installed: no GPU target here")
    assert lines[-2].startswith("warm cache: ") and " compiled beyond the 0 installed" in lines[-2]
    assert "gpu_session: profile rc=1" in run.stdout
    assert "ab skipped: no " in run.stdout
    assert "gpu_session: adam rc=0" in run.stdout
    assert "gpu_session: graph rc=0" in run.stdout
    assert "gpu_session: native rc=0" in run.stdout
    archives = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert archives == ["adam.tgz", "graph.tgz", "native.tgz", "profile.tgz"]
    # The targets stage again, its set-up saying the launches from C++ were on.
    with tarfile.open(tmp_path / "out" / "native.tgz") as archive:
        env = archive.extractfile("native/env.txt").read().decode()
    assert "mpgemm launches from C++ (MPGEMM_NATIVE_LAUNCH): on" in env
    for part, rows in (("adam", "probe.json"), ("graph", "ab_graph.json")):
        with tarfile.open(tmp_path / "out" / f"{part}.tgz") as archive:
            assert f"{part}/{rows}" in archive.getnames()
    with tarfile.open(tmp_path / "out" / "profile.tgz") as archive:
        names = archive.getnames()
    assert "profile.out" in names and "profile/profile.md" in names
    run = session("tests", seconds=100)
    assert "tests skipped: " in run.stdout and "it needs 200" in run.stdout
    run = session("profile", "benchmark")
    assert run.returncode == 2 and "no part benchmark" in run.stdout
    assert "profile rc" not in run.stdout


def test_carried_wheels_install_from_their_folder_alone(tmp_path):
    """The set-up's install of wheels carried to the device (which has no network):
    none carried, none installed; a carried one installs with no index (pip's dry run
    on a wheel built here)."""
    assert gpu_check.carried_wheels(tmp_path) is None
    project = tmp_path / "project"
    (project / "carried_probe").mkdir(parents=True)
    (project / "carried_probe" / "__init__.py").write_text("")
    (project / "pyproject.toml").write_text(
        '[project]\nname = "carried-probe"\nversion = "0.1"\n'
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
    )
    wheels = tmp_path / "whl"
    pip = [sys.executable, "-m", "pip"]
    build = [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    subprocess.run([*build, str(project)], check=True, capture_output=True, timeout=300)
    command = gpu_check.carried_wheels(wheels)
    report = tmp_path / "report.json"
    dry_run = [*command.argv, "--dry-run", "--report", str(report)]
    run = subprocess.run(dry_run, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    installs = json.loads(report.read_text())["install"]
    assert [item["metadata"]["name"] for item in installs] == ["carried-probe"]
