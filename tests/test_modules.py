"""mpgemm.Linear as a drop-in nn.Linear, and mpgemm.convert on whole models."""

import copy
import warnings

import pytest
import torch
from torch import nn

import mpgemm


def mlp(device):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(33, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10)
    ).to(device)


def test_linear_is_an_nn_linear_with_fp32_parameters(device):
    layer = mpgemm.Linear(33, 16, device=device)
    assert isinstance(layer, nn.Linear)
    assert layer.weight.dtype == layer.bias.dtype == torch.float32
    assert "compute_dtype=torch.float16" in repr(layer)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(2, 5, 33, device=device, dtype=dtype)
        assert layer(x).shape == (2, 5, 16)
        assert layer(x).dtype == torch.float16


def test_state_dict_loads_both_ways(device):
    plain = nn.Linear(33, 16, device=device)
    ours = mpgemm.Linear(33, 16, device=device)
    ours.load_state_dict(plain.state_dict())
    assert torch.equal(ours.weight, plain.weight) and torch.equal(ours.bias, plain.bias)
    again = nn.Linear(33, 16, device=device)
    again.load_state_dict(ours.state_dict())
    assert torch.equal(again.weight, plain.weight)
    no_bias = mpgemm.Linear(33, 16, bias=False, device=device)
    assert set(no_bias.state_dict()) == set(nn.Linear(33, 16, bias=False).state_dict())


def test_linear_output_tracks_fp32_nn_linear(device):
    plain = nn.Linear(130, 33, device=device)
    ours = mpgemm.Linear(130, 33, device=device, out_dtype=torch.float32, activation="gelu")
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(16, 130, device=device)
    expected = nn.functional.gelu(plain(x))
    torch.testing.assert_close(ours(x), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_layer_built_in_a_dtype_is_the_layer_cast_to_it(device, dtype):
    """nn.Linear's dtype argument: the parameters' dtype, as .to(dtype) makes it, the
    compute dtype following a 16-bit one unless compute_dtype is given."""
    torch.manual_seed(1)
    built = mpgemm.Linear(16, 8, device=device, dtype=dtype, activation="gelu")
    torch.manual_seed(1)
    cast = mpgemm.Linear(16, 8, device=device, activation="gelu").to(dtype)
    assert built.weight.dtype == built.bias.dtype == dtype
    assert built.compute_dtype == cast.compute_dtype
    built.load_state_dict(cast.state_dict())
    x = torch.randn(4, 16, device=device, dtype=dtype)
    assert torch.equal(built(x), cast(x))
    if dtype != torch.float64:  # its parameters are the operands: they set the dtype
        assert mpgemm.Linear(4, 4, dtype=dtype, compute_dtype=dtype).compute_dtype == dtype
        other = torch.bfloat16 if dtype == torch.float16 else torch.float16
        with pytest.raises(ValueError, match="give one or the other"):
            mpgemm.Linear(4, 4, dtype=dtype, compute_dtype=other)


def test_linear_refuses_bad_options():
    with pytest.raises(TypeError, match="compute_dtype"):
        mpgemm.Linear(4, 4, compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="'tanh'"):
        mpgemm.Linear(4, 4, activation="tanh")


def test_convert_reuses_parameters_and_keeps_the_optimizer_working(device):
    model = mlp(device)
    params_before = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    converted = mpgemm.convert(model)

    assert converted is model
    assert [type(m) for m in model if isinstance(m, nn.Linear)] == [mpgemm.Linear] * 3
    assert all(p is q for p, q in zip(model.parameters(), params_before, strict=True))
    # The mixed-precision rule: hidden layers write FP16, the logits come out FP32.
    assert [m.out_dtype for m in model if isinstance(m, mpgemm.Linear)] == [
        None,
        None,
        torch.float32,
    ]
    x = torch.randn(8, 33, device=device)
    logits = model(x)
    assert logits.dtype == torch.float32
    before = model[0].weight.detach().clone()
    nn.functional.cross_entropy(logits, torch.arange(8, device=device)).backward()
    optimizer.step()
    assert not torch.equal(model[0].weight, before)


def test_convert_filter_and_output_choice(device):
    model = mlp(device)
    mpgemm.convert(
        model,
        module_filter_fn=lambda module, name: name != "0",
        compute_dtype=torch.bfloat16,
        keep_output_fp32="2",
    )
    assert type(model[0]) is nn.Linear
    assert model[2].compute_dtype == torch.bfloat16 and model[2].out_dtype == torch.float32
    assert model[4].out_dtype is None

    none_fp32 = mpgemm.convert(mlp(device), keep_output_fp32=False)
    assert none_fp32(torch.randn(2, 33, device=device)).dtype == torch.float16
    with pytest.raises(ValueError, match="'head'"):
        mpgemm.convert(mlp(device), keep_output_fp32="head")


def test_convert_warns_of_lazy_layers_it_cannot_convert_yet(device):
    """An nn.LazyLinear becomes an nn.Linear at its first forward: before it, convert
    leaves it (with a warning naming it, unless the filter excludes it); after it,
    converts it."""

    def model():
        return nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 4)).to(device)

    early = model()
    with pytest.warns(UserWarning, match=r"'0'.*first forward"):
        mpgemm.convert(early)
    assert type(early[0]) is nn.LazyLinear and type(early[2]) is mpgemm.Linear
    dry_run = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpgemm.convert(model(), module_filter_fn=lambda layer, name: name != "0")
        dry_run(torch.randn(2, 8, device=device))  # initialised: an nn.Linear now
        mpgemm.convert(dry_run)
    assert type(dry_run[0]) is mpgemm.Linear and dry_run[0].activation == "relu"
    assert dry_run[2].out_dtype == torch.float32


