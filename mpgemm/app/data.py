"""Data sets for ``mpgemm train``, all available offline.

- ``load_digits()``: the 8x8 handwritten digits that ship inside scikit-learn (1,797
  images, 10 classes), with a fixed stratified 80/20 split.
- ``load_mnist(path)``: MNIST from local files, either Keras's ``mnist.npz`` (arrays
  ``x_train``, ``y_train``, ``x_test``, ``y_test``) or a folder with the four IDX files
  (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
  ``t10k-labels-idx1-ubyte``, each optionally ``.gz``).
- ``synthetic(features, samples)``: Gaussian inputs labelled by a random linear
  teacher, for throughput runs at any size.

Features come as FP32 in [0, 1] (images) or N(0, 1) (synthetic), labels as int64.
Malformed input raises ``DataError`` (a ``ValueError``) naming the file and the fault.
"""

from __future__ import annotations

import gzip
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["DataError", "Dataset", "load", "load_digits", "load_mnist", "synthetic"]

_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
# IDX magic numbers: 0x08 (unsigned byte) data, then the number of dimensions.
_IDX_MAGIC = {1: 0x00000801, 3: 0x00000803}


class DataError(ValueError):
    """A data file is missing or malformed."""


@dataclass(frozen=True)
class Dataset:
    """Train and test splits: ``x_*`` (N, features) FP32, ``y_*`` (N,) int64 in
    ``[0, num_classes)``."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def features(self) -> int:
        return self.x_train.shape[1]


def _dataset(name, x_train, y_train, x_test, y_test, num_classes=None) -> Dataset:
    tensors = [torch.as_tensor(np.ascontiguousarray(a)) for a in (x_train, y_train, x_test, y_test)]
    x_train, y_train, x_test, y_test = tensors
    if len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise DataError(
            f"{name}: {len(x_train)} training images but {len(y_train)} labels, "
            f"{len(x_test)} test images but {len(y_test)} labels"
        )
    if len(x_train) == 0 or len(x_test) == 0:
        raise DataError(f"{name}: empty train or test split")
    classes = num_classes or int(max(y_train.max(), y_test.max())) + 1
    return Dataset(
        name,
        x_train.reshape(len(x_train), -1).float(),
        y_train.long(),
        x_test.reshape(len(x_test), -1).float(),
        y_test.long(),
        classes,
    )


def load_digits() -> Dataset:
    """scikit-learn's digits, pixels scaled from 0..16 to [0, 1], split 80/20
    (stratified, ``random_state=0``)."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0,
        digits.target,
        test_size=0.2,
        random_state=0,
        stratify=digits.target,
    )
    return _dataset("digits", x_train, y_train, x_test, y_test, num_classes=10)


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path}: {len(raw)} bytes, too short for an IDX header")
    magic = int.from_bytes(raw[:4], "big")
    if magic != _IDX_MAGIC[ndim]:
        raise DataError(
            f"{path}: IDX magic number {magic:#010x}, expected {_IDX_MAGIC[ndim]:#010x} "
            f"(unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''})"
        )
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise DataError(f"{path}: header says shape {shape}, but holds {data.size} values")
    return data.reshape(shape)


def _find_idx(folder: Path, stem: str) -> Path:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(f"{folder}: no {stem} (or {stem}.gz)")


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    # An .npz is a zip archive; numpy takes anything else for a pickle and says so,
    # which names the wrong fault.
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    if magic[:2] != b"PK":
        raise DataError(
            f"{path}: not an .npz file (not a zip archive: starts with "
            f"{magic!r}); expected Keras's mnist.npz or a folder of IDX files"
        )
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in _IDX_FILES if k not in npz.files]
            if missing:
                raise DataError(
                    f"{path}: missing array(s) {', '.join(missing)} (has {', '.join(npz.files)})"
                )
            return {k: npz[k] for k in _IDX_FILES}
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a readable .npz file: {e}") from None


def load_mnist(path: str | Path) -> Dataset:
    """MNIST from ``mnist.npz`` or a folder of IDX files; pixels scaled to [0, 1]."""
    path = Path(path)
    if path.is_dir():
        arrays = {
            key: _read_idx(_find_idx(path, stem), 3 if key.startswith("x") else 1)
            for key, stem in _IDX_FILES.items()
        }
    elif path.is_file():
        arrays = _load_npz(path)
    else:
        raise DataError(f"{path}: no such file or folder")
    for key in ("x_train", "x_test"):
        if arrays[key].ndim < 2:
            raise DataError(f"{path}: {key} has shape {arrays[key].shape}, expected images")
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        raise DataError(
            f"{path}: train images {arrays['x_train'].shape[1:]} and test images "
            f"{arrays['x_test'].shape[1:]} differ in shape"
        )
    scale = 255.0 if arrays["x_train"].dtype == np.uint8 else 1.0
    return _dataset(
        f"mnist ({path.name})",
        arrays["x_train"] / scale,
        arrays["y_train"],
        arrays["x_test"] / scale,
        arrays["y_test"],
    )


def synthetic(features: int, samples: int, *, classes: int = 10, seed: int = 0) -> Dataset:
    """``samples`` Gaussian vectors of ``features``, labelled by the argmax of a random
    linear teacher; the last fifth is the test split."""
    if features < 1 or samples < 10:
        raise DataError(
            f"synthetic data needs features >= 1 and samples >= 10, got {features} and {samples}"
        )
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(dim=1)
    split = samples - samples // 5
    return _dataset(
        f"synthetic {samples}x{features}",
        x[:split],
        y[:split],
        x[split:],
        y[split:],
        num_classes=classes,
    )


def load(spec: str | None, *, features: int = 784, samples: int = 60_000, seed: int = 0) -> Dataset:
    """``None`` or ``"digits"``: the digits; ``"synthetic"``: ``synthetic(features,
    samples)``; anything else: a path for ``load_mnist``."""
    if spec in (None, "digits"):
        return load_digits()
    if spec == "synthetic":
        return synthetic(features, samples, seed=seed)
    return load_mnist(spec)
