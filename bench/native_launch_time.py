"""Host time of replayed launches by Triton's launcher and by the C++ plans
(``mpgemm.kernels.native_launch``), on a machine without a GPU: under the stand-in CUDA
driver of the tests (``tests/fake_driver.py``), the kernels compile for an H100 and every
launch goes through Triton's real launchers, or the plans, into a driver that runs
nothing. So what is timed is everything of the host's but the driver's own work (on the
H200's host, cuLaunchKernelEx took 6 to 14 us a call: profile_gpu.py's ``idle``).

    python3 bench/native_launch_time.py [--rounds 5]
    python3 bench/native_launch_time.py --smoke   # one round of few calls (the test's)

Prints microseconds per call (the best of each mode's rounds; the two modes take turns
in one process) for a replayed 512^2 ``mpgemm.matmul`` (the TMA kernel) and an
unaligned one (the pointer kernel), each also along its full path (without its replay
from the entry, ``functional._replay_key``: its checks and layers down to
``triton_gemm``'s replay), an ``mpgemm.Linear(512, 512, activation="relu")`` forward and
backward at batch 256, and the tiny (8-8-10, batch 4) and small (784-128-10, batch 128)
MLPs' training steps, whose other launches (the cross-entropy, the optimizer's) use
Triton's launcher either way. Needs gcc (the stand-in is built first)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(rounds: int, smoke: bool) -> None:
    sys.path.insert(0, str(REPO))
    from tests import fake_driver

    fake_driver.activate()
    import torch
    from host_time import best_us, full_path

    import mpgemm
    from mpgemm.app.train import Recipe, TrainConfig, build_mlp
    from mpgemm.kernels import native_launch

    f16 = torch.float16
    torch.manual_seed(0)
    a, b = torch.randn(512, 512, dtype=f16), torch.randn(512, 512, dtype=f16)
    odd_a, odd_b = torch.randn(500, 509, dtype=f16), torch.randn(509, 500, dtype=f16)
    layer = mpgemm.Linear(512, 512, activation="relu")
    x = torch.randn(256, 512)
    tiny = Recipe("mpgemm", build_mlp(8, (8,), 10), TrainConfig(hidden=(8,), batch_size=4))
    tiny_batch = torch.randn(4, 8), torch.randint(0, 10, (4,))
    small = Recipe("mpgemm", build_mlp(784, (128,), 10), TrainConfig(hidden=(128,)))
    small_batch = torch.randn(128, 784), torch.randint(0, 10, (128,))

    cases = {
        "matmul 512^2 fp16 (TMA)": (lambda: mpgemm.matmul(a, b), 2000),
        "matmul 512^2 fp16 (TMA), full path": (full_path(lambda: mpgemm.matmul(a, b)), 2000),
        "matmul 500x509x500 fp16 (pointer)": (lambda: mpgemm.matmul(odd_a, odd_b), 2000),
        "matmul 500x509x500 fp16 (pointer), full path": (
            full_path(lambda: mpgemm.matmul(odd_a, odd_b)),
            2000,
        ),
        "Linear relu forward+backward": (lambda: layer(x).sum().backward(), 300),
        "tiny MLP step": (lambda: tiny.step(*tiny_batch), 300),
        "small MLP step": (lambda: small.step(*small_batch), 100),
    }
    for fn, _ in cases.values():  # compiled, replayed, planned
        for _ in range(5):
            fn()
    repeats = 1 if smoke else 5
    times: dict[str, dict[bool, list[float]]] = {name: {False: [], True: []} for name in cases}
    for _ in range(rounds):
        for native in (False, True):
            native_launch._ENABLED = native
            for name, (fn, calls) in cases.items():
                times[name][native].append(best_us(fn, 2 if smoke else calls, rounds=repeats))
    print("| host us, stand-in driver | Triton's launcher | C++ plans | ratio |")
    print("| --- | --- | --- | --- |")
    for name, measured in times.items():
        off, on = min(measured[False]), min(measured[True])
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x |", flush=True)


def main() -> None:
    smoke = "--smoke" in sys.argv
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    rounds = 1 if smoke else rounds
    if "--measure" in sys.argv:
        measure(rounds, smoke)
        return
    sys.path.insert(0, str(REPO))
    from tests import fake_driver

    with tempfile.TemporaryDirectory() as folder:
        fake_driver.build(Path(folder))
        env = fake_driver.environment(
            Path(folder),
            MPGEMM_SINGLE_CONFIG="1",
            MPGEMM_NATIVE_LAUNCH="1",
            TRITON_DEFAULT_FP_FUSION="1",
        )
        command = [sys.executable, __file__, "--measure", "--rounds", str(rounds)]
        command += ["--smoke"] if smoke else []
        subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