def test_convert_warns_of_parametrized_layers_and_a_converted_layer_takes_them(device):
    """``torch.nn.utils.parametrize`` makes an nn.Linear a class of its own, which convert
    leaves as it is, with a warning naming it (unless the filter excludes it) and what to
    do instead: parametrize the converted layer, which then computes with the
    parametrized weight."""
    from torch.nn.utils.parametrizations import weight_norm

    def model():
        torch.manual_seed(0)
        return nn.Sequential(weight_norm(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 4)).to(device)

    left = model()
    with pytest.warns(UserWarning, match=r"'0'.*parametrized.*convert first"):
        mpgemm.convert(left)
    assert type(left[0]).__bases__ == (nn.Linear,) and type(left[2]) is mpgemm.Linear
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mpgemm.convert(model(), module_filter_fn=lambda layer, name: name != "0")
        first = mpgemm.convert(nn.Sequential(nn.Linear(8, 16).to(device), nn.ReLU()))
    torch.manual_seed(0)
    reference = weight_norm(nn.Linear(8, 16)).to(device)
    with torch.no_grad():
        first[0].weight.copy_(reference.parametrizations.weight.original1)
        first[0].bias.copy_(reference.bias)
    weight_norm(first[0])
    x = torch.randn(4, 8, device=device)
    # The weight in 16 bits and requiring grad, as the layer's copy and weight: the
    # same kernel runs (an FP32 weight takes the pointer kernel, whose FP32 sums, in
    # another order, may differ in the last bit).
    weight = reference.weight.half()
    expected = mpgemm.linear(x, weight, reference.bias, activation="relu", out_dtype=torch.float32)
    assert torch.equal(first(x), expected)  # (the output layer: FP32)


def test_convert_a_bare_linear_returns_the_replacement(device):
    layer = nn.Linear(8, 4, device=device)
    converted = mpgemm.convert(layer)
    assert type(converted) is mpgemm.Linear and converted.weight is layer.weight
    assert converted.out_dtype == torch.float32


def test_convert_reaches_nested_layers_by_their_qualified_names(device):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    names = []
    model = mpgemm.convert(
        Net().to(device),
        module_filter_fn=lambda module, name: names.append(name) or name != "blocks.1.fc",
    )
    assert names == ["blocks.0.fc", "blocks.1.fc", "head"]
    assert type(model.blocks[0].fc) is mpgemm.Linear
    assert type(model.blocks[1].fc) is nn.Linear
    assert model.head.out_dtype == torch.float32 and model.blocks[0].fc.out_dtype is None
    # blocks.1.fc stays FP32 nn.Linear and must receive FP32: pass it FP32 input.
    model.blocks[0].fc.out_dtype = torch.float32
    assert model(torch.randn(3, 16, device=device)).dtype == torch.float32


