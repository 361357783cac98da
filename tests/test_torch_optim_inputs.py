"""mpgemm.optim held to torch's own optimizer test inputs: the constructor keywords
(``optim_inputs_func``) and the bad inputs with the errors they must raise
(``optim_error_inputs_func``) that torch's ``OptimizerInfo`` database gives its own
SGD, Adam and AdamW (``torch.testing._internal.common_optimizers``, shipped with torch).
A new torch brings its new configurations here unasked."""

import copy
import warnings

import pytest
import torch

import mpgemm

# It needs expecttest, which the test extra installs; the H100 image lacks it.
common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")
OptimizerErrorEnum, optim_db = common_optimizers.OptimizerErrorEnum, common_optimizers.optim_db

OURS = {torch.optim.SGD: mpgemm.optim.SGD, torch.optim.Adam: mpgemm.optim.Adam}
OURS[torch.optim.AdamW] = mpgemm.optim.AdamW
INFOS = {info.optim_cls.__name__: info for info in optim_db if info.optim_cls in OURS}
# Implementation flags mpgemm's fused optimizers refuse, with a ValueError naming them.
REFUSED = ("foreach", "differentiable")


def configurations(info, device):
    """(description, keywords): torch's inputs for this device's type and for CUDA
    (capturable, tensor betas of several shapes), once each."""
    seen = {}
    for kind in (device.type, "cuda"):
        for optim_input in info.optim_inputs_func(kind):
            seen.setdefault(optim_input.desc, optim_input.kwargs)
    return list(seen.items())


def _params(device):
    torch.manual_seed(0)
    shapes = [(10, 5), (5,), (3, 4, 2), (), (0, 3)]
    return [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in shapes]


def _groups(params, kwargs):
    """Two param groups, the second with a learning rate of its own (a float, or a
    tensor where the configuration's is one)."""
    lr = kwargs.get("lr", 1e-3)
    own = torch.tensor(0.05) if isinstance(lr, torch.Tensor) else 0.05
    return [{"params": params[:3]}, {"params": params[3:], "lr": own}]


def _state(optimizer):
    return [optimizer.state[p] for group in optimizer.param_groups for p in group["params"]]


def _assert_same_trajectory(ours, theirs, what):
    """mpgemm's optimizer ``ours`` holds what torch's ``theirs`` holds: parameters and
    every state torch keeps, to FP32 rounding. A damped SGD of ours also keeps a step
    count, which torch's SGD keeps on loading but neither reads nor advances."""
    for p, q in zip(ours.param_groups, theirs.param_groups, strict=True):
        for a, b in zip(p["params"], q["params"], strict=True):
            torch.testing.assert_close(a, b, msg=what)
    for a, b in zip(_state(ours), _state(theirs), strict=True):
        kept = b.keys() - {"step"} if isinstance(theirs, torch.optim.SGD) else b.keys()
        assert kept <= a.keys() <= kept | {"step"}, what
        for key in kept:
            torch.testing.assert_close(a[key], b[key], check_device=False, msg=f"{what}: {key}")


@pytest.mark.parametrize("name", sorted(INFOS))
def test_torchs_configurations_step_as_torch(name, path_device):
    """Each configuration torch tests its optimizer with, as given (float or tensor
    ``lr`` and ``betas``, AMSGrad, weight decay, maximize, dampening, Nesterov,
    capturable), over two param groups with a parameter of no elements and one left
    without a gradient every other step: 6 steps track torch's own optimizer, and each
    state dict then loads into the other and steps on as it does. On the kernels, and
    on the reference path (a CPU user's optimizer steps: torch ops of mpgemm's own)."""
    device = path_device
    info = INFOS[name]
    for desc, kwargs in configurations(info, device):
        theirs_kwargs = copy.deepcopy(kwargs)
        if device.type == "cpu":
            # torch keeps capturable steps on an accelerator only; it changes no value.
            theirs_kwargs.pop("capturable", None)
        else:
            # torch's for-loop implementation takes every configuration (its foreach
            # one refuses a tensor lr unless capturable).
            theirs_kwargs["foreach"] = False
        params = _params(device)
        twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
        ours = OURS[info.optim_cls](_groups(params, kwargs), **copy.deepcopy(kwargs))
        theirs = info.optim_cls(_groups(twins, kwargs), **theirs_kwargs)
        for step in range(6):
            for i, (p, q) in enumerate(zip(params, twins, strict=True)):
                if i == 1 and step % 2:
                    p.grad = q.grad = None
                    continue
                p.grad = torch.randn_like(p)
                q.grad = p.grad.clone()
            ours.step()
            theirs.step()
            _assert_same_trajectory(ours, theirs, f"{desc}, step {step}")
        # Each state dict into the other's optimizer, over copies of its parameters.
        for source, target_cls, target_kwargs, ps in (
            (ours, info.optim_cls, theirs_kwargs, params),
            (theirs, OURS[info.optim_cls], kwargs, twins),
        ):
            copies = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            loaded = target_cls(_groups(copies, kwargs), **copy.deepcopy(target_kwargs))
            state_dict = copy.deepcopy(source.state_dict())
            for group in state_dict["param_groups"]:
                if "capturable" not in target_kwargs and "capturable" in group:
                    group["capturable"] = False  # as above
            loaded.load_state_dict(state_dict)
            for p, q in zip(copies, ps, strict=True):
                p.grad = torch.ones_like(p)
                q.grad = torch.ones_like(q)
            loaded.step()
            source.step()
            pair = (source, loaded) if source is ours else (loaded, source)
            _assert_same_trajectory(*pair, f"{desc}: {type(source).__module__}'s loaded")


def _construct_and_step(cls, params, error_input):
    optimizer = cls(params, **error_input.optimizer_error_input.kwargs)
    if error_input.error_on == OptimizerErrorEnum.STEP_ERROR:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.randn_like(p)
        optimizer.step()


@pytest.mark.parametrize("name", sorted(INFOS))
def test_torchs_bad_inputs_raise_as_torch(name):
    """torch's error inputs (CPU: its device-free checks) raise what torch's optimizer
    raises, or warn as it warns, with its message; where an input asks for an
    implementation the fused kernels refuse (``foreach=True``), the same error type
    with a message naming the keyword."""
    info = INFOS[name]
    error_inputs = info.optim_error_inputs_func("cpu", torch.float32)
    assert error_inputs, name
    for error_input in error_inputs:
        optim_input = error_input.optimizer_error_input
        params = optim_input.params
        if params is None:
            params = [torch.nn.Parameter(torch.randn(2))]
        refused = [flag for flag in REFUSED if optim_input.kwargs.get(flag)]
        match = refused[0] if refused else error_input.error_regex
        if issubclass(error_input.error_type, Warning):
            with pytest.warns(error_input.error_type, match=match):
                _construct_and_step(OURS[info.optim_cls], params, error_input)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with pytest.raises(error_input.error_type, match=match):
                    _construct_and_step(OURS[info.optim_cls], params, error_input)
