"""``mpgemm train`` end to end on tiny settings, its results files, its accuracy
against FP32 on the default settings, and its one-line errors."""

import json
import subprocess
import sys

import pytest
import torch

import mpgemm
from mpgemm.app.cli import main
from mpgemm.app.data import load_digits
from mpgemm.app.train import TrainConfig, train

TINY = [
    "--hidden",
    "24,16",
    "--steps",
    "6",
    "--warmup-steps",
    "2",
    "--batch-size",
    "32",
    "--no-progress",
]


@pytest.mark.parametrize("mode", ["fp32", "autocast", "mpgemm"])
def test_each_mode_trains_and_writes_json_and_png(tmp_path, mode, capsys):
    assert main(["train", "--mode", mode, *TINY, "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "test acc %" in table and mode in table
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["config"]["hidden"] == [24, 16] and result["data"]["name"] == "digits"
    (row,) = result["results"]
    assert row["mode"] == mode and row["steps"] == 6 and len(row["losses"]) == 6
    assert all(loss > 0 for loss in row["losses"]) and 0 <= row["test_accuracy"] <= 1
    assert row["ms_per_step"] > 0 and row["skipped_steps"] >= 0
    assert (row["final_loss_scale"] is None) == (mode == "fp32")
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_and_the_json_report_what_was_measured(tmp_path):
    """The table's ``x fp32`` is FP32's time per step over the mode's (above 1: faster
    than FP32), the accuracy in percent, the loss scale and peak memory as measured;
    the JSON has each split's size. (The README's headline reads these files.)"""
    from mpgemm.app.report import format_table, write_json
    from mpgemm.app.train import ModeResult

    def result(mode, ms, accuracy, scale, peak):
        return ModeResult(mode, accuracy, 0.25, ms, 1000 / ms, peak, 1, scale, 4, [1.0] * 4)

    results = [result("fp32", 3.0, 0.5, None, None), result("mpgemm", 1.5, 0.875, 1024.0, 12.4)]
    header, fp32, mpgemm_row = (line.split() for line in format_table(results).splitlines())
    assert header[-2:] == ["x", "fp32"]
    assert fp32 == ["fp32", "50.00", "0.2500", "3.000", "333", "-", "1", "-", "1.00"]
    assert mpgemm_row == ["mpgemm", "87.50", "0.2500", "1.500", "667", "12", "1", "1024", "2.00"]
    # Without an FP32 run (--mode mpgemm) there is no ratio: "-", as for peak memory.
    _, alone = (line.split() for line in format_table(results[1:]).splitlines())
    assert alone == ["mpgemm", "87.50", "0.2500", "1.500", "667", "12", "1", "1024", "-"]
    data = load_digits()
    write_json(tmp_path / "results.json", results, TrainConfig(), data)
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["data"] | {"name": None} == {
        "name": None,
        "train": 1437,
        "test": 360,
        "features": 64,
        "classes": 10,
    }
    assert [r["ms_per_step"] for r in written["results"]] == [3.0, 1.5]


@pytest.mark.parametrize("mode", ["autocast", "mpgemm"])
def test_bfloat16_modes_train_without_loss_scaling(tmp_path, mode, capsys):
    # BF16 has FP32's range: no GradScaler, mpgemm's optimizer unwrapped (torch's and
    # Keras's BF16 recipes), so no loss scale to report and no step to skip.
    argv = ["train", "--mode", mode, *TINY, "--dtype", "bfloat16", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert ", bfloat16, " in capsys.readouterr().out.splitlines()[0]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["config"]["compute_dtype"] == "bfloat16"
    (row,) = result["results"]
    assert row["final_loss_scale"] is None and row["skipped_steps"] == 0
    assert all(0 < loss < 10 for loss in row["losses"])


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_the_hidden_layers_take_the_activation_asked_for(tmp_path, activation, capsys):
    argv = ["train", "--mode", "mpgemm", *TINY, "--activation", activation]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert f"-> 10 ({activation}), batch 32" in capsys.readouterr().out.splitlines()[0]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["config"]["activation"] == activation
    (row,) = result["results"]
    assert all(0 < loss < 10 for loss in row["losses"])
    # Converted, each hidden layer computes its activation in its epilogue.
    from mpgemm.app.train import ACTIVATIONS, Recipe, build_mlp

    model = build_mlp(8, (8, 8), 10, ACTIVATIONS[activation])
    Recipe("mpgemm", model, TrainConfig(hidden=(8, 8), activation=activation))
    assert [getattr(layer, "activation", None) for layer in model][::2] == [
        activation,
        activation,
        None,
    ]


def test_a_bfloat16_recipe_computes_in_bfloat16_unscaled():
    from mpgemm.app.train import Recipe, build_mlp

    config = TrainConfig(hidden=(16,), compute_dtype="bfloat16")
    mixed = Recipe("mpgemm", build_mlp(8, (16,), 4), config)
    assert [layer.compute_dtype for layer in mixed.model[::2]] == [torch.bfloat16] * 2
    assert isinstance(mixed.optimizer, mpgemm.optim.Adam) and mixed.loss_scale() is None
    autocast = Recipe("autocast", build_mlp(8, (16,), 4), config)
    assert autocast.scaler is None and autocast.compute_dtype == torch.bfloat16
    assert Recipe("mpgemm", build_mlp(8, (16,), 4), TrainConfig()).scales_loss
    with pytest.raises(ValueError, match="compute_dtype must be one of float16, bfloat16"):
        TrainConfig(compute_dtype="float32")


def test_all_modes_on_synthetic_data_through_python_m(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpgemm",
            "train",
            "--data",
            "synthetic",
            "--features",
            "20",
            "--samples",
            "200",
            *TINY,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    # The default device is the GPU where there is one, which adds the graphed step.
    modes = ["fp32", "autocast", "mpgemm"]
    if torch.cuda.is_available():
        modes.append("mpgemm_cuda_graph")
    assert [line.split()[0] for line in run.stdout.splitlines()[2 : 2 + len(modes)]] == modes
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in result["results"]] == modes
    assert result["data"]["features"] == 20


def test_default_settings_mpgemm_within_one_point_of_fp32(monkeypatch):
    """The default run (digits, 64 -> 256 -> 256 -> 10, 20 epochs of Adam). On the CPU
    mpgemm runs its reference implementation here (460 interpreted steps would take
    minutes); the kernels' agreement with it is tested elsewhere."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fp32, mixed = train(load_digits(), TrainConfig(), ("fp32", "mpgemm"), progress=False)
    assert fp32.test_accuracy > 0.95, fp32
    assert abs(mixed.test_accuracy - fp32.test_accuracy) <= 0.01, (mixed, fp32)
    assert mixed.skipped_steps == 0 and mixed.final_loss_scale == 65536.0


def _error_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--mode", "fp8"], "invalid choice: 'fp8'"),
        (["train", "--hidden", "256,0"], "'256,0' is not a comma-separated list of positive"),
        (["train", "--hidden", "wide"], "'wide' is not a comma-separated list"),
        (["train", "--batch-size", "-3"], "'-3' is not a positive integer"),
        (["train", "--steps", "ten"], "'ten' is not a positive integer"),
        (["train", "--data", "/nonexistent/mnist.npz"], "no such file or folder"),
        (["train", "--lr", "-1"], "lr must be a positive number"),
        (["train", "--activation", "tanh"], "invalid choice: 'tanh'"),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(argv, message, capsys):
    assert message in _error_line(argv, capsys)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(hidden=()), "hidden widths must be positive integers"),
        (dict(hidden=(8, 0)), "hidden widths must be positive integers"),
        (dict(hidden=(8.0,)), "hidden widths must be positive integers"),
        (dict(batch_size=0), "batch_size must be at least 1"),
        (dict(epochs=0), "epochs must be at least 1"),
        (dict(steps=0), "steps must be at least 1"),
        (dict(lr=float("inf")), "lr must be a positive number"),
        (dict(activation="tanh"), "activation must be one of"),
        (dict(optimizer="lion"), "optimizer must be one of"),
        (dict(warmup_steps=-1), "warmup_steps must be >= 0"),
        (dict(compute_dtype="float8"), "compute_dtype must be one of"),
        (dict(device="meta"), "device must be cpu or cuda"),
    ],
)
def test_a_train_config_refuses_bad_settings_by_name(options, message):
    # What the command's parser refuses before, refused again for Python callers
    # (bench/ and tests build configs directly).
    with pytest.raises(ValueError, match=message):
        TrainConfig(**options)


def test_malformed_data_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "mnist.npz"
    bad.write_bytes(b"PK\x03\x04 broken")
    assert "not a readable .npz file" in _error_line(["train", "--data", str(bad)], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_one_line(capsys):
    assert "CUDA is not available" in _error_line(["train", "--device", "cuda"], capsys)


def test_a_file_that_is_no_npz_says_so(tmp_path, capsys):
    # numpy takes any non-zip file for a pickle ("contains pickled (object) data").
    bad = tmp_path / "mnist.npz"
    bad.write_text("hello, not a zip archive")
    line = _error_line(["train", "--data", str(bad)], capsys)
    assert "not an .npz file (not a zip archive" in line and "pickle" not in line


def test_threads_sets_torchs_and_the_title_says_so(capsys):
    before = torch.get_num_threads()
    try:
        assert main(["train", "--mode", "fp32", *TINY, "--device", "cpu", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "cpu, 1 thread\n" in capsys.readouterr().out


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys):
    # Without --no-progress: a captured log gets no bar (tqdm's redraws flooded it).
    assert main(["train", "--mode", "fp32", *[a for a in TINY if a != "--no-progress"]]) == 0
    assert "step" not in capsys.readouterr().err


def test_the_modes_take_turns_and_time_per_step_is_the_median(monkeypatch):
    # The modes ran one after another, so a change of load between them reversed the
    # comparison (FP32 56 ms/step against mpgemm's 8 at a load of 2): now they take
    # turns, a window each, the first in turn rotating, and each reports the median.
    from mpgemm.app import train as train_module
    from mpgemm.app.data import load

    turns = []
    real_run = train_module._Run.run

    def run(self, window, timed):
        turns.append((self.mode, len(window), timed))
        real_run(self, window, timed)

    monkeypatch.setattr(train_module._Run, "run", run)
    config = train_module.TrainConfig(hidden=(8,), batch_size=16, steps=12, warmup_steps=2)
    results = train_module.train(load("digits"), config, progress=False)
    modes = list(train_module.modes_on("cpu"))
    assert turns[:3] == [(m, 2, False) for m in modes]  # the warm-up, untimed
    timed = [t for t in turns if t[2]]
    assert len(timed) == 10 * 3 and all(n == 1 for _, n, _ in timed)
    # Window k starts with mode k mod 3.
    assert [timed[3 * k][0] for k in range(3)] == modes[1:] + modes[:1]
    assert all(r.steps == 12 and len(r.losses) == 12 for r in results)


def test_samples_per_second_counts_the_samples_each_step_trained_on(monkeypatch):
    """A batch larger than the training set trains on the whole set: throughput counts
    the samples each timed window really took, not ``batch_size`` per step (which
    overstated it 28x here, the digits' 1437 training samples against 40000)."""
    from mpgemm.app import train as train_module
    from mpgemm.app.data import load

    clock = iter(range(10_000))  # each perf_counter reading one second after the last
    monkeypatch.setattr(train_module.time, "perf_counter", lambda: float(next(clock)))
    data = load("digits")
    config = TrainConfig(hidden=(8,), batch_size=40_000, steps=3, warmup_steps=1)
    (result,) = train(data, config, modes=("fp32",), progress=False)
    # Each timed window: one step, one second.
    assert result.ms_per_step == 1000.0
    assert result.samples_per_s == len(data.x_train)


def test_each_epoch_visits_every_sample_once_in_batches_of_its_size():
    """10 samples in batches of 4 over 3 epochs: 9 batches, each epoch 4, 4 and 2
    samples, together every sample once, in an order of its own."""
    from mpgemm.app.data import Dataset
    from mpgemm.app.train import _batches

    x, y = torch.zeros(10, 3), torch.zeros(10, dtype=torch.int64)
    data = Dataset("ten", x, y, x, y, num_classes=2)
    batches = _batches(data, TrainConfig(batch_size=4, epochs=3))
    assert [len(b) for b in batches] == [4, 4, 2] * 3
    epochs = [torch.cat(batches[i : i + 3]) for i in (0, 3, 6)]
    assert all(sorted(e.tolist()) == list(range(10)) for e in epochs)
    assert len({tuple(e.tolist()) for e in epochs}) == 3


@pytest.mark.parametrize("mode", ["autocast", "mpgemm"])
def test_a_step_its_scaler_skipped_is_counted(mode):
    """A batch holding an inf makes every gradient NaN: torch's scaler (autocast) and
    mpgemm's LossScaleOptimizer each skip the step, and the recipe counts it."""
    from mpgemm.app.train import Recipe, build_mlp

    torch.manual_seed(0)
    recipe = Recipe(mode, build_mlp(8, (8,), 10), TrainConfig(hidden=(8,), batch_size=4))
    x, y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    recipe.step(x, y)
    x[0, 0] = float("inf")
    recipe.step(x, y)
    assert recipe.skipped_steps(2) == 1


def test_windows_cover_every_step_once():
    from mpgemm.app.train import _windows

    for steps, warmup in ((12, 2), (200, 10), (5, 10), (1, 0), (37, 3)):
        covered = [i for window, _ in _windows(steps, warmup) for i in window]
        assert covered == list(range(steps)), (steps, warmup)


def test_the_figure_adds_a_panel_of_differences_from_fp32(tmp_path):
    # Coinciding loss curves hid any difference: with FP32 and another mode, a middle
    # panel plots each mode's loss minus FP32's (5.5 inches a panel at 120 dpi).
    import struct

    from mpgemm.app.report import write_figure

    config = TrainConfig(hidden=(8,), batch_size=16, steps=8, warmup_steps=2)
    results = train(load_digits(), config, progress=False)
    widths = []
    for chosen in (results, results[:1]):
        path = tmp_path / f"{len(chosen)}.png"
        write_figure(path, chosen, "title")
        widths.append(struct.unpack(">I", path.read_bytes()[16:20])[0])
    assert widths == [3 * 660, 2 * 660]


_WITHOUT_THE_TRAIN_EXTRA = """
import importlib.abc, importlib.machinery, sys
class Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # Importing these fails as if they were not installed.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("sklearn", "tqdm", "matplotlib"):
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r}", name=spec.name)
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Absent())
"""


def _run_without_the_train_extra(code: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_THE_TRAIN_EXTRA + code],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_library_needs_none_of_the_train_extra():
    # pip install mpgemm (no extras): import mpgemm and train a step with it.
    run = _run_without_the_train_extra(
        "import torch, mpgemm\n"
        "layer = mpgemm.Linear(8, 4)\n"
        "opt = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(layer.parameters()))\n"
        "opt.scale_loss(layer(torch.randn(2, 8)).float().sum()).backward()\n"
        "opt.step()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('sklearn', 'tqdm', 'matplotlib')))\n"
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_the_command_says_to_install_the_train_extra():
    run = _run_without_the_train_extra(
        "from mpgemm.app.cli import main\nsys.exit(main(['train', '--steps', '2']))\n"
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == [
        "mpgemm train: error: needs scikit-learn, tqdm, matplotlib (the train extra): "
        "pip install 'mpgemm[train]'"
    ]


def test_the_package_has_its_installed_version():
    import importlib.metadata

    import mpgemm

    assert mpgemm.__version__ == importlib.metadata.version("mpgemm")
