"""mpgemm.Linear's 16-bit weight copy: never stale, written by mpgemm's fused optimizers
in their step; and a converted MLP's training step runs 16-bit operands into every
GEMM with no weight-cast kernels, its activations fused into the forward GEMMs."""

import pytest
import torch
from torch import nn

import mpgemm
from mpgemm.kernels.launches import intercept, jit_function
from tests.accuracy import OpLog


def _layer(device, **options):
    torch.manual_seed(0)
    return mpgemm.Linear(48, 32, device=device, **options)


def _assert_forward_uses_the_current_weight(layer, device, in_features=48):
    # The same forward with the copy cast anew: the same kernels on the same operands,
    # bit for bit, where the kept copy is current; a stale one would differ by the
    # edit. (The functional form on the FP32 weight may run another kernel, whose FP32
    # sums can differ in the last bit.)
    x = torch.randn(16, in_features, device=device)
    kept = layer(x)
    layer._weight_copy.drop()
    assert torch.equal(kept, layer(x))


def _edit_in_place(layer):
    with torch.no_grad():
        layer.weight.mul_(-2.0)


def _load_state_dict(layer):
    other = nn.Linear(48, 32, device=layer.weight.device)
    layer.load_state_dict(other.state_dict())


def _torch_optimizer_step(layer):
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 48, device=layer.weight.device)).float().sum().backward()
    optimizer.step()


def _new_parameter(layer):
    layer.weight = nn.Parameter(torch.randn_like(layer.weight))


def _to_and_back(layer):
    # .to() gives the Parameters new storage (here a round trip through FP64).
    layer.double().float()


def _to_and_back_swapped(layer):
    # The same, with the Parameters' contents swapped in place (torch's coming default
    # for module conversions, and its way when the new value is of another tensor type):
    # the same objects, new storage. torch.utils.swap_tensors refuses a tensor that has
    # a weak reference.
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        weight = layer.weight
        layer.double().float()
        assert layer.weight is weight
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


def _data_assignment(layer):
    layer.weight.data = torch.randn_like(layer.weight)


def _same_memory_read_transposed(layer):
    # The same storage, address and shape, read through other strides (no version bump).
    layer.weight.data = layer.weight.data.view(layer.in_features, -1).t()


def _fewer_rows(layer):
    # The same storage, address and strides, fewer of its rows (a layer narrowed in place).
    layer.weight.data = layer.weight.data[:16]
    layer.bias.data = layer.bias.data[:16]


def _rewrite_without_a_version_bump(layer):
    # As FSDP2 refreshes an unsharded weight: all-gathered into the same storage under
    # _unsafe_preserve_version_counter.
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(layer.weight):
        layer.weight.mul_(-2.0)


def _fsdp_step(layer):
    # The new values come from an optimizer step on the shards, other tensors.
    _rewrite_without_a_version_bump(layer)
    shard = nn.Parameter(torch.zeros(3, device=layer.weight.device))
    shard.grad = torch.ones_like(shard)
    torch.optim.SGD([shard], lr=0.1).step()


def _fsdp_load_state_dict(layer):
    # Or from a state dict loaded into the shards: the layer writes nothing itself.
    _rewrite_without_a_version_bump(layer)
    layer.load_state_dict({}, strict=False)


