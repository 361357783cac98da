"""``triton_gemm``'s replays on a GPU: a launch signature met again (by the fourth
call: after the autotuner, the JIT and the cached binary's launch) reuses an earlier
launch's decisions with the new call's tensors. Each call gets fresh operands of the same shapes,
strides and alignment, NaN-padded, and every call's results must meet the FP64 bar, so
a replay that read an earlier call's tensors, or skipped A's row sums, fails. The
interpreter's kernels launch through the JIT every time (no replays): GPU only; the
compiled comparison in ``test_launches.py`` checks the replays' launcher arguments on
any machine."""

import pytest
import torch

import mpgemm
from mpgemm.reference import gemm_ref
from tests.accuracy import assert_sum_within_torch_error, assert_within_torch_error, nan_padded

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("replays need compiled kernels (a GPU)", allow_module_level=True)

from mpgemm.kernels import gemm  # noqa: E402

HALF = torch.float16


def _launch(kind: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Fresh (a, b, kwargs) of one launch kind."""

    def operand(*shape, dtype=HALF, transposed=False):
        t = torch.randn(*shape, device=device).to(dtype)
        return nan_padded(t, transposed, aligned=True)

    if kind == "tma bias gelu":  # a layer's forward, G kept for the backward
        bias = torch.randn(96, device=device)
        kwargs = dict(bias=bias, activation="gelu", store_preact=True)
        return operand(200, 136), operand(96, 136).t(), kwargs
    if kind == "tma row sums":  # a weight gradient dZ.T @ X and the bias gradient
        return operand(136, 200).t(), operand(136, 96), dict(rowsum_a=True)
    if kind == "pointer fp32":  # an FP32 operand, rounded in registers
        return operand(200, 136, dtype=torch.float32), operand(136, 96), {}
    if kind == "pointer transposed":  # C.T = B.T @ A.T, R as B.T's column sums
        return operand(10, 136, dtype=torch.float32), operand(136, 96), dict(rowsum_a=True)
    if kind == "tma batch":  # attention's scores: (batch, heads) merged, K.T per head
        q = torch.randn(2, 4, 80, 64, device=device).to(HALF)
        k = torch.randn(2, 4, 72, 64, device=device).to(HALF)
        return q, k.transpose(-1, -2), {}
    if kind == "pointer outer batch":  # the same on (batch, heads) views of projections
        q = torch.randn(2, 80, 4, 64, device=device).to(HALF).transpose(1, 2)
        k = torch.randn(2, 72, 4, 64, device=device).to(HALF).transpose(1, 2)
        return q, k.transpose(-1, -2), {}
    # split-K: partials, then their reduction, both replayed
    return operand(16, 8192), operand(8192, 16), {}


KINDS = ["tma bias gelu", "tma row sums", "pointer fp32", "pointer transposed", "tma batch"]
KINDS += ["pointer outer batch", "split-k"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_replayed_launch_computes_on_its_own_tensors(kind, device, monkeypatch):
    relaunched: list[None] = []
    relaunch = gemm._relaunch
    monkeypatch.setattr(gemm, "_relaunch", lambda *args: relaunched.append(relaunch(*args)))
    torch.manual_seed(0)
    replayed = []
    for call in range(5):
        a, b, kwargs = _launch(kind, device)
        before = len(relaunched)
        out_dtype = torch.float32 if kwargs.get("rowsum_a") else HALF
        c, g, r = gemm.triton_gemm(a, b, compute_dtype=HALF, out_dtype=out_dtype, **kwargs)
        replayed.append(len(relaunched) > before)
        ref_c, ref_g, ref_r = gemm_ref(a, b, compute_dtype=HALF, out_dtype=out_dtype, **kwargs)
        what = f"{kind}, call {call}"
        z = a.double() @ b.double()  # batched where a and b are
        if "bias" in kwargs:
            z = z + kwargs["bias"].double()
            assert_within_torch_error(g, z, ref_g, f"{what}: z, kept for GELU's backward")
            z = torch.nn.functional.gelu(z)
        assert_within_torch_error(c, z, ref_c, what)
        if r is not None:
            assert_sum_within_torch_error(r, a, ref_r, f"{what}: row sums", dim=1)
    # By the fourth call (after the autotuner, the JIT and the cached binaries, fewer
    # where an earlier test met the kind) every call replays.
    assert replayed[3:] == [True, True]


@pytest.mark.parametrize("kind", ["tma", "pointer"])
def test_matmuls_replay_from_its_entry_computes_on_its_own_tensors(kind, device, monkeypatch):
    """``mpgemm.matmul`` of a product it has made before goes from its entry to the
    replay (``functional._replay_key``): each call's fresh operands, NaN-padded, must
    meet the bar, and the later calls must be answered by the replay."""
    from mpgemm import functional

    answered: list[bool] = []
    replay = gemm.replayed_product

    def counted(*args):
        c = replay(*args)
        answered.append(c is not None)
        return c

    monkeypatch.setattr(functional, "_product_replay", lambda: counted)
    torch.manual_seed(0)
    m, k, n = (200, 136, 96) if kind == "tma" else (50, 37, 45)
    for call in range(6):
        a = nan_padded(torch.randn(m, k, device=device).to(HALF), aligned=kind == "tma")
        b = nan_padded(torch.randn(k, n, device=device).to(HALF), aligned=kind == "tma")
        c = mpgemm.matmul(a, b)
        ref, _, _ = gemm_ref(a, b, compute_dtype=HALF, out_dtype=HALF)
        assert_within_torch_error(c, a.double() @ b.double(), ref, f"{kind}, call {call}")
    assert answered[-2:] == [True, True], answered