def test_convert_replaces_a_reused_layer_everywhere_and_fuses_it_only_once_placed(device):
    """A layer registered in several places (one module reused) becomes one
    mpgemm.Linear in all of them, and keeps the output's FP32 when named by any of its
    names. Reused in two places of a Sequential, the activation after one of them is not
    fused (it would follow every call); inside a block that is itself reused, the layer
    has one place, and is fused."""
    torch.manual_seed(0)
    layer = nn.Linear(33, 33)
    twice = nn.Sequential(layer, nn.ReLU(), layer, nn.Linear(33, 4)).to(device)
    unfused = mpgemm.convert(copy.deepcopy(twice), fuse_activations=False)
    mpgemm.convert(twice)
    assert type(twice[0]) is mpgemm.Linear and twice[0] is twice[2]
    assert type(twice[1]) is nn.ReLU and twice[0].activation is None
    x = torch.randn(8, 33, device=device)
    assert torch.equal(twice(x), unfused(x))

    block = nn.Sequential(nn.Linear(33, 33), nn.ReLU())
    reused = nn.Sequential(block, block, nn.Linear(33, 4)).to(device)
    # The first layer named by its other name, as the output to keep in FP32.
    unfused = mpgemm.convert(copy.deepcopy(reused), keep_output_fp32="1.0", fuse_activations=False)
    mpgemm.convert(reused, keep_output_fp32="1.0")
    assert reused[0] is reused[1] and type(block[1]) is nn.Identity
    assert block[0].activation == "relu" and block[0].out_dtype == torch.float32
    assert reused[2].out_dtype is None
    assert torch.equal(reused(x), unfused(x))


def assert_computes_like(model, reference, device):
    """A converted model's output and parameter gradients within 16-bit tolerances of
    ``reference``'s, the same weights unconverted, in FP32 (33 input features)."""
    x = torch.randn(8, 33, device=device)
    torch.testing.assert_close(model(x), reference(x), rtol=2e-2, atol=2e-2)
    model(x).sum().backward()
    reference(x).sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=5e-2, atol=5e-2)


def test_convert_fuses_a_following_relu_or_exact_gelu(device):
    model = mlp(device)
    keys = list(model.state_dict())
    reference = mlp(device)  # the same weights, unconverted, in FP32
    mpgemm.convert(model)
    assert [type(m) for m in model] == [
        mpgemm.Linear,
        nn.Identity,
        mpgemm.Linear,
        nn.Identity,
        mpgemm.Linear,
    ]
    assert [m.activation for m in model if isinstance(m, mpgemm.Linear)] == ["relu", "gelu", None]
    assert list(model.state_dict()) == keys
    assert_computes_like(model, reference, device)


@pytest.mark.parametrize(
    "make, activation",
    [(nn.SiLU, "silu"), (lambda: nn.GELU(approximate="tanh"), "gelu_tanh")],
    ids=["silu", "gelu_tanh"],
)
def test_convert_fuses_silu_and_tanh_gelu(device, make, activation):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 64), make(), nn.Linear(64, 10)).to(device)
    reference = nn.Sequential(nn.Linear(33, 64), make(), nn.Linear(64, 10)).to(device)
    reference.load_state_dict(model.state_dict())
    mpgemm.convert(model)
    assert type(model[1]) is nn.Identity and model[0].activation == activation
    assert_computes_like(model, reference, device)


def test_convert_fuses_only_what_computes_the_same(device):
    model = nn.Sequential(
        nn.Linear(8, 8),
        nn.LeakyReLU(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 4),
        nn.ReLU(),
    ).to(device)
    mpgemm.convert(model)
    assert type(model[1]) is nn.LeakyReLU and type(model[3]) is nn.Tanh
    assert [model[0].activation, model[2].activation] == [None, None]
    # The output layer's ReLU fuses too: applied to the FP32 accumulator, written FP32.
    assert type(model[5]) is nn.Identity and model[4].activation == "relu"
    assert model(torch.randn(2, 8, device=device)).dtype == torch.float32

    unfused = mpgemm.convert(mlp(device), fuse_activations=False)
    assert type(unfused[1]) is nn.ReLU and unfused[0].activation is None