class _OwnKernelsSGD(torch.optim.Optimizer):
    """An optimizer outside torch and mpgemm whose own kernels write the weights without
    a version bump, as bitsandbytes' do."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    with torch.autograd._unsafe_preserve_version_counter(p):
                        p.sub_(p.grad, alpha=0.5)


def _own_kernels_step(layer):
    layer(torch.randn(4, 48, device=layer.weight.device)).float().sum().backward()
    _OwnKernelsSGD(layer.parameters()).step()


def _frozen_after_backward_then_stepped(layer):
    # Frozen between its backward and the step, which still steps it with the gradient
    # it has: here without a version bump.
    layer(torch.randn(4, 48, device=layer.weight.device)).float().sum().backward()
    layer.requires_grad_(False)
    _OwnKernelsSGD([layer.weight]).step()


# Changes that show on any weight, frozen or not: a new storage, a version bump, a
# loaded state dict.
_VISIBLE_EDITS = [
    _edit_in_place,
    _load_state_dict,
    _new_parameter,
    _to_and_back,
    _to_and_back_swapped,
    _data_assignment,
    _same_memory_read_transposed,
    _fewer_rows,
    _fsdp_load_state_dict,
]


@pytest.mark.parametrize(
    "edit",
    [
        *_VISIBLE_EDITS,
        _torch_optimizer_step,
        _own_kernels_step,
        _frozen_after_backward_then_stepped,
    ],
)
def test_the_copy_is_never_stale(device, edit):
    layer = _layer(device, activation="relu")
    _assert_forward_uses_the_current_weight(layer, device)
    edit(layer)
    _assert_forward_uses_the_current_weight(layer, device)


@pytest.mark.parametrize("edit", _VISIBLE_EDITS)
def test_a_frozen_weights_copy_is_never_stale(device, edit):
    # Kept across other parameters' optimizer steps, and remade by each of these.
    layer = _layer(device, activation="relu").requires_grad_(False)
    _assert_forward_uses_the_current_weight(layer, device)
    _torch_optimizer_step(mpgemm.Linear(48, 32, device=device))  # another layer's step
    edit(layer)
    _assert_forward_uses_the_current_weight(layer, device)


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_with_a_process_group_a_weight_is_remade_after_any_step(device, tmp_path, frozen):
    # FSDP2 (which needs a process group) rewrites a weight's unsharded storage without a
    # version bump, with values from its shards that torch's optimizer stepped (a frozen
    # one's: an EMA teacher's update).
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        layer = _layer(device, activation="relu").requires_grad_(not frozen)
        _assert_forward_uses_the_current_weight(layer, device)
        _fsdp_step(layer)
        _assert_forward_uses_the_current_weight(layer, device)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("second", ["torch_adamw", "mpgemm_adamw"])
def test_one_optimizers_steps_leave_the_others_copies_current(device, second):
    """Two optimizers over two models (a GAN's discriminator and generator): the steps
    of each, which bump what they write, leave the other's copies current, where every
    step of either made the other's layers cast anew. Another optimizer (its own
    kernels) still makes them stale (``test_the_copy_is_never_stale``)."""
    torch.manual_seed(0)
    # Of two shapes: the log tells a cast by its shape.
    first, other = mpgemm.Linear(48, 32, device=device), mpgemm.Linear(48, 24, device=device)
    optimizers = [
        mpgemm.optim.AdamW(first.parameters(), lr=0.1),
        (mpgemm.optim.AdamW if second == "mpgemm_adamw" else torch.optim.AdamW)(
            other.parameters(), lr=0.1
        ),
    ]
    x = torch.randn(8, 48, device=device)

    def step(layer, optimizer):
        optimizer.zero_grad()
        layer(x).float().square().sum().backward()
        optimizer.step()

    for _ in range(2):
        step(first, optimizers[0])
        step(other, optimizers[1])
    for _ in range(2):
        with OpLog() as log:
            step(first, optimizers[0])
            step(other, optimizers[1])
        assert not log.casts_of(first.weight)
        # torch's step writes the weight alone: its layer casts anew, as it must.
        assert bool(log.casts_of(other.weight)) == (second == "torch_adamw")
    for layer in (first, other):
        _assert_forward_uses_the_current_weight(layer, device)


def test_a_copy_written_after_another_optimizers_counted_step_is_current(device):
    """Two models' backwards, then an optimizer with kernels of its own (counted: it may
    write any weight without a bump) steps one, then mpgemm's steps the other and writes
    its copies: those are current at the next forwards, where the first model's layer
    casts anew."""
    torch.manual_seed(0)
    ours, other = mpgemm.Linear(48, 32, device=device), mpgemm.Linear(48, 24, device=device)
    optimizers = [_OwnKernelsSGD(other.parameters()), mpgemm.optim.AdamW(ours.parameters())]
    x = torch.randn(8, 48, device=device)
    for _ in range(3):
        with OpLog() as log:  # (the last step's: the first one's forward makes the copies)
            for layer, optimizer in zip((other, ours), optimizers, strict=True):
                optimizer.zero_grad()
                layer(x).float().square().sum().backward()
            for optimizer in optimizers:
                optimizer.step()
    assert not log.casts_of(ours.weight) and log.casts_of(other.weight)
    for layer in (ours, other):
        _assert_forward_uses_the_current_weight(layer, device)


def test_forwards_with_nothing_changed_between_cast_once(device):
    # An evaluation loop, or a layer called twice in a step.
    layer = _layer(device)
    x = torch.randn(8, 48, device=device)
    with OpLog() as first:
        layer(x)
    assert first.casts_of(layer.weight)
    with OpLog() as log:
        layer(x)
        layer(x)
    assert not log.casts_of(layer.weight)


@pytest.mark.parametrize("compute_dtype", [torch.float16, torch.bfloat16])
def test_a_weight_that_is_a_negative_view_is_copied_as_its_values(device, compute_dtype):
    # Its memory holds the values negated; torch 2.13's copy_ from FP32 to FP16 read the
    # memory, and the layer computed with the negated weight (max error 3.5).
    layer = _layer(device, compute_dtype=compute_dtype)
    values = layer.weight.detach().clone()
    layer.weight = nn.Parameter(torch._neg_view(values.neg()))
    x = torch.randn(16, 48, device=device)
    # (the functional form on the weight itself: the same path, torch's ops, which
    # round it as its values)
    expected = mpgemm.linear(x, layer.weight, layer.bias, compute_dtype=compute_dtype)
    assert layer.weight.is_neg() and torch.equal(layer(x), expected)
    assert torch.equal(layer._weight_copy.tensor, values.to(compute_dtype))


def test_a_frozen_base_in_16_bits_has_no_copy(device):
    # A LoRA-style base stored in BF16 after convert: its layer computes in BF16 and
    # reads the weight itself, so no 16-bit copy is made or cast (README's way to save
    # the copies' memory); the trained layer's copy is kept as ever.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    mpgemm.convert(model)
    model[0].to(torch.bfloat16).requires_grad_(False)
    assert model[0].compute_dtype == torch.bfloat16
    optimizer = mpgemm.optim.AdamW(model[2].parameters(), lr=0.1)
    x = torch.randn(32, 48, device=device)
    y = torch.randint(0, 10, (32,), device=device)
    for _ in range(2):
        with OpLog() as log:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        assert not log.casts_of(model[0].weight)
        assert model[0]._weight_copy.tensor is None
        assert model[2]._weight_copy.tensor is not None
    # torch's BF16 product of the same rounded operands (BF16's tolerances: the two
    # sum in different orders before the one rounding).
    expected = nn.functional.linear(x.bfloat16(), model[0].weight, model[0].bias).relu()
    torch.testing.assert_close(model[1](model[0](x)), expected)


@pytest.mark.parametrize("trainer", ["torch_adamw", "mpgemm_adamw", "own_kernels"])
def test_a_frozen_backbones_copies_outlive_the_steps_of_what_trains(device, trainer):
    # Fine-tuning a head (or LoRA over frozen layers): the frozen layers' copies are
    # cast once, not at every step, also under an optimizer whose steps are counted
    # (own_kernels: they may write any weight with a gradient, not a frozen one).
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    ).to(device)
    mpgemm.convert(model)
    model[:4].requires_grad_(False)
    head = [p for p in model.parameters() if p.requires_grad]
    fused = trainer == "mpgemm_adamw"
    if trainer == "own_kernels":
        optimizer = _OwnKernelsSGD(head)
    else:
        optimizer = (mpgemm.optim.AdamW if fused else torch.optim.AdamW)(head, lr=0.1)
    x = torch.randn(32, 48, device=device)
    y = torch.randint(0, 10, (32,), device=device)

    def step():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step()
    # As made (``_copy`` asks as an optimizer does, which marks the copy current).
    frozen = [model[0]._weight_copy.tensor, model[2]._weight_copy.tensor]
    for _ in range(2):
        with OpLog() as log:
            step()
        assert not log.casts_of(model[0].weight) and not log.casts_of(model[2].weight)
        assert model[0]._weight_copy.tensor is frozen[0]
        assert model[2]._weight_copy.tensor is frozen[1]
        # The head's copy: written by mpgemm's step, cast anew after torch's.
        assert bool(log.casts_of(model[4].weight)) != fused
    for layer in (model[0], model[2], model[4]):
        _assert_forward_uses_the_current_weight(layer, device, layer.in_features)


def test_a_weight_tied_into_two_layers_is_current_in_both_after_a_fused_step(device):
    # A fused step writes the weight and one layer's copy without a version bump: the
    # other layer's copy is remade.
    torch.manual_seed(0)
    first, second = mpgemm.Linear(48, 32, device=device), mpgemm.Linear(48, 32, device=device)
    second.weight = first.weight
    optimizer = mpgemm.optim.Adam([first.weight], lr=0.1)
    x = torch.randn(8, 48, device=device)
    (first(x).float().sum() + second(x).float().sum()).backward()
    optimizer.step()
    for layer in (first, second):
        _assert_forward_uses_the_current_weight(layer, device)


def test_an_evaluation_under_inference_mode_leaves_training_as_it_was(device):
    """An evaluation pass under ``torch.inference_mode`` (a validation loop's, before or
    between training steps) makes the copy there; training goes on as it does for
    ``nn.Linear``: the copy is saved for backward and written by the optimizer, with
    the same results as a model never evaluated."""

    def train(evaluate_first):
        torch.manual_seed(0)
        model = mpgemm.convert(
            nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 8)).to(device)
        )
        optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters(), lr=0.01))
        x = torch.randn(16, 48, device=device)
        outputs = []
        for _ in range(2):
            if evaluate_first:
                with torch.inference_mode():
                    model(x)
            loss = model(x).float().square().mean()
            optimizer.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            outputs.append(model(x).detach())
        return outputs, [p.detach() for p in model.parameters()]

    evaluated, trained = train(True), train(False)
    for a, b in zip(evaluated[0] + evaluated[1], trained[0] + trained[1], strict=True):
        assert torch.equal(a, b)


def test_threads_sharing_a_copy_with_other_weights_each_get_their_own():
    """nn.DataParallel's replicas share the layer's attributes, its copy holder among
    them, and run in threads, each with a weight of its own: each call gets a copy of
    its own weight, never another thread's copy (a thread switch between reading the
    copy and what it was made from gave one, some 45 calls in 40,000 here)."""
    import sys
    import threading

    from mpgemm.compute_copy import ComputeCopy

    holder = ComputeCopy(torch.float16)
    weights = [torch.full((4,), float(i + 1)) for i in range(2)]
    wrong = []

    def forward(weight):
        for _ in range(10_000):
            if not torch.equal(holder.of(weight), weight.half()):
                wrong.append(weight)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch every few bytecodes
    try:
        threads = [threading.Thread(target=forward, args=(w,)) for w in weights]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []


def test_a_saved_or_deep_copied_layer_leaves_its_copy_behind(device):
    """``torch.save(model)`` and ``copy.deepcopy`` (an EMA model) hold the weights but
    not their 16-bit copies, which the next forward remakes: the file is no larger than
    before any forward, and the loaded or copied layer computes what the original does."""
    import copy
    import io

    def saved(module):
        buffer = io.BytesIO()
        torch.save(module, buffer)
        return buffer.getvalue()

    layer = _layer(device, activation="relu")
    x = torch.randn(8, 48, device=device)
    before = len(saved(layer))
    out = layer(x)
    assert layer._weight_copy.tensor is not None
    data = saved(layer)
    assert len(data) == before
    loaded = torch.load(io.BytesIO(data), weights_only=False)
    for other in (loaded, copy.deepcopy(layer)):
        assert other._weight_copy.tensor is None
        assert torch.equal(other(x), out)


def test_a_layer_pickled_before_the_copy_was_one_attribute_still_loads(device, monkeypatch):
    """A layer pickled by an mpgemm before 2026-11-26 holds its copy holder's three
    attributes of then (``_tensor``, ``_made_from``, ``_source``): it loads, and its
    first forward remakes the copy."""
    import pickle

    from mpgemm.compute_copy import ComputeCopy

    layer = _layer(device, activation="relu")
    x = torch.randn(8, 48, device=device)
    expected = layer(x)
    old = {
        "dtype": layer.compute_dtype,
        "_tensor": torch.full((32, 48), float("nan"), dtype=layer.compute_dtype),
        "_made_from": (0,),
        "_source": torch.zeros(1),
        "_current_at": 0,
    }
    layer._weight_copy.__dict__ = old
    with monkeypatch.context() as patched:  # pickled as then: the whole dict
        patched.delattr(ComputeCopy, "__getstate__")
        data = pickle.dumps(layer)
    loaded = pickle.loads(data)
    assert loaded._weight_copy.tensor is None
    assert torch.equal(loaded(x), expected)


def _copy(layer):
    copy = mpgemm.compute_copy.copy_of(layer.weight)
    assert copy is not None and copy.dtype == layer.compute_dtype
    return copy


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: mpgemm.optim.Adam(ps, lr=0.1),
        lambda ps: mpgemm.optim.AdamW(ps, lr=0.1),
        lambda ps: mpgemm.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["adam", "adamw", "sgd"],
)
@pytest.mark.parametrize("compute_dtype", [torch.float16, torch.bfloat16])
def test_fused_optimizers_write_the_copy_in_their_step(device, make, compute_dtype):
    # 130 x 40: whole blocks of the optimizer kernels (2048 or 4096 elements) and a tail.
    torch.manual_seed(0)
    layer = mpgemm.Linear(130, 40, device=device, compute_dtype=compute_dtype)
    optimizer = make(layer.parameters())
    x = torch.randn(8, 130, device=device)
    for _ in range(3):
        layer(x).float().square().sum().backward()
        copy = _copy(layer)
        before = layer.weight.detach().clone()
        optimizer.step()
        optimizer.zero_grad()
        assert not torch.equal(layer.weight, before)
        # Written in the step: the copy is the new weight rounded, and the same tensor
        # the next forward reads, with no cast.
        assert torch.equal(copy, layer.weight.detach().to(compute_dtype))
        with OpLog() as log:
            layer(x)
        assert _copy(layer) is copy and not log.casts_of(layer.weight)
        _assert_forward_uses_the_current_weight(layer, device, in_features=130)


def test_an_edit_after_a_fused_step_or_a_failed_one_remakes_the_copy(device, monkeypatch):
    """A fused step bumps the weight's version once as it writes the copy, which stays
    current at that version; an in-place edit after it, one bump more, makes it stale.
    A step that raised may not have bumped: one edit after it is not taken for the
    step's bump."""
    layer = _layer(device)
    optimizer = mpgemm.optim.AdamW(layer.parameters(), lr=0.1)
    x = torch.randn(8, 48, device=device)
    layer(x).float().sum().backward()
    optimizer.step()
    _edit_in_place(layer)
    _assert_forward_uses_the_current_weight(layer, device)

    def fails(*args, **kwargs):
        raise RuntimeError("a launch failed")

    monkeypatch.setattr(mpgemm.optim, "adam_step_", fails)
    layer(x).float().sum().backward()
    with pytest.raises(RuntimeError, match="a launch failed"):
        optimizer.step()
    _edit_in_place(layer)
    _assert_forward_uses_the_current_weight(layer, device)


