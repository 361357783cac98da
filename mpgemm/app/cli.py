"""The ``mpgemm`` command (also ``python -m mpgemm``).

    mpgemm train [--mode fp32|autocast|mpgemm|mpgemm_cuda_graph|all] [--hidden 256,256]
                 [--data PATH] [--batch-size 64] [--epochs 20 | --steps N] [--lr 1e-3]
                 [--optimizer adam|sgd] [--seed 0] [--device cpu|cuda] [--out DIR]

Bad input ends with one line on stderr naming the problem and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import NoReturn

import torch

from mpgemm.app.data import Dataset, load
from mpgemm.app.train import (
    ACTIVATIONS,
    COMPUTE_DTYPES,
    MODES,
    OPTIMIZERS,
    TrainConfig,
    check_modes,
    modes_on,
    train,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or any(w < 1 for w in widths):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of positive integers"
        )
    return widths


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpgemm", description="mpgemm: mixed-precision GEMMs for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    t = commands.add_parser(
        "train",
        help="train an MLP in FP32, with torch.autocast and with mpgemm",
        description="Train the same MLP, from the same weights on the same batches, in "
        "FP32, with torch.autocast + GradScaler, and with mpgemm (convert + "
        "LossScaleOptimizer; on CUDA also with its step replayed as a CUDA graph, "
        "mpgemm_cuda_graph); print a table of accuracy, loss and speed.",
    )
    t.add_argument("--mode", choices=[*MODES, "all"], default="all")
    t.add_argument(
        "--hidden",
        type=_widths,
        default=(256, 256),
        help="hidden widths, comma-separated (default 256,256)",
    )
    t.add_argument(
        "--data",
        default="digits",
        help="'digits' (scikit-learn's, default), 'synthetic', or MNIST: a "
        "mnist.npz file or a folder of IDX files",
    )
    t.add_argument(
        "--features", type=_positive_int, default=784, help="synthetic data: features per sample"
    )
    t.add_argument(
        "--samples", type=_positive_int, default=60_000, help="synthetic data: number of samples"
    )
    t.add_argument("--batch-size", type=_positive_int, default=64)
    t.add_argument("--epochs", type=_positive_int, default=20)
    t.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="train this many steps instead of --epochs",
    )
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    t.add_argument(
        "--dtype",
        choices=list(COMPUTE_DTYPES),
        default="float16",
        help="the mixed-precision modes' 16-bit dtype (default float16, with loss "
        "scaling; bfloat16 has FP32's range and trains without)",
    )
    t.add_argument(
        "--activation",
        choices=list(ACTIVATIONS),
        default="relu",
        help="the hidden layers' activation (default relu; gelu_tanh: GELU's tanh form)",
    )
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=default_device,
        help=f"default: {default_device}",
    )
    t.add_argument(
        "--warmup-steps", type=int, default=10, help="steps left out of the timing (default 10)"
    )
    t.add_argument("--out", type=Path, help="write results.json and results.png here")
    t.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none when stderr is not a terminal)",
    )
    t.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help=f"CPU threads for torch (default: torch's, {torch.get_num_threads()} here)",
    )
    return parser


def _prepare(args: argparse.Namespace) -> tuple[TrainConfig, Dataset]:
    """The configuration and the data, or an error naming what is wrong with them."""
    config = TrainConfig(
        hidden=args.hidden,
        batch_size=args.batch_size,
        epochs=args.epochs,
        steps=args.steps,
        lr=args.lr,
        optimizer=args.optimizer,
        seed=args.seed,
        device=args.device,
        warmup_steps=args.warmup_steps,
        compute_dtype=args.dtype,
        activation=args.activation,
    )
    if args.mode != "all":
        check_modes((args.mode,), config.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    data = load(args.data, features=args.features, samples=args.samples, seed=args.seed)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    return config, data


def _threads(n: int) -> str:
    return f"{n} thread" + ("s" if n != 1 else "")


def _train(args: argparse.Namespace, config: TrainConfig, data: Dataset) -> None:
    modes = modes_on(config.device) if args.mode == "all" else (args.mode,)
    widths = " -> ".join(map(str, (data.features, *config.hidden, data.num_classes)))
    if config.activation != "relu":
        widths += f" ({config.activation})"
    device = (
        torch.cuda.get_device_name(config.device)
        if config.device == "cuda"
        else f"cpu, {_threads(torch.get_num_threads())}"
    )
    title = (
        f"{data.name}: MLP {widths}, batch {config.batch_size}, {config.optimizer}, "
        f"{config.compute_dtype}, {device}"
    )
    print(title, flush=True)
    results = train(data, config, modes, progress=not args.no_progress)
    from mpgemm.app.report import format_table, write_figure, write_json

    print(format_table(results))
    if args.out is not None:
        write_json(args.out / "results.json", results, config, data)
        write_figure(args.out / "results.png", results, title)
        print(f"wrote {args.out / 'results.json'} and {args.out / 'results.png'}")


# The train extra, by module: the pip names to install.
_EXTRA = {"sklearn": "scikit-learn", "tqdm": "tqdm", "matplotlib": "matplotlib"}


def _missing_extra() -> list[str]:
    missing = []
    for module, name in _EXTRA.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    missing = _missing_extra()
    if missing:
        print(
            f"mpgemm {args.command}: error: needs {', '.join(missing)} (the train extra): "
            "pip install 'mpgemm[train]'",
            file=sys.stderr,
        )
        return 2
    try:
        config, data = _prepare(args)
    except (ValueError, OSError) as e:  # DataError is a ValueError
        print(f"mpgemm {args.command}: error: {e}", file=sys.stderr)
        return 2
    _train(args, config, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
