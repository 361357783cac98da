"""The data loaders of ``mpgemm train`` on small files the tests write: Keras's
mnist.npz, IDX files plain and gzipped, and malformed files of each kind."""

import gzip

import numpy as np
import pytest
import torch

from mpgemm.app.data import DataError, load, load_digits, load_mnist, synthetic


def _images(n, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 4, 5), dtype=np.uint8), rng.integers(
        0, 10, size=n, dtype=np.uint8
    )


def _idx_bytes(array: np.ndarray) -> bytes:
    magic = 0x0800 + array.ndim
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_idx(folder, gz=False, corrupt=None):
    (xtr, ytr), (xte, yte) = _images(12, 0), _images(5, 1)
    files = {
        "train-images-idx3-ubyte": xtr,
        "train-labels-idx1-ubyte": ytr,
        "t10k-images-idx3-ubyte": xte,
        "t10k-labels-idx1-ubyte": yte,
    }
    for name, array in files.items():
        raw = _idx_bytes(array)
        if corrupt == name:
            raw = raw[:-3]  # truncated
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(raw))
        else:
            (folder / name).write_bytes(raw)
    return xtr, ytr, xte, yte


@pytest.mark.parametrize("gz", [False, True])
def test_idx_folder_plain_and_gzipped(tmp_path, gz):
    xtr, ytr, xte, yte = _write_idx(tmp_path, gz=gz)
    data = load_mnist(tmp_path)
    assert data.x_train.shape == (12, 20) and data.x_test.shape == (5, 20)
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    torch.testing.assert_close(data.x_train, torch.tensor(xtr.reshape(12, 20) / 255.0).float())
    assert data.y_test.tolist() == yte.tolist()
    assert data.num_classes == max(ytr.max(), yte.max()) + 1


def test_keras_npz(tmp_path):
    (xtr, ytr), (xte, yte) = _images(10, 2), _images(4, 3)
    path = tmp_path / "mnist.npz"
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    data = load(str(path))
    assert data.x_train.shape == (10, 20) and float(data.x_train.max()) <= 1.0
    assert data.y_train.tolist() == ytr.tolist()


def test_malformed_files_name_the_file_and_fault(tmp_path):
    _write_idx(tmp_path, corrupt="t10k-labels-idx1-ubyte")
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte: header says shape \(5,\)"):
        load_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x03" + b"\x00" * 20)
    with pytest.raises(DataError, match="magic number 0x00000803, expected 0x00000801"):
        load_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="no t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path)
    bad = tmp_path / "bad.npz"
    np.savez(bad, x_train=np.zeros((3, 2, 2)), y_train=np.zeros(3))
    with pytest.raises(DataError, match="missing array.*x_test, y_test"):
        load_mnist(bad)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file")
    with pytest.raises(DataError, match="garbage.npz: not an .npz file .not a zip archive"):
        load_mnist(garbage)
    mismatched = tmp_path / "mismatched.npz"
    np.savez(
        mismatched,
        x_train=np.zeros((3, 2, 2)),
        y_train=np.zeros(4),
        x_test=np.zeros((2, 2, 2)),
        y_test=np.zeros(2),
    )
    with pytest.raises(DataError, match="3 training images but 4 labels"):
        load_mnist(mismatched)
    with pytest.raises(DataError, match="no such file or folder"):
        load_mnist(tmp_path / "absent")
    flat = tmp_path / "flat.npz"
    np.savez(flat, x_train=np.zeros(3), y_train=np.zeros(3), x_test=np.zeros(2), y_test=np.zeros(2))
    with pytest.raises(DataError, match=r"x_train has shape \(3,\), expected images"):
        load_mnist(flat)
    # An IDX file shorter than its header; a gzipped one that is not gzip.
    _write_idx(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00")
    with pytest.raises(DataError, match="6 bytes, too short for an IDX header"):
        load_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: cannot read"):
        load_mnist(tmp_path)


def test_float_images_are_taken_as_they_are_and_bad_splits_refused(tmp_path):
    """Images stored as floats (already in [0, 1]) are not divided by 255 again; a split
    with no images, or train and test images of different shapes, are refused."""
    (xtr, ytr), (xte, yte) = _images(10, 2), _images(4, 3)
    path = tmp_path / "floats.npz"
    np.savez(path, x_train=xtr / 255.0, y_train=ytr, x_test=xte / 255.0, y_test=yte)
    data = load_mnist(path)
    torch.testing.assert_close(data.x_train, torch.tensor(xtr.reshape(10, 20) / 255.0).float())
    for name, arrays, message in [
        ("empty_test", dict(x_test=xte[:0], y_test=yte[:0]), "empty train or test split"),
        ("shapes", dict(x_test=np.zeros((4, 5, 4), np.uint8)), r"train images \(4, 5\) and test"),
    ]:
        bad = tmp_path / f"{name}.npz"
        np.savez(bad, **{"x_train": xtr, "y_train": ytr, "x_test": xte, "y_test": yte, **arrays})
        with pytest.raises(DataError, match=message):
            load_mnist(bad)


def test_digits_split_is_fixed_and_synthetic_has_its_size():
    a, b = load_digits(), load_digits()
    assert a.x_train.shape == (1437, 64) and a.x_test.shape == (360, 64)
    assert torch.equal(a.y_test, b.y_test) and a.num_classes == 10
    # Stratified: each class's share of the test split is its share of the whole, to
    # one sample (random_state=0 unstratified is off by 8.7 samples for one class).
    counts = [torch.bincount(y, minlength=10) for y in (a.y_train, a.y_test)]
    whole = counts[0] + counts[1]
    assert ((counts[1] - whole * 360 / 1797).abs() <= 1).all(), counts[1]
    assert float(a.x_train.max()) == 1.0
    data = synthetic(12, 100, seed=3)
    assert data.x_train.shape == (80, 12) and data.x_test.shape == (20, 12)
    assert torch.equal(data.y_test, synthetic(12, 100, seed=3).y_test)
    with pytest.raises(DataError, match="samples >= 10"):
        synthetic(12, 5)