def test_a_storage_assigned_right_after_a_fused_step_remakes_the_copy(device):
    # weight.data = ... keeps the weight's version counter: the version the fused step
    # gave it, at which its copy is current. The storage tells them apart.
    layer = _layer(device)
    optimizer = mpgemm.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.randn(8, 48, device=device)).float().sum().backward()
    optimizer.step()
    version = layer.weight._version
    _data_assignment(layer)
    assert layer.weight._version == version
    _assert_forward_uses_the_current_weight(layer, device)


def test_a_skipped_step_leaves_weight_and_copy_alone(device):
    layer = _layer(device)
    optimizer = mpgemm.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(8, 48, device=device)).float().sum().backward()
    copy = _copy(layer)
    before, copy_before = layer.weight.detach().clone(), copy.clone()
    optimizer.found_inf = torch.ones((), device=device)
    optimizer.grad_scale = torch.ones((), device=device)
    optimizer.step()
    assert torch.equal(layer.weight, before) and torch.equal(copy, copy_before)


def test_a_training_step_feeds_16_bit_operands_and_fuses_the_forward_activation(device):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    ).to(device)
    mpgemm.convert(model)
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters(), lr=1e-3))
    x = torch.randn(32, 48, device=device)  # an FP32 input
    y = torch.randint(0, 10, (32,), device=device)

    def step():
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.scale_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the copies are made in the first forward
    launches, derivatives = [], []

    def run_and_keep(kernel, grid, args, kwargs, configs):
        name = jit_function(kernel).fn.__name__
        if name == "_activation_backward_kernel" or kwargs.get("RELU_GRAD"):
            derivatives.append(name)
        if name in ("_gemm_kernel", "_gemm_tma_kernel"):
            # The TMA kernel reads A and B through descriptors of the tensors.
            a, b = (getattr(t, "base", t) for t in args[:2])
            launches.append((name, a.dtype, b.dtype))
        kernel[grid](*args, **kwargs)

    with intercept(run_and_keep), OpLog() as log:
        step()
    # 3 forward GEMMs, then 2 + 2 + 1 backward (the input needs no gradient).
    assert len(launches) == 8
    # Every operand is 16-bit (weight copies, rounded inputs, 16-bit activations) but
    # the gradient of the FP32 logits, read once in FP32 by each of the head's two
    # backward GEMMs in the pointer kernel: as A of the input gradient (converted in
    # registers, it does not hold back the MMAs: the compile check), and as B of the
    # weight gradient, which runs as its transpose (x.T @ dY: the head has 10 rows) and
    # sums the head's bias gradient from it in FP32. Every other GEMM (sizes multiples
    # of 8) is the TMA kernel's.
    half, single = torch.float16, torch.float32
    fp32 = [launch for launch in launches if single in launch]
    assert fp32 == [("_gemm_kernel", single, half), ("_gemm_kernel", half, single)], launches
    rest = [launch for launch in launches if single not in launch]
    assert rest == [("_gemm_tma_kernel", half, half)] * 6, launches
    # ReLU is fused into the forward GEMMs' epilogue, and its derivative, with the bias
    # gradient's sums, runs in mpgemm's kernel for it (the fusion into the next layer's
    # input-gradient GEMM, functional._fusable_relu, is off: slower on an H200), a
    # launch per ReLU, the head's side first.
    names = log.names()
    assert not any(n.startswith(("relu", "threshold_backward")) for n in names), names
    assert derivatives == ["_activation_backward_kernel"] * 2
    for layer in model:
        if isinstance(layer, mpgemm.Linear):
            assert not log.casts_of(layer.weight), layer


