"""Bad input gets a clear error naming the shapes, dtypes or devices at fault."""

import warnings

import pytest
import torch

import mpgemm


def test_incompatible_shapes_name_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 5\)"):
        mpgemm.matmul(torch.randn(2, 3), torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4, 5\)"):
        mpgemm.matmul(torch.randn(2, 3), torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(4, 5\)"):
        mpgemm.linear(torch.randn(2, 3), torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"bias of shape \(5,\)"):
        mpgemm.linear(torch.randn(2, 3), torch.randn(4, 3), torch.randn(5))
    with pytest.raises(ValueError):
        mpgemm.linear(torch.tensor(1.0), torch.randn(4, 1))


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.complex64, torch.bool])
def test_unsupported_input_dtypes_raise_type_error(dtype):
    bad = torch.ones(2, 3, dtype=dtype)
    with pytest.raises(TypeError, match=str(dtype)):
        mpgemm.matmul(bad, torch.randn(3, 4))
    with pytest.raises(TypeError, match=str(dtype)):
        mpgemm.linear(torch.randn(2, 3), torch.ones(4, 3, dtype=dtype))


# Not a dtype at all: a tensor (whose truth value, read as a default's test, raised a
# RuntimeError), a dtype's name, a number.
NOT_DTYPES = [torch.ones(2, 2), torch.ones(()), "float16", 16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, *NOT_DTYPES])
def test_compute_dtype_must_be_16_bit(dtype):
    with pytest.raises(TypeError, match="compute_dtype"):
        mpgemm.matmul(torch.randn(2, 3), torch.randn(3, 4), compute_dtype=dtype)
    with pytest.raises(TypeError, match="mpgemm.linear: compute_dtype"):
        mpgemm.linear(torch.randn(2, 3), torch.randn(4, 3), compute_dtype=dtype)
    with pytest.raises(TypeError, match="mpgemm.Linear: compute_dtype"):
        mpgemm.Linear(3, 4, compute_dtype=dtype)
    # convert names itself, also for a model with no nn.Linear to hand the value to.
    for model in (torch.nn.Linear(3, 4), torch.nn.Sequential(torch.nn.ReLU())):
        with pytest.raises(TypeError, match="mpgemm.convert: compute_dtype"):
            mpgemm.convert(model, compute_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, *NOT_DTYPES])
def test_out_dtype_must_be_a_float_type_we_store(dtype):
    with pytest.raises(TypeError, match="mpgemm.matmul: out_dtype"):
        mpgemm.matmul(torch.randn(2, 3), torch.randn(3, 4), out_dtype=dtype)
    with pytest.raises(TypeError, match="mpgemm.linear: out_dtype"):
        mpgemm.linear(torch.randn(2, 3), torch.randn(4, 3), out_dtype=dtype)


@pytest.mark.parametrize("model", [None, torch.ones(2, 2), [torch.nn.Linear(2, 2)]])
def test_convert_takes_a_module(model):
    with pytest.raises(TypeError, match="mpgemm.convert: module must be a torch.nn.Module"):
        mpgemm.convert(model)
    with pytest.raises(TypeError, match="from_linear: module must be a torch.nn.Linear"):
        mpgemm.Linear.from_linear(model)
    with pytest.raises(TypeError, match="from_linear: module must be a torch.nn.Linear, got ReLU"):
        mpgemm.Linear.from_linear(torch.nn.ReLU())


def test_tensors_on_different_devices_name_the_devices():
    with pytest.raises(ValueError, match="a on cpu, b on meta"):
        mpgemm.matmul(torch.randn(2, 3), torch.randn(3, 4, device="meta"))
    with pytest.raises(ValueError, match="bias on meta"):
        mpgemm.linear(torch.randn(2, 3), torch.randn(4, 3), torch.randn(4, device="meta"))


def test_unknown_activation_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"'swish'.*None, 'relu', 'gelu'"):
        mpgemm.linear(torch.randn(2, 3), torch.randn(4, 3), activation="swish")


def test_non_tensor_argument():
    with pytest.raises(TypeError, match="list"):
        mpgemm.matmul([[1.0]], torch.randn(1, 1))


def test_missing_and_sparse_operands_raise_type_error_naming_them():
    w = torch.randn(4, 3)
    with pytest.raises(TypeError, match="a must be a torch.Tensor, got NoneType"):
        mpgemm.matmul(None, w.t())
    with pytest.raises(TypeError, match="weight must be a torch.Tensor, got NoneType"):
        mpgemm.linear(torch.randn(2, 3), None)
    with pytest.raises(TypeError, match="b is a torch.sparse_coo tensor"):
        mpgemm.matmul(torch.randn(2, 3), w.t().to_sparse())
    # A nested tensor is strided too, with no sizes of its own to check (which raised
    # torch's "Internal error: NestedTensorImpl doesn't support sizes").
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    with pytest.raises(TypeError, match="a is a nested tensor"):
        mpgemm.matmul(nested, w.t())
    with pytest.raises(TypeError, match="input is a nested tensor"):
        mpgemm.linear(nested, w)


def test_a_gpu_older_than_ampere_takes_the_reference_path(monkeypatch):
    """Triton supports compute capability 8.0 and up (no Tensor Core MMA for Volta and
    Turing, no BF16 MMA on Turing): tensors on an older GPU take the reference
    implementation (torch ops, the same numerics), with a warning naming the GPU once."""
    from mpgemm import functional

    capabilities = {0: (7, 5), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capabilities.__getitem__)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    functional._capable.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"cuda:0 \(Tesla T4\) has compute capability 7\.5"):
            assert mpgemm.backend("cuda:0") == "reference"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once
            assert mpgemm.backend(torch.device("cuda", 0)) == "reference"
            assert mpgemm.backend("cuda:1") == mpgemm.backend("cuda") == "triton"
    finally:
        functional._capable.cache_clear()


def test_backend_takes_a_device_or_its_name():
    assert mpgemm.backend("cpu") == mpgemm.backend(torch.device("cpu"))
    assert mpgemm.backend("cuda:0") == "triton"