def test_convert_keeps_each_layers_hooks(device):
    """Forward, backward and state-dict hooks move to the replacement, as torch's own
    module swaps keep forward hooks, and a handle taken before still removes its hook."""
    model = mlp(device)
    seen = []
    first, head = model[0], model[4]
    first.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    first.register_forward_hook(lambda m, args, out: seen.append(("out", out.dtype)))
    handle = first.register_forward_hook(lambda m, args, out: seen.append("removed"))
    head.register_full_backward_hook(lambda m, gin, gout: seen.append(("grad", gout[0].shape)))
    head.register_state_dict_pre_hook(lambda m, prefix, keep_vars: seen.append("state pre"))
    head.register_state_dict_post_hook(lambda m, sd, prefix, local: seen.append("state"))
    head.register_load_state_dict_pre_hook(lambda m, sd, prefix, *rest: seen.append("load pre"))
    head.register_load_state_dict_post_hook(lambda m, keys: seen.append("load"))
    # Called also when the forward raises.
    head.register_forward_hook(lambda m, args, out: seen.append("always"), always_call=True)

    mpgemm.convert(model)
    handle.remove()
    model(torch.randn(4, 33, device=device)).sum().backward()
    model.load_state_dict(model.state_dict())
    assert seen == [
        "pre",
        ("out", torch.float16),
        "always",
        ("grad", (4, 10)),
        "state pre",
        "state",
        "load pre",
        "load",
    ]
    seen.clear()
    with pytest.raises(ValueError):
        model[4](torch.randn(4, 3, device=device))  # 3 features where it takes 64
    assert seen == ["always"]


def test_convert_keeps_buffers_and_which_are_persistent(device):
    """A layer's buffers move to the replacement, a non-persistent one staying out of
    the state dict, as on the nn.Linear."""
    layer = nn.Linear(8, 4).to(device)
    layer.register_buffer("kept", torch.ones(4, device=device))
    layer.register_buffer("scratch", torch.zeros(4, device=device), persistent=False)
    keys = list(layer.state_dict())
    converted = mpgemm.convert(layer)
    assert converted.kept is layer.kept and converted.scratch is layer.scratch
    assert list(converted.state_dict()) == keys == ["weight", "bias", "kept"]


def test_convert_does_not_fuse_where_a_hook_would_see_otherwise(device):
    """A layer with a hook on its output (or on its gradient) keeps its activation
    module, so that the hook sees the pre-activation output it saw on nn.Linear; an
    activation module with a hook is kept, so that its hook runs."""
    model = mlp(device)
    reference = mlp(device)
    ours_seen, theirs_seen = [], []
    for net, log in ((model, ours_seen), (reference, theirs_seen)):
        net[0].register_forward_hook(lambda m, args, out, log=log: log.append(out.float()))
        net[3].register_forward_pre_hook(lambda m, args, log=log: log.append(args[0].float()))
    mpgemm.convert(model)
    assert [type(m) for m in model] == [
        mpgemm.Linear,
        nn.ReLU,
        mpgemm.Linear,
        nn.GELU,
        mpgemm.Linear,
    ]
    assert [m.activation for m in model if isinstance(m, mpgemm.Linear)] == [None, None, None]
    x = torch.randn(8, 33, device=device)
    model(x), reference(x)
    for ours, theirs in zip(ours_seen, theirs_seen, strict=True):
        assert (ours < 0).any()  # before the activations, as the hooks saw them
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("hook", ["forward", "full_backward", "full_backward_pre"])
def test_a_hook_on_a_layers_output_or_its_gradient_keeps_the_activation_apart(device, hook):
    # Such a hook sees the layer's output, or the gradient there, before the ReLU: fused,
    # it would see the ReLU's output, or the gradient at it (nonzero where the ReLU
    # passes none back).
    seen = []
    for net in (mlp(device), mlp(device)):
        log: list[torch.Tensor] = []
        seen.append(log)
        if hook == "forward":
            net[0].register_forward_hook(lambda m, args, out, log=log: log.append(out.float()))
        elif hook == "full_backward":
            net[0].register_full_backward_hook(lambda m, gi, go, log=log: log.append(go[0].float()))
        else:
            net[0].register_full_backward_pre_hook(lambda m, go, log=log: log.append(go[0].float()))
        if not seen[1:]:  # the first: converted
            mpgemm.convert(net)
            assert type(net[1]) is nn.ReLU and net[0].activation is None
        x = torch.randn(8, 33, generator=torch.Generator().manual_seed(1)).to(device)
        net(x.requires_grad_()).sum().backward()
    ours, theirs = seen
    assert len(ours) == len(theirs) == 1
    # (the gradient before the ReLU: zeros where it passes none back, as fused it would)
    assert (theirs[0] < 0).any() if hook == "forward" else (theirs[0] == 0).any()
    torch.testing.assert_close(ours[0], theirs[0], rtol=2e-2, atol=2e-2)