def test_to_remakes_the_copy_for_the_new_storage(device):
    layer = _layer(device)
    layer(torch.randn(2, 48, device=device))
    old = _copy(layer)
    layer.double().float()
    # The old copy belongs to the old storage: the optimizers no longer write it, and
    # the next forward makes a new one.
    assert mpgemm.compute_copy.copy_of(layer.weight) is None
    layer(torch.randn(2, 48, device=device))
    assert _copy(layer) is not old


def test_an_fp32_input_is_rounded_once_and_saved_in_16_bits(device):
    layer = _layer(device)
    x = torch.randn(16, 48, device=device)
    y = layer(x)
    saved_x, saved_w = y.grad_fn.saved_tensors
    assert saved_x.dtype == saved_w.dtype == torch.float16
    assert torch.equal(saved_x, x.half()) and saved_w is _copy(layer)
    # A frozen layer's backward needs no weight gradient, so no rounding of x is made:
    # x is saved as it is (a LoRA-like step's frozen layers, each input already alive).
    layer.requires_grad_(False)
    x.requires_grad_()
    y = layer(x)  # (alive: its node, which frees the saved tensors as it dies, with it)
    saved_x, saved_w = y.grad_fn.saved_tensors
    assert saved_x.dtype == torch.float32 and torch.equal(saved_x, x)


