"""``mpgemm.native.list_facts``: the C++ pass over a list of tensors reads what the
Python passes read, on every kind of list the loss-scaling ops meet; the ops give the
same launches and bits either way; a helper that does not build is warned of once and
leaves the Python passes."""

import os
import warnings

import pytest
import torch

from mpgemm import native, scaling
from mpgemm.functional import PLAIN_TYPES

pytestmark = pytest.mark.skipif(
    os.environ.get("MPGEMM_NATIVE") == "0", reason="the C++ helper is turned off"
)


class _Sub(torch.Tensor):
    pass


def _lists(device):
    t = lambda *shape, dtype=torch.float32: torch.randn(*shape, device=device).to(dtype)  # noqa: E731
    with torch.inference_mode():
        served = t(4)
    return {
        "empty": [],
        "one dtype": [t(5), t(3, 4), t(1)],
        "three dtypes": [t(5), t(7, dtype=torch.float16), t(2, 3, dtype=torch.bfloat16)],
        "fp64 and 0-dim": [t(3, dtype=torch.float64), torch.zeros((), device=device)],
        "zero-size": [t(0), t(4, 0), t(2)],
        "transposed": [t(3, 4).t(), t(6)],
        "a column slice": [t(4, 6)[:, 1:3]],
        "parameters": [torch.nn.Parameter(t(3)), t(2)],
        "a tuple": (t(3), t(4, dtype=torch.float16)),
        "a subclass": [t(3), t(2).as_subclass(_Sub)],
        "not a tensor": [t(3), 1.5],
        "a negative view": [t(3), torch._neg_view(t(2))],
        "a zero tensor": [t(3), torch._efficientzerotensor(2, device=device)],
        "an inference tensor": [t(3), served],
    }


def test_the_cpp_pass_reads_what_the_python_passes_read(device):
    cpp = native.native_list_facts()
    assert cpp is not None, "the C++ helper did not build (a compiler and ninja are needed)"
    for name, tensors in _lists(device).items():
        python = native.python_list_facts(tensors, PLAIN_TYPES)
        assert native.ListFacts(*cpp(tensors, PLAIN_TYPES)) == python, name
    # Made under torch.inference_mode: a plain list, which the steps may not write.
    for name, tensors in _lists(device).items():
        facts = native.ListFacts(*cpp(tensors, PLAIN_TYPES))
        assert facts.inference == (name == "an inference tensor"), name
    assert native.ListFacts(*cpp(_lists(device)["an inference tensor"], PLAIN_TYPES)).plain
    # The plain types are the caller's: Parameter alone makes plain tensors not so.
    tensors = _lists(device)["parameters"]
    assert not native.ListFacts(*cpp(tensors, (torch.nn.Parameter,))).plain
    with pytest.raises(TypeError, match="list or tuple"):
        cpp(5, PLAIN_TYPES)


def test_a_negative_view_or_a_zero_tensor_is_not_plain(device):
    # Their values are not their memory's (a negative view's are its memory's negated;
    # a zero tensor has none): a kernel would read the wrong sign, or address 0 (the
    # interpreter's process died of it). Plain types, so only the values tell.
    lists = _lists(device)
    for name in ("a negative view", "a zero tensor"):
        assert set(map(type, lists[name])) == {torch.Tensor}
        for read in (native.native_list_facts(), native.python_list_facts):
            assert not native.ListFacts(*read(lists[name], PLAIN_TYPES)).plain, name


def test_a_tensor_without_storage_raises_as_its_data_ptr_does(device):
    # A tensor torch.func wraps has no memory of its own: no table may hold an address.
    cpp = native.native_list_facts()
    raised = []

    def loss(x):
        for read in (cpp, native.python_list_facts):
            with pytest.raises(RuntimeError, match="doesn't have storage") as error:
                read([x], PLAIN_TYPES)
            raised.append(str(error.value).splitlines()[0])
        return x.sum()

    torch.func.grad(loss)(torch.randn(3, device=device))
    assert len(raised) == 2 and raised[0] == raised[1]


def test_bump_versions_bumps_as_torchs_increment_version(device, monkeypatch):
    """The C++ loop and torch's ``increment_version`` (its fallback) give each tensor one
    bump, a view's base too (they share a counter), and skip an inference tensor;
    something that is not a tensor raises torch's RuntimeError."""
    assert native.native_module() is not None, "the C++ helper did not build"
    for helper in ("cpp", "torch"):
        if helper == "torch":
            monkeypatch.setattr(native, "native_module", lambda: None)
        base = torch.randn(4, 3, device=device)
        with torch.inference_mode():
            frozen = torch.ones(2, device=device)
        tensors = [torch.randn(3, device=device), base[1], torch.nn.Parameter(torch.randn(2))]
        before = [t._version for t in tensors]
        native.bump_versions((*tensors, frozen))
        assert [t._version for t in tensors] == [v + 1 for v in before], helper
        assert base._version == 1, helper
        native.bump_versions([])
        with pytest.raises(RuntimeError, match="each element of the iterable to be a tensor"):
            native.bump_versions([tensors[0], 1.5])


