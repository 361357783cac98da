"""The tracers besides torch.compile (tests/test_compile.py): ``torch.export`` records
mpgemm's custom ops; torch.fx's symbolic tracing keeps an ``mpgemm.Linear`` a leaf (a
call of the module, as it records ``nn.Linear``) and records ``mpgemm.matmul``,
``linear`` and ``cross_entropy`` as calls of themselves, as any ``__torch_function__``
handler sees them, torch's functions' way; ``torch.jit.trace``, which would record one
call's launches as constants, is refused with a pointer to ``torch.export``."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import mpgemm


def _model(device):
    torch.manual_seed(0)
    return mpgemm.convert(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10))
    ).to(device)


def test_export_records_the_custom_ops_and_matches_eager_bit_for_bit(device):
    model = _model(device)
    x = torch.randn(8, 16, device=device)
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count("mpgemm.gemm.default") == 3
    for rows in (8, 5):
        x = torch.randn(rows, 16, device=device)
        assert torch.equal(program.module()(x), model(x))


def test_fx_keeps_each_layer_a_leaf_that_runs_as_the_model_does(device):
    model = _model(device)
    traced = torch.fx.symbolic_trace(model)
    calls = [n for n in traced.graph.nodes if n.op not in ("placeholder", "output")]
    # Every node a call of a module (mpgemm.Linear, and the Identity that convert left
    # where an activation was fused): nothing of the layers' insides.
    assert [(n.op, n.target) for n in calls] == [("call_module", str(i)) for i in range(5)]
    assert all(traced.get_submodule(str(i)) is model[i] for i in range(5))
    x = torch.randn(8, 16, device=device)
    target = torch.randint(0, 10, (8,), device=device)
    grads = []
    for run in (traced, model):
        model.zero_grad()
        out = run(x)
        F.cross_entropy(out, target).backward()
        grads.append((out, [p.grad.clone() for p in model.parameters()]))
    (traced_out, traced_grads), (out, model_grads) = grads
    assert traced_out.dtype == torch.float32  # the logits layer's FP32 output
    assert torch.equal(traced_out, out)
    assert all(map(torch.equal, traced_grads, model_grads))


class _Products(nn.Module):
    def forward(self, a, b, w, target):
        h = mpgemm.linear(mpgemm.matmul(a, b), w, activation="relu", out_dtype=torch.float32)
        return mpgemm.cross_entropy(h, target, label_smoothing=0.1)


def _products_inputs(device):
    torch.manual_seed(1)
    return (
        torch.randn(8, 16, device=device),
        torch.randn(16, 24, device=device),
        torch.randn(10, 24, device=device),
        torch.randint(0, 10, (8,), device=device),
    )


def test_fx_records_the_functions_as_calls_of_themselves(device):
    traced = torch.fx.symbolic_trace(_Products())
    targets = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert targets == [mpgemm.matmul, mpgemm.linear, mpgemm.cross_entropy]
    args = _products_inputs(device)
    assert torch.equal(traced(*args), _Products()(*args))


def test_a_torch_function_mode_sees_the_functions_and_changes_nothing(device):
    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__module__", "").startswith("mpgemm"):
                self.calls.append(func)
            return func(*args, **(kwargs or {}))

    args = _products_inputs(device)
    with Seen() as seen:
        loss = _Products()(*args)
    assert seen.calls == [mpgemm.matmul, mpgemm.linear, mpgemm.cross_entropy]
    assert torch.equal(loss, _Products()(*args))


def test_jit_trace_is_refused_with_a_pointer_to_export(device):
    model = _model(device)
    x = torch.randn(8, 16, device=device)
    b = torch.randn(16, 4, device=device)
    for traced, inputs in ((model, (x,)), (lambda x: mpgemm.matmul(x, b), (x,))):
        with pytest.raises(RuntimeError, match=r"torch\.jit\.trace cannot.*torch\.export\.export"):
            torch.jit.trace(traced, inputs)


def test_jit_script_is_refused_with_a_pointer_to_export(device):
    """TorchScript cannot compile the layers' Python and Triton: a clear error naming
    the layer, where scripting failed deep in its forward's code."""
    with pytest.raises(RuntimeError, match=r"mpgemm\.Linear: torch\.jit\.script cannot.*export"):
        torch.jit.script(_model(device))


def test_jit_trace_of_cross_entropy_records_torchs(device):
    logits = torch.randn(8, 10, device=device)
    target = torch.randint(0, 10, (8,), device=device)
    traced = torch.jit.trace(lambda x, t: mpgemm.cross_entropy(x, t), (logits, target))
    kinds = {n.kind() for n in traced.graph.nodes()}
    assert "aten::cross_entropy_loss" in kinds
    logits, target = torch.randn(8, 10, device=device), torch.randint(0, 10, (8,), device=device)
    assert torch.equal(traced(logits, target), F.cross_entropy(logits, target))
