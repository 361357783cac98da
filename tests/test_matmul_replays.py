"""``mpgemm.matmul``'s replays at its entry (``functional._replay_key``): a product of
two 16-bit matrices that ``matmul`` has computed before without autograd goes, on a
later call of the same key, straight to the replay of its launches
(``gemm.replayed_product``), past the checks and layers between; and only where
nothing those read has changed. Here a recorder stands in for the replay, answering
None as the replay does where ``triton_gemm`` keeps no launches (the interpreter's
kernels are never replayed), so that ``matmul`` goes on along its full path: what is
checked is which calls reach the replay, and with what. Under the stand-in driver, the
replays themselves: ``native_launch_check.py``'s "matmul's replay at its entry"; on a
GPU, their results: ``test_replays.py``."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad
from torch.overrides import TorchFunctionMode

import mpgemm
from mpgemm import functional
from mpgemm.reference import gemm_ref
from tests.accuracy import assert_within_torch_error

HALF = torch.float16


@pytest.fixture
def replays(monkeypatch, on_path) -> list[tuple]:
    """The calls of the replay, each (a, b, compute_dtype, out_dtype), for tensors on the
    kernels' path."""
    calls: list[tuple] = []

    def recorder(a, b, compute_dtype, out_dtype):
        calls.append((a, b, compute_dtype, out_dtype))

    monkeypatch.setattr(functional, "_product_replay", lambda: recorder)
    monkeypatch.setattr(functional, "_matmul_replays", {})
    return calls


def operands(device, m=24, k=40, n=32, dtype=HALF, requires_grad=False):
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    return a, b.requires_grad_(requires_grad)


def checked(c, a, b, compute_dtype=HALF, out_dtype=None):
    exact = a.double() @ b.double()
    assert c.dtype == (out_dtype or compute_dtype)
    ref, _, _ = gemm_ref(a, b, compute_dtype=compute_dtype, out_dtype=out_dtype or compute_dtype)
    assert_within_torch_error(c, exact, ref, "matmul")


def test_a_product_made_before_asks_its_replay_with_what_matmul_decided(replays, device):
    a, b = operands(device)
    checked(mpgemm.matmul(a, b), a, b)
    assert replays == []  # the first call decides, and keeps its decisions
    a2, b2 = operands(device)  # new tensors of the same key
    checked(mpgemm.matmul(a2, b2), a2, b2)
    assert len(replays) == 1
    ra, rb, compute_dtype, out_dtype = replays[0]
    assert ra is a2 and rb is b2 and compute_dtype is out_dtype is HALF
    # Given dtypes are part of the key: BF16 computing into FP32 is decided anew.
    mpgemm.matmul(a, b, compute_dtype=torch.bfloat16, out_dtype=torch.float32)
    assert len(replays) == 1
    c = mpgemm.matmul(a, b, compute_dtype=torch.bfloat16, out_dtype=torch.float32)
    checked(c, a, b, torch.bfloat16, torch.float32)
    assert replays[-1][2:] == (torch.bfloat16, torch.float32)


def test_a_replays_result_is_what_matmul_returns(replays, device, monkeypatch):
    a, b = operands(device)
    mpgemm.matmul(a, b)
    answer = torch.full((24, 32), 7.0, device=device, dtype=HALF)
    monkeypatch.setattr(functional, "_product_replay", lambda: lambda *args: answer)
    functional._matmul_replays.clear()
    mpgemm.matmul(a, b)  # kept with the new replay
    assert mpgemm.matmul(a, b) is answer


@pytest.mark.parametrize(
    "other",
    ["shape", "strides", "dtype", "bf16 operand", "fp32 operand", "vector", "row", "batch", "out"],
)
def test_a_product_of_another_key_or_kind_is_not_replayed(replays, device, other):
    a, b = operands(device)
    for _ in range(2):
        mpgemm.matmul(a, b)
    assert len(replays) == 1
    if other == "shape":
        a, b = operands(device, m=25)
    elif other == "strides":
        b = b.t().contiguous().t()
    elif other == "dtype":
        a, b = a.float().bfloat16(), b.float().bfloat16()
    elif other == "bf16 operand":
        b = b.float().bfloat16()
    elif other == "fp32 operand":  # rounded first: never replayed from the entry
        a = a.float()
    elif other == "vector":
        b = b[:, 0]
    elif other == "row":  # a 1-D a: (K,) @ (K, N)
        a = a[0]
    elif other == "batch":
        b = b.expand(2, *b.shape)
    kwargs = {"out": torch.empty(24, 32, device=device, dtype=HALF)} if other == "out" else {}
    before = len(replays)
    for _ in range(3):
        c = mpgemm.matmul(a, b, **kwargs)
    expected = 2 if other in ("shape", "strides", "dtype", "bf16 operand") else 0
    assert len(replays) - before == expected
    ref, _, _ = gemm_ref(a, b, compute_dtype=c.dtype, out_dtype=c.dtype)
    assert_within_torch_error(c, a.double() @ b.double(), ref, other)


class Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_state_the_skipped_checks_read_sends_a_call_down_its_full_path(replays, device):
    a, b = operands(device)
    for _ in range(2):
        mpgemm.matmul(a, b)
    assert len(replays) == 1
    # An operand that requires grad, with grad enabled: autograd records the product.
    b.requires_grad_()
    c = mpgemm.matmul(a, b)
    assert c.grad_fn is not None
    # ... and not without grad mode (the same decisions as for b without grad).
    with torch.no_grad():
        mpgemm.matmul(a, b)
    assert len(replays) == 2
    b.requires_grad_(False)
    # A torch-function mode sees the call (and the call it makes, with the mode off,
    # is replayed).
    with Seen() as seen:
        mpgemm.matmul(a, b)
    assert mpgemm.matmul in seen.funcs
    assert len(replays) == 3
    # torch.jit.trace refuses it.
    with pytest.raises(RuntimeError, match="torch.jit.trace"):
        torch.jit.trace(lambda x, y: mpgemm.matmul(x, y), (a, b), check_trace=False)
    # A forward-AD level: the Function, whose jvp rule gives the tangent, not dropped.
    with forward_ad.dual_level():
        dual = mpgemm.matmul(forward_ad.make_dual(a, torch.ones_like(a)), b)
        assert forward_ad.unpack_dual(dual).tangent is not None
    # A functorch transform: vmap over a batch of a's.
    torch.func.vmap(lambda x: mpgemm.matmul(x, b))(a.expand(3, *a.shape))
    # A tensor subclass takes the reference path, as does a negative view (the same
    # key: its memory's layout) and a zero tensor.
    mpgemm.matmul(a.as_subclass(Subclass), b)
    checked(mpgemm.matmul(torch._neg_view(a), b), -a, b)
    checked(
        mpgemm.matmul(a, torch._efficientzerotensor(b.shape, dtype=HALF, device=device)), a, 0 * b
    )
    assert len(replays) == 3


class Subclass(torch.Tensor):
    pass


def test_a_cpu_tensor_replays_only_while_the_kernels_backend_runs_it(replays, device, on_path):
    if device.type != "cpu":
        pytest.skip("a CPU tensor's backend: the interpreter's")
    a, b = operands(device)
    for _ in range(2):
        mpgemm.matmul(a, b)
    assert len(replays) == 1
    on_path("reference")  # the interpreter off: the reference path
    c = mpgemm.matmul(a, b)
    assert len(replays) == 1
    checked(c, a, b)


def test_bad_arguments_raise_as_before_for_a_kept_key(replays, device):
    a, b = operands(device)
    for _ in range(2):
        mpgemm.matmul(a, b)
    with pytest.raises(TypeError, match="compute_dtype"):
        mpgemm.matmul(a, b, compute_dtype=torch.float32)
    with pytest.raises(TypeError, match="compute_dtype"):
        mpgemm.matmul(a, b, compute_dtype=[torch.float16])  # unhashable: not a key
    with pytest.raises(TypeError, match="out_dtype"):
        mpgemm.matmul(a, b, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="sparse|dense"):
        mpgemm.matmul(a.to_sparse(), b)
    # (2-D, of a 16-bit dtype: asked for its key, whose sizes it has not)
    nested = torch.nested.nested_tensor([a[0, :3], a[1]], device=device)
    with pytest.raises(TypeError, match="nested"):
        mpgemm.matmul(nested, b)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        mpgemm.matmul(a.tolist(), b)
    assert len(replays) == 1


def test_the_kept_keys_are_bounded(replays, device, monkeypatch):
    monkeypatch.setattr(functional, "_MAX_MATMUL_REPLAYS", 3)
    for m in range(1, 6):
        mpgemm.matmul(*operands(device, m=m))
    assert 1 <= len(functional._matmul_replays) <= 3


class Through(torch.autograd.Function):
    """The identity, whose backward multiplies its gradient by ``w`` with mpgemm."""

    @staticmethod
    def forward(x, w):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.w = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return mpgemm.matmul(grad, ctx.w), None


def test_a_batched_gradient_of_a_kept_key_takes_the_full_path(replays, device):
    # ``is_grads_batched``'s gradients are batched tensors of type torch.Tensor with no
    # memory of their own, outside any functorch transform: matmul's full path hands
    # them to the reference's torch ops, which compute the batch.
    w = torch.randn(32, 32, device=device).to(HALF)
    g = torch.randn(24, 32, device=device).to(HALF)
    for _ in range(2):
        mpgemm.matmul(g, w)
    assert len(replays) == 1
    x = torch.randn(24, 32, device=device, dtype=HALF, requires_grad=True)
    grads = torch.randn(3, 24, 32, device=device).to(HALF)
    (batched,) = torch.autograd.grad(Through.apply(x, w), x, grads, is_grads_batched=True)
    assert len(replays) == 1
    for i in range(3):
        checked(batched[i], grads[i], w)


def test_a_compiled_product_of_a_kept_key_traces_whole(replays, device):
    # Dynamo traces the entry's checks (is_compiling answers True there), then the
    # custom op: no graph break, and eager's bits.
    a, b = operands(device)
    eager = mpgemm.matmul(a, b)
    mpgemm.matmul(a, b)
    assert len(replays) == 1
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: mpgemm.matmul(x, y), fullgraph=True)
    assert torch.equal(compiled(a, b), eager)
    assert len(replays) == 1