def test_the_optimizers_registry_forgets_dropped_layers_and_replaced_weights():
    """A layer's weight is registered for the optimizers at its forward (``copy_of``
    finds its copy); a dropped layer's entry goes with it, a replaced weight's entry
    with the replacement's forward, and a weight never registered (perhaps at a dead
    one's address) has none."""
    import gc

    from mpgemm import compute_copy

    layer = _layer("cpu")
    layer(torch.randn(2, 48))
    entries = len(compute_copy._copies)
    key = id(layer.weight)
    assert compute_copy.copy_of(layer.weight) is layer._weight_copy.tensor
    old = layer.weight
    for _ in range(3):
        _new_parameter(layer)
        layer(torch.randn(2, 48))
        assert compute_copy.copy_of(layer.weight) is layer._weight_copy.tensor
    assert len(compute_copy._copies) == entries and compute_copy.copy_of(old) is None
    key = id(layer.weight)
    del layer
    gc.collect()
    assert key not in compute_copy._copies
    assert compute_copy.copy_of(nn.Parameter(torch.randn(32, 48))) is None


def test_a_layer_swapped_by_a_conversion_or_a_load_keeps_training(device):
    """Under ``set_swap_module_params_on_conversion``, ``.to()`` and ``load_state_dict``
    swap each parameter's contents (``torch.utils.swap_tensors``), which fails for a
    tensor with a weak reference; after them the fused optimizer writes the new copy."""
    layer = _layer(device)
    optimizer = mpgemm.optim.AdamW(layer.parameters(), lr=0.1)
    x = torch.randn(8, 48, device=device)
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        layer(x).float().sum().backward()
        optimizer.step()
        weight = layer.weight
        layer.half()
        assert layer.weight is weight and weight.dtype == torch.float16
        layer.float()
        layer.load_state_dict(nn.Linear(48, 32, device=device).state_dict())
        assert layer.weight is weight
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    _assert_forward_uses_the_current_weight(layer, device)
    layer.zero_grad()
    layer(x).float().sum().backward()
    copy = _copy(layer)
    optimizer.step()
    assert torch.equal(copy, layer.weight.detach().half())
    _assert_forward_uses_the_current_weight(layer, device)


