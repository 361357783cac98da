"""The GPU runbook: what a lent GPU runs, in stages that each fit one device call.

    bash bench/gpu_check.sh plan     per stage: binaries to compile, files, time estimate
                                     (``plan STAGE ...``: those stages only)
    bash bench/gpu_check.sh targets  the benchmark cases the issue's targets read, alone
    bash bench/gpu_check.sh bench    the benchmark suite: JSON, table, figure
    bash bench/gpu_check.sh train    mpgemm train on the guide's MLP and the small MLP
    bash bench/gpu_check.sh tests    the test suite on compiled kernels

Stages are listed best value first. A device call may run 10 minutes; each stage ends
itself after ``STAGE_SECONDS`` (the running command gets SIGINT, so pytest still writes
its JSON and summary), with every log written to ``$OUT`` line by line as it runs, and
writes at most 8 files no more than 2 folders down (what the device returns).

Set-up comes first and stops the stage if it fails: ``pip install -e .`` without build
isolation or dependencies (the machine has no network), then a check that torch sees
a GPU, then (best effort) the install of any wheels carried in ``.whl/``. The bench
and train stages first compile every kernel their run will launch, on a thread per
core, into triton's cache (``MPGEMM_PRECOMPILE=1``): the run then autotunes without
compiling. Where a warm cache built on another machine is installed (``warm_cache.py``,
which ``gpu_session.sh`` installs), every stage finds the binaries it holds there.

``GPU_CHECK_DRY_RUN=1 OUT=DIR bash bench/gpu_check.sh STAGE`` runs a stage on the CPU
at toy scale and writes the same files, so CI checks the runbook itself.

``plan`` runs on the CPU: it records every launch each stage makes at the GPU's sizes
(``MPGEMM_RECORD_LAUNCHES``: nothing runs) and estimates the stage's time from the
binaries they need and the costs stated in ``bench/NOTES.md``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
# A stage ends itself after this long: 7 minutes, inside the device's 10 per call.
STAGE_SECONDS = 420
# After SIGINT, how long a command has to write its results before it is killed.
GRACE_SECONDS = 20
MAX_FILES = 8

# The costs the estimates are made of (bench/NOTES.md says where each comes from).
SETUP_S = 50  # pip install, imports, CUDA start, mpgemm.native's build (some 20 s)
COMPILE_S = 0.8  # one GEMM binary, compiled on one core (triton 3.6/3.9, sm_90a)
PRECOMPILE_THREADS = 8  # speed-up of compiling on a thread per core, on 16 cores
TUNE_S = 0.15  # timing one autotune config (25 ms warm-up + 100 ms of repeats)
TEST_WORKERS = 8  # pytest-xdist workers of the tests stage


@dataclass
class Command:
    argv: list[str]
    log: str  # file under $OUT that the output goes to (appended), and to stdout
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Stage:
    name: str
    files: list[str]  # what the stage writes under $OUT
    commands: Callable[[Path, bool], list[Command]]  # (out, dry run) -> what to run
    workloads: Callable[[], list[Command]]  # the launches to record for the plan
    precompile: bool  # whether it compiles ahead on a thread per core
    run_s: float  # time of the stage's runs with every binary in the cache
    # Whether its workloads pass while recorded (the tests stage's suite does not: its
    # checks read what intercepted launches never compute).
    workloads_pass: bool = True

    def estimate(self, compiles: int, tuned: int) -> float:
        parallel = PRECOMPILE_THREADS if self.precompile else TEST_WORKERS
        return SETUP_S + compiles * COMPILE_S / parallel + tuned * TUNE_S + self.run_s


def _pytest(*args: str) -> list[str]:
    return [PYTHON, "-m", "pytest", "-p", "no:cacheprovider", *args]


# -- bench ------------------------------------------------------------------------------


def _bench_commands(out: Path, dry: bool, selection: dict[str, str] | None = None) -> list[Command]:
    # -s: each case prints its median as it finishes, so a cut-short run still says
    # what it measured. ``selection``: the environment that selects cases (the targets').
    return [
        Command(
            _pytest(
                "bench", "--benchmark-only", "-s", "-rfE", f"--benchmark-json={out / 'bench.json'}"
            ),
            "bench.log",
            dict(selection or {}),
        ),
        Command(
            [PYTHON, "bench/report.py", str(out / "bench.json"), "--out", str(out)], "bench.log"
        ),
    ]


def _bench_workloads(selection: dict[str, str] | None = None) -> list[Command]:
    return [
        Command(
            _pytest("bench", "--benchmark-disable", "-q"),
            "bench.log",
            {"MPGEMM_BENCH_SCALE": "gpu", **(selection or {})},
        )
    ]


# The cases that the targets read, alone (bench/conftest.py): some 30 of the
# suite's 184, the numbers the GPU-results issue asks for, in a third of a device call.
_TARGETS = {"MPGEMM_BENCH_TARGETS": "1"}


# -- train ------------------------------------------------------------------------------

# The TensorFlow mixed-precision guide's MLP (784 -> 4096 -> 4096 -> 10, batch 8192) and
# the small MLP that mixed precision is known to slow down (784 -> 128 -> 10, batch 128).
TRAIN_RUNS = {
    "train_guide_mlp": [
        "--data",
        "synthetic",
        "--features",
        "784",
        "--samples",
        "65536",
        "--hidden",
        "4096,4096",
        "--batch-size",
        "8192",
        "--steps",
        "200",
    ],
    "train_small_mlp": [
        "--data",
        "synthetic",
        "--features",
        "784",
        "--samples",
        "60000",
        "--hidden",
        "128",
        "--batch-size",
        "128",
        "--steps",
        "1000",
    ],
}
_TRAIN_TOY = [
    "--data",
    "synthetic",
    "--features",
    "32",
    "--samples",
    "512",
    "--hidden",
    "16",
    "--batch-size",
    "64",
    "--steps",
    "12",
    "--device",
    "cpu",
]


def _train(args: list[str], *options: str) -> list[str]:
    return [PYTHON, "-m", "mpgemm", "train", *args, "--no-progress", *options]


def _train_commands(out: Path, dry: bool) -> list[Command]:
    return [
        Command(
            _train(_TRAIN_TOY if dry else args, "--mode", "all", "--out", str(out / run)),
            f"{run}/train.log",
        )
        for run, args in TRAIN_RUNS.items()
    ]


def _train_workloads() -> list[Command]:
    # mpgemm's mode alone launches mpgemm kernels; on the CPU, with launches recorded.
    return [
        Command(_train(args, "--mode", "mpgemm", "--device", "cpu"), f"{run}/train.log")
        for run, args in TRAIN_RUNS.items()
    ]


# -- tests ------------------------------------------------------------------------------

# Not on the GPU: the compile check runs the GPU compiler anyway, and this runbook's own
# tests are about the CPU.
_NOT_ON_GPU = [
    "--ignore",
    "tests/test_hopper_compile.py",
    "--ignore",
    "tests/test_gpu_check.py",
    "--ignore",
    "tests/test_warm_cache.py",
]
_TESTS_TOY = ["tests/test_errors.py"]
# One autotune config per launch: each kernel compiles once, not once per config.
_SINGLE_CONFIG = {"MPGEMM_SINGLE_CONFIG": "1"}


def _tests_commands(out: Path, dry: bool) -> list[Command]:
    workers = "2" if dry else str(TEST_WORKERS)
    # loadfile: a file's tests share a worker, and so mostly its kernels' compiles.
    return [
        Command(
            _pytest(
                *(_TESTS_TOY if dry else _NOT_ON_GPU),
                "-n",
                workers,
                "--dist",
                "loadfile",
                "--timeout",
                "180",
                "-v",
                "-rfE",
                f"--junitxml={out / 'junit.xml'}",
            ),
            "tests.log",
            _SINGLE_CONFIG,
        )
    ]


def _tests_workloads(*selection: str) -> list[Command]:
    """The tests stage's run, or the tests in ``selection`` (pytest's arguments) alone."""
    return [Command(_pytest(*(selection or _NOT_ON_GPU), "-q"), "tests.log", _SINGLE_CONFIG)]


STAGES = {
    stage.name: stage
    for stage in (
        Stage(
            "targets",
            ["env.txt", "bench.log", "bench.json", "report.md", "speedup.png"],
            lambda out, dry: _bench_commands(out, dry, _TARGETS),
            lambda: _bench_workloads(_TARGETS),
            precompile=True,
            run_s=60,
        ),
        Stage(
            "bench",
            ["env.txt", "bench.log", "bench.json", "report.md", "speedup.png"],
            _bench_commands,
            _bench_workloads,
            precompile=True,
            run_s=105,
        ),
        Stage(
            "train",
            ["env.txt"]
            + [
                f"{run}/{name}"
                for run in TRAIN_RUNS
                for name in ("train.log", "results.json", "results.png")
            ],
            _train_commands,
            _train_workloads,
            precompile=True,
            run_s=65,
        ),
        Stage(
            "tests",
            ["env.txt", "tests.log", "junit.xml"],
            _tests_commands,
            _tests_workloads,
            precompile=False,
            run_s=90,
            workloads_pass=False,
        ),
    )
}


# -- running ----------------------------------------------------------------------------


def _run(command: Command, out: Path, deadline: float, env: dict[str, str]) -> int:
    """Run ``command``, its output to stdout and appended to its log line by line;
    SIGINT at ``deadline``, SIGKILL ``GRACE_SECONDS`` later. Returns the exit status."""
    log = out / command.log
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ {' '.join(command.argv)}", flush=True)
    with open(log, "a") as sink:
        sink.write(f"$ {' '.join(command.argv)}\n")
        proc = subprocess.Popen(
            command.argv,
            cwd=ROOT,
            env={**env, **command.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        stopper = _Stopper(proc, deadline)
        for line in proc.stdout:
            sys.stdout.write(line)
            sink.write(line)
            sink.flush()
        status = proc.wait()
        stopper.cancel()
        if stopper.fired:
            sink.write(f"stopped at the stage's limit of {STAGE_SECONDS} s\n")
    return status


class _Stopper:
    """Interrupts a process group at a deadline, then kills it after a grace period."""

    def __init__(self, proc: subprocess.Popen, deadline: float) -> None:
        self.fired = False
        self._proc = proc
        self._timer = threading.Timer(max(deadline - time.monotonic(), 0), self._stop)
        self._timer.daemon = True
        self._timer.start()

    def _stop(self) -> None:
        self.fired = True
        try:
            os.killpg(self._proc.pid, signal.SIGINT)
            self._proc.wait(GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self) -> None:
        self._timer.cancel()


def _environment(dry: bool) -> dict[str, str]:
    # A stage's commands run as from a shell: not interpreted, and not as a worker of
    # the pytest-xdist run that may have started this one (pytest-benchmark then turns
    # itself off, and --benchmark-only fails).
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_XDIST")
    }
    env["PYTHONUNBUFFERED"] = "1"
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# The versions; then mpgemm.native's C++ list helper, built here once (torch's extension
# cache keeps it for the stage's processes), and whether it built. One process: each
# takes some 4 s to import torch and triton.
_VERSIONS_AND_NATIVE = (
    "import torch, triton, mpgemm; print('torch', torch.__version__, 'triton', "
    "triton.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() "
    "and torch.cuda.get_device_name()); from mpgemm import native; "
    "print('mpgemm C++ list helper:', 'built' if native.native_list_facts() else "
    "'not built: Python passes'); from mpgemm.kernels import native_launch; "
    "print('mpgemm launches from C++ (MPGEMM_NATIVE_LAUNCH):', "
    "'on' if native_launch.enabled() else 'off')"
)


# Wheels carried to the device (the device tool's ``carry``; bench/NOTES.md says how):
# what the test extra needs and the device's image lacks, such as expecttest.
WHEELS = ROOT / ".whl"


def carried_wheels(folder: Path) -> Command | None:
    """The install of the wheels in ``folder`` (from it alone), or None if none."""
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if not wheels:
        return None
    return Command(
        [PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels], "env.txt"
    )


def _set_up(out: Path, dry: bool, env: dict[str, str]) -> bool:
    """Install, check the GPU, write env.txt; False when a step failed."""
    steps = (
        []
        if dry
        else [
            Command(
                [
                    PYTHON,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-build-isolation",
                    "--no-deps",
                    "-e",
                    ".",
                ],
                "env.txt",
            ),
            Command(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total",
                    "--format=csv",
                ],
                "env.txt",
            ),
            Command(
                [
                    PYTHON,
                    "-c",
                    "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'",
                ],
                "env.txt",
            ),
        ]
    )
    steps.append(Command([PYTHON, "-c", _VERSIONS_AND_NATIVE], "env.txt"))
    deadline = time.monotonic() + STAGE_SECONDS
    for step in steps:
        if _run(step, out, deadline, env) != 0:
            print(f"gpu_check: set-up step failed: {' '.join(step.argv)}", file=sys.stderr)
            return False
    carried = None if dry else carried_wheels(WHEELS)
    if carried is not None:  # best effort: without them, the tests that need them skip
        _run(carried, out, deadline, env)
    if dry:
        with open(out / "env.txt", "a") as f:
            f.write("dry run: on the CPU, at toy scale\n")
    return True


def run_stage(stage: Stage, out: Path, dry: bool) -> int:
    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    env = _environment(dry)
    if not _set_up(out, dry, env):
        return 1
    deadline = start + STAGE_SECONDS
    if stage.precompile and not dry:
        # Best effort, and at most half the stage: what it misses compiles in the run.
        ahead_until = min(deadline, start + STAGE_SECONDS / 2)
        for workload in stage.workloads():
            workload.env["MPGEMM_PRECOMPILE"] = "1"
            _run(workload, out, ahead_until, env)
        print(f"gpu_check: compiled ahead in {time.monotonic() - start:.0f} s", flush=True)
    failed = 0
    for command in stage.commands(out, dry):
        failed += _run(command, out, deadline, env) != 0
    print(
        f"gpu_check: stage {stage.name} took {time.monotonic() - start:.0f} s, "
        f"{failed} command(s) failed",
        flush=True,
    )
    return 1 if failed else 0


def plan_stage(stage: Stage) -> tuple[int, int]:
    """(binaries, autotune configs timed) of ``stage`` on a cold cache at GPU sizes."""
    from mpgemm.kernels.launches import count_compiles

    with tempfile.TemporaryDirectory() as tmp:
        records_path = Path(tmp) / "launches.jsonl"
        env = _environment(dry=True)
        env["MPGEMM_RECORD_LAUNCHES"] = str(records_path)
        for workload in stage.workloads():
            done = subprocess.run(
                workload.argv,
                cwd=ROOT,
                env={**env, **workload.env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            # A failed workload stops before its later launches, which go uncounted.
            if done.returncode and stage.workloads_pass:
                print(
                    f"stage {stage.name}: `{' '.join(workload.argv)}` exited with "
                    f"{done.returncode} while recording",
                    flush=True,
                )
        text = records_path.read_text() if records_path.exists() else ""
    records = [json.loads(line) for line in text.splitlines()]
    tuned = {json.dumps(r["tune_key"]): len(r["tiles"]) for r in records if r["tune_key"]}
    return count_compiles(records), sum(n for n in tuned.values() if n > 1)


def plan(names: list[str]) -> int:
    over = 0
    for stage in (STAGES[name] for name in names):
        compiles, tuned = plan_stage(stage)
        estimate = stage.estimate(compiles, tuned)
        over += estimate > STAGE_SECONDS
        print(
            f"stage {stage.name}: {compiles} compiles, {len(stage.files)} files, "
            f"estimate {estimate:.0f} s",
            flush=True,
        )
    return 1 if over else 0


def main(argv: list[str]) -> int:
    names = ", ".join(STAGES)
    planned = argv[:1] == ["plan"] and set(argv[1:]) <= set(STAGES)
    if not planned and (len(argv) != 1 or argv[0] not in STAGES):
        print(f"usage: gpu_check.sh plan [STAGE ...] | STAGE (one of {names})", file=sys.stderr)
        return 2
    if planned:
        return plan(argv[1:] or list(STAGES))
    dry = os.environ.get("GPU_CHECK_DRY_RUN") == "1"
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu_check")
    return run_stage(STAGES[argv[0]], out.resolve(), dry)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