def _ops(device):
    """An unscale of three dtypes, a check alone, and two Adam steps over an FP32 and
    an FP16 parameter with a transposed gradient (the reference's), the flag raised
    by an inf: every output, in order."""
    torch.manual_seed(0)
    grads = [torch.randn(300, device=device), torch.randn(5, 7, device=device).half()]
    grads.append(torch.randn(7, 5, device=device).bfloat16().t())
    grads[1][2, 3] = float("inf")
    found, inv = torch.zeros((), device=device), torch.full((), 0.25, device=device)
    scaling.unscale_(grads, found, inv)
    checked = torch.zeros((), device=device)
    scaling.unscale_(grads[:1], checked, None)
    params = [torch.randn(300, device=device), torch.randn(6, 4, device=device).half()]
    grads_p = [torch.randn(300, device=device), torch.randn(4, 6, device=device).half().t()]
    avgs = [torch.zeros_like(p) for p in params]
    sqs = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), device=device) for _ in params]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01)
    hyper.update(decoupled_weight_decay=False, maximize=False, grad_scale=None, found_inf=None)
    for _ in range(2):
        scaling.adam_step_(params, grads_p, avgs, sqs, steps, **hyper)
    return [*grads, found, checked, *params, *avgs, *sqs, *steps]


def test_the_ops_give_the_same_bits_without_the_cpp_pass(device, monkeypatch):
    with_cpp = _ops(device)
    monkeypatch.setattr(native, "native_list_facts", lambda: None)
    without = _ops(device)
    assert with_cpp[3].item() == 1.0 and with_cpp[4].item() == 0.0  # the flags
    for ours, theirs in zip(with_cpp, without, strict=True):
        assert torch.equal(ours, theirs)


def test_a_helper_that_does_not_build_is_warned_of_and_left_out(monkeypatch):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    native.native_module.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="did not build.*Ninja is required"):
            assert native.native_list_facts() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the answer is kept
            assert native.native_list_facts() is None
        tensors = [torch.randn(3)]
        assert native.list_facts(tensors, PLAIN_TYPES) == native.python_list_facts(
            tensors, PLAIN_TYPES
        )
    finally:
        native.native_module.cache_clear()


def test_an_op_reads_each_of_its_lists_once_and_no_more(device, monkeypatch):
    """Within one op (``reading_once``) its checks, its split by dtype and its launch
    table share one read of each list; the next op reads its lists anew, so a list
    changed in between is seen as it now is."""
    real = native.native_list_facts()
    reads = []

    def counting(tensors, plain_types):
        reads.append(id(tensors))
        return real(tensors, plain_types)

    monkeypatch.setattr(native, "native_list_facts", lambda: counting)
    grads = [torch.ones(5, device=device), torch.ones(3, device=device)]
    found, inv_scale = torch.zeros((), device=device), torch.ones((), device=device)
    scaling.unscale_(grads, found, inv_scale)
    assert reads == [id(grads)] and found.item() == 0
    grads.append(torch.full((2,), float("inf"), device=device))  # between two ops
    scaling.unscale_(grads, found, inv_scale)
    assert found.item() == 1
    reads.clear()
    params, exp_avgs, exp_avg_sqs = ([torch.ones(4, device=device)] for _ in range(3))
    steps = [torch.zeros((), device=device)]
    scaling.adam_step_(
        params, [torch.ones(4, device=device)], exp_avgs, exp_avg_sqs, steps,
        lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False,
        decoupled_weight_decay=False,
    )  # fmt: skip
    assert len(reads) == len(set(reads)) == 5  # params (as their own copies), grads, moments, steps
    assert native._reading.facts is None  # nothing kept between ops


def test_the_helper_is_built_once_per_source_whichever_path_holds_it(tmp_path, monkeypatch):
    """Two checkouts of the same source share one build; an edited source gets its own.
    (Torch's folder by name alone holds a ninja file with the source's path: a second
    checkout rebuilt the helper, and the first rebuilt it again.)"""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    text = open(native._SOURCE, "rb").read()
    paths = []
    for checkout in ("one", "two", "edited"):
        (tmp_path / checkout).mkdir()
        paths.append(tmp_path / checkout / "list_facts.cpp")
        paths[-1].write_bytes(text + (b"// edited\n" if checkout == "edited" else b""))
    (one, one_source), (two, two_source), (edited, _) = map(native.build_folder, map(str, paths))
    assert one == two != edited
    assert one_source == two_source and open(one_source, "rb").read() == text
    assert one.startswith(str(tmp_path / "extensions"))