def test_convert_fuses_nothing_outside_an_nn_sequential(device):
    # Only an nn.Sequential calls its modules in their order: a ModuleList's order is
    # whatever the forward makes it (here the ReLU first).
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(33, 16), nn.ReLU()])

        def forward(self, x):
            return self.layers[0](self.layers[1](x))

    torch.manual_seed(0)
    model, reference = Net().to(device), Net().to(device)
    reference.load_state_dict(model.state_dict())
    mpgemm.convert(model, keep_output_fp32=False)
    assert type(model.layers[1]) is nn.ReLU and model.layers[0].activation is None
    x = torch.randn(8, 33, device=device)
    assert (reference(x) < 0).any()
    torch.testing.assert_close(model(x).float(), reference(x), rtol=2e-2, atol=2e-2)


def test_convert_leaves_subclasses_that_compute_otherwise(device):
    # An nn.Linear or nn.ReLU subclass may have a forward of its own: neither converted
    # nor fused.
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Clipped(nn.ReLU):
        def forward(self, x):
            return super().forward(x).clamp(max=0.1)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(33, 16), Clipped(), Doubled(16, 10)).to(device)

    model, reference = make(), make()
    mpgemm.convert(model)
    assert [type(m) for m in model] == [mpgemm.Linear, Clipped, Doubled]
    assert model[0].activation is None
    x = torch.randn(8, 33, device=device)
    torch.testing.assert_close(model(x).float(), reference(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("cast", ["bfloat16", "half", "to"])
def test_casting_a_layer_to_16_bits_makes_that_the_compute_dtype(device, cast):
    layer = mpgemm.Linear(16, 8, device=device)  # compute_dtype float16 by default
    dtype = torch.float16 if cast == "half" else torch.bfloat16
    layer = layer.to(dtype) if cast == "to" else getattr(layer, cast)()
    assert layer.weight.dtype == layer.bias.dtype == layer.compute_dtype == dtype
    # BF16 reaches 3e38: no inf where an FP16 product would overflow at 65504.
    x = torch.full((4, 16), 3e4, device=device, dtype=dtype)
    y = layer(x)
    assert y.dtype == dtype
    expected = mpgemm.reference.linear_ref(x, layer.weight, layer.bias, compute_dtype=dtype)
    torch.testing.assert_close(y, expected)
    if dtype == torch.bfloat16:
        assert torch.isfinite(y).all()
    # Back to FP32 masters: the compute dtype stays what it last was, and the layer
    # computes in it, its weight's 16-bit copy remade in that dtype (the copy made at
    # construction was FP16), as a layer built so does.
    assert layer.float().compute_dtype == dtype
    with torch.no_grad():  # FP32 masters of their own (a 16-bit value rounds as itself)
        layer.weight.copy_(torch.randn(8, 16, device=device))
    built = mpgemm.Linear(16, 8, device=device, compute_dtype=dtype)
    built.load_state_dict(layer.state_dict())
    x = torch.randn(4, 16, device=device)
    assert torch.equal(layer(x), built(x))
    # So too where compute_dtype is assigned after a forward.
    layer.compute_dtype = built.compute_dtype = torch.float16
    assert torch.equal(layer(x), built(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_converting_a_16_bit_model_computes_in_its_dtype(device, dtype):
    """A model already in 16 bits keeps computing in its dtype (a BF16 model's
    activations beyond FP16's 65504 stay finite): compute_dtype is what FP32 weights
    are rounded to."""
    model = mpgemm.convert(mlp(device).to(dtype))
    assert [layer.compute_dtype for layer in model[::2]] == [dtype] * 3
    # BF16 inputs beyond FP16's range (3e5), outputs too (some 4e5).
    x = torch.full((4, 33), 3e5 if dtype == torch.bfloat16 else 1.0, device=device, dtype=dtype)
    first = model[0](x)
    expected = mpgemm.reference.linear_ref(
        x, model[0].weight, model[0].bias, activation="relu", compute_dtype=dtype
    )
    torch.testing.assert_close(first, expected)
    if dtype == torch.bfloat16:
        assert first.amax() > 65504 and torch.isfinite(first).all()
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    chosen = mpgemm.convert(mlp(device).to(dtype), compute_dtype=other)
    assert [layer.compute_dtype for layer in chosen[::2]] == [dtype] * 3
    assert mpgemm.convert(mlp(device))[0].compute_dtype == torch.float16  # FP32 masters
    assert mpgemm.convert(mlp(device), compute_dtype=other)[0].compute_dtype == other


def test_a_weight_that_arrives_in_16_bits_computes_in_its_dtype(device):
    """A weight that is 16-bit at the forward, whatever the layer was built with (as
    FSDP2's param_dtype casts the gathered weight, with no _apply), is the GEMMs' operand
    as it is: a BF16 weight computes in BF16, beyond FP16's range."""
    layer = mpgemm.Linear(33, 8, device=device)  # FP32 masters, rounded to FP16
    layer.weight = nn.Parameter(layer.weight.detach().bfloat16())
    layer.bias = nn.Parameter(layer.bias.detach().bfloat16())
    assert layer.compute_dtype == torch.float16
    x = torch.full((4, 33), 3e5, device=device, dtype=torch.bfloat16)
    y = layer(x)
    expected = mpgemm.reference.linear_ref(
        x, layer.weight, layer.bias, compute_dtype=torch.bfloat16
    )
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all() and y.abs().amax() > 65504
    torch.testing.assert_close(y, expected)


def test_a_layer_cast_to_fp64_computes_as_torch_in_fp64(device):
    """FP64 is outside mixed precision, as for torch.autocast: a converted model cast
    with .double() gives torch's FP64 model's outputs and gradients bit for bit (fused
    activations by torch's functions), and passes gradcheck."""
    theirs = mlp(device).double()
    ours = mpgemm.convert(mlp(device)).double()
    assert type(ours[0]) is mpgemm.Linear and ours[0].activation == "relu"
    x = torch.randn(5, 33, device=device, dtype=torch.float64)
    outs = [model(x) for model in (ours, theirs)]
    assert outs[0].dtype == torch.float64  # not the head's FP32: torch's FP64 layer's
    assert torch.equal(outs[0], outs[1])
    for out in outs:
        out.square().sum().backward()
    for mine, reference in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(mine.grad, reference.grad)
    layer = mpgemm.Linear(6, 4, activation="silu", device=device).double()
    inputs = torch.randn(3, 6, device=device, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (inputs,))
    with pytest.raises(RuntimeError, match="dtype"):  # torch's own error, as nn.Linear's
        layer(inputs.float())


@pytest.mark.parametrize("norm", ["spectral_norm", "weight_norm"])
def test_convert_keeps_the_hook_based_norms_as_it_keeps_pruning(device, norm):
    """``torch.nn.utils.spectral_norm`` and the older ``weight_norm`` make a layer's
    weight as pruning does (a forward pre-hook, from Parameters and buffers of their
    own): converted, the layer keeps them, its state-dict keys, and its gradients'
    way to them, and computes what the unconverted model does, within 16-bit rounding."""
    import warnings

    def model():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the older weight_norm's deprecation
            layer = getattr(nn.utils, norm)(nn.Linear(33, 16))
        return nn.Sequential(layer, nn.ReLU(), nn.Linear(16, 4)).to(device).eval()

    reference, converted = model(), mpgemm.convert(model())
    assert type(converted[0]) is mpgemm.Linear
    assert list(converted.state_dict()) == list(reference.state_dict())
    assert_computes_like(converted, reference, device)
    for name, param in converted.named_parameters():
        assert param.grad is not None, name


def test_a_model_made_under_inference_mode_serves_as_one_made_outside(device):
    """A model made (or loaded) under ``torch.inference_mode`` has inference tensors for
    weights, which keep no version counter: its layers cast them at each forward (the
    copy could not tell a change), giving what the same model made outside gives, and
    an in-place change of its weights reaches the next forward, as for nn.Linear."""
    x = torch.randn(5, 33, device=device)
    normal = mpgemm.convert(mlp(device))
    with torch.inference_mode():
        served = mpgemm.convert(mlp(device))
        assert served[0].weight.is_inference()
        assert torch.equal(served(x), normal(x))
        served[2].weight.mul_(2)
        with torch.no_grad():
            normal[2].weight.mul_(2)
        assert torch.equal(served(x), normal(x))


def test_convert_keeps_a_pruned_layers_mask_and_hook(device):
    """``torch.nn.utils.prune`` leaves an ``nn.Linear`` whose ``weight`` is a plain
    attribute, remade before each forward from the ``weight_orig`` Parameter and the
    ``weight_mask`` buffer: converted, the layer keeps all three and the hook (same
    state-dict keys), computes with the masked weight, trains ``weight_orig`` through the
    mask, and ``prune.remove`` still makes the pruning permanent."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    layer = nn.Linear(33, 16).to(device)
    prune.l1_unstructured(layer, "weight", amount=0.5)
    keys = list(layer.state_dict())
    mask = layer.weight_mask.clone()
    weight = layer.weight
    model = mpgemm.convert(nn.Sequential(layer, nn.ReLU()), keep_output_fp32=False)
    converted = model[0]
    # The masked weight is there before any forward, as on the pruned nn.Linear.
    assert converted.weight is weight
    assert type(converted) is mpgemm.Linear and converted.activation == "relu"
    assert list(converted.state_dict()) == keys == ["bias", "weight_orig", "weight_mask"]
    assert converted.weight_orig is layer.weight_orig
    assert converted.weight_mask is layer.weight_mask
    x = torch.randn(8, 33, device=device)
    with torch.no_grad():
        converted.weight_orig.add_(1.0)  # the next forward's weight is remade from it
    masked = (converted.weight_orig * mask).detach().requires_grad_()
    bias = converted.bias.detach().requires_grad_()
    expected = mpgemm.linear(x, masked, bias, activation="relu")
    out = model(x)
    assert torch.equal(out, expected)
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    assert torch.equal(converted.weight_orig.grad, masked.grad * mask)
    assert torch.equal(converted.bias.grad, bias.grad)
    prune.remove(converted, "weight")
    assert isinstance(converted.weight, nn.Parameter)
    assert list(converted.state_dict()) == ["bias", "weight"]
    assert torch.equal(model(x), expected)


def test_repr_shows_out_dtype_as_set(device):
    model = mpgemm.convert(mlp(device))
    assert "out_dtype=None" in repr(model[0])  # the compute dtype's
    assert "out_dtype=torch.float32" in repr(model[4])  # the logits


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(device, reentrant):
    """torch.utils.checkpoint over converted layers (fused ReLU and GELU): the forward
    runs again in the backward (under no_grad first, when reentrant) and the gradients
    are those of the plain model, bit for bit."""
    x = torch.randn(16, 33, device=device)
    grads = []
    for checkpointed in (False, True):
        model = mpgemm.convert(mlp(device))
        inputs = x.clone().requires_grad_(reentrant)  # (reentrant needs an input that does)
        hidden = model[:4]
        if checkpointed:
            h = torch.utils.checkpoint.checkpoint(hidden, inputs, use_reentrant=reentrant)
        else:
            h = hidden(inputs)
        model[4](h).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(*grads, strict=True):
        assert torch.equal(got, want)