def test_copies_a_capture_used_outlive_their_remaking(monkeypatch):
    """A copy that a CUDA graph's capture read (a forward) or wrote (an optimizer's step)
    stays allocated when the layer remakes its copy, since every replay uses it again:
    another optimizer's step, then an eager forward, remake it. Outside a capture, the
    remade copy's old tensor goes."""
    import gc
    import weakref

    from mpgemm import compute_copy, graphs

    monkeypatch.setattr(graphs, "_kept_for_replays", [])
    layer = _layer("cpu")
    other = _OwnKernelsSGD([nn.Parameter(torch.ones(1))])
    old = {}
    for capturing in (True, False):
        monkeypatch.setattr(graphs, "capturing", lambda device, c=capturing: c)
        layer(torch.randn(2, 48))
        old["read", capturing] = weakref.ref(layer._weight_copy.tensor)
        params = [layer.weight, layer.bias]  # as an optimizer's step asks, to write them
        written = compute_copy.copies_of(params)
        assert written[0] is layer._weight_copy.tensor and written[1] is layer.bias
        del written
        monkeypatch.setattr(graphs, "capturing", lambda device: False)
        other.step()  # a step that may write without a bump: the copy is stale now
        layer(torch.randn(2, 48))  # remade
        gc.collect()
    assert old["read", True]() is not None and old["read", False]() is None
    assert len(graphs._kept_for_replays) == 2  # the forward's read and the step's write


def test_a_model_made_on_the_meta_device_runs_there_and_trains_after_to_empty(device):
    """Deferred initialisation (FSDP2's, torchtitan's): made on the meta device, the
    model runs there for its shapes (its copies on the meta device too), then takes
    real storage with ``to_empty`` and trains, its copies remade from the new weights."""
    with torch.device("meta"):
        model = mpgemm.convert(nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 10)))
        assert model(torch.randn(4, 48)).shape == (4, 10)
    model.to_empty(device=device)
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    optimizer = mpgemm.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 48, device=device)).float().sum().backward()
    optimizer.step()
    for layer in (model[0], model[2]):
        _assert_forward_uses_the_current_weight(layer, device, layer.in_features)
