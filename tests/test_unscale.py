"""The fused unscale + inf/NaN check and the scale update match torch's own ops
(``torch._amp_foreach_non_finite_check_and_unscale_``, ``torch._amp_update_scale_``)
bit for bit, on fresh random values with inf and NaN injected."""

import random

import pytest
import torch

from mpgemm import scaling_ref
from mpgemm.scaling import unscale_, update_scale_
from tests.accuracy import assert_same_bits, launched_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gradients(dtype, device, *, poison=None):
    """Gradients of assorted sizes (one spanning several kernel blocks, one empty, one a
    transposed view), their values spread over many binades, all finite."""
    shapes = [(1,), (9000,), (64, 33), (0,), (17,), (24, 40)]
    # FP16 tops out at 65504: |randn| stays below 8 (2**3), so 2**12 more is finite.
    binades = 12 if dtype == torch.float16 else 30
    g = torch.Generator().manual_seed(0)
    grads = [
        (
            torch.randn(s, generator=g).clamp(-7.9, 7.9)
            * torch.rand(s, generator=g).mul(binades).exp2()
        ).to(dtype)
        for s in shapes
    ]
    if poison is not None:
        tensor, index, value = poison
        grads[tensor].view(-1)[index] = value
    grads[-1] = grads[-1].t()
    return [g.to(device) for g in grads]


def _torch_unscale_(t, found, inv) -> None:
    """torch's op on one tensor. Its CUDA kernel has no BF16 variant, so BF16 goes
    through its CPU kernel, which computes the same (t * inv in FP32, rounded once)."""
    if t.is_cuda and t.dtype == torch.bfloat16:
        t_cpu, found_cpu = t.cpu(), found.cpu()
        torch._amp_foreach_non_finite_check_and_unscale_([t_cpu], found_cpu, inv.cpu())
        t.copy_(t_cpu)
        found.copy_(found_cpu)
    else:
        torch._amp_foreach_non_finite_check_and_unscale_([t], found, inv)


def _check_against_torch(grads, expected, inv_scale, *, dst=None, impl=unscale_) -> float:
    """Run ``impl`` (``unscale_``, or its reference) on ``grads`` (into ``dst`` if given)
    and torch's op on ``expected`` (one call per tensor, so dtypes may mix); the flags
    and every result must agree. Returns the flag."""
    device = grads[0].device
    inv = torch.tensor(inv_scale, dtype=torch.float32, device=device)
    found, found_ref = (torch.zeros((), device=device) for _ in range(2))
    impl(grads, found, inv, dst=dst)
    for e in expected:
        _torch_unscale_(e, found_ref, inv)
    assert found.item() == found_ref.item()
    for i, (out, e) in enumerate(zip(grads if dst is None else dst, expected, strict=True)):
        assert_same_bits(out, e, f"{out.dtype} result {i}")
    return found.item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inv_scale", [2.0**-16, 1 / 3, 1.0, 7.0])
@pytest.mark.parametrize(
    "poison", [None, (1, 8999, float("inf")), (2, 0, float("nan")), (5, 100, -float("inf"))]
)
def test_unscale_matches_torch(device, dtype, inv_scale, poison):
    grads = _gradients(dtype, device, poison=poison)
    expected = [g.clone() for g in grads]
    assert _check_against_torch(grads, expected, inv_scale) == (poison is not None)


# The dispatching op (the kernels here), and the reference, which CPU tensors run
# without the interpreter: where ``dst`` is given, or nothing is written, it checks
# by ops of its own rather than torch's fused one.
IMPLS = pytest.mark.parametrize(
    "impl", [unscale_, scaling_ref.unscale_ref_], ids=["unscale_", "reference"]
)


@IMPLS
@pytest.mark.parametrize("poison", [float("nan"), -float("inf")])
@pytest.mark.parametrize("src_dtype", [torch.float16, torch.bfloat16])
def test_unscale_into_fp32_masters_equals_unscaling_the_widened_copy(
    device, src_dtype, poison, impl
):
    grads = _gradients(src_dtype, device, poison=(4, 3, poison))
    masters = [torch.empty(g.shape, device=device) for g in grads]
    expected = [g.float() for g in grads]
    assert _check_against_torch(grads, expected, 2.0**-13, dst=masters, impl=impl) == 1.0


@IMPLS
@pytest.mark.parametrize("dtype", DTYPES)
def test_check_only_writes_nothing_and_keeps_a_raised_flag(device, dtype, impl):
    grads = _gradients(dtype, device)
    before = [g.clone() for g in grads]
    found = torch.zeros((), device=device)
    impl(grads, found, None)
    assert found.item() == 0.0
    grads[1].view(-1)[4321] = float("nan")
    impl(grads, found, None)
    assert found.item() == 1.0
    grads[1].view(-1)[4321] = before[1].view(-1)[4321]
    impl(grads, found, None)  # torch's flag is sticky: only ever set to 1
    assert found.item() == 1.0
    for g, b in zip(grads, before, strict=True):
        assert_same_bits(g, b, "unchanged")


def test_mixed_dtypes_and_gapped_views_in_one_call(device):
    base = torch.randn(12, 10, device=device)
    gapped = base[:, ::2]  # every other column: not flat memory, so torch's op runs it
    grads = [torch.randn(50, device=device).half(), gapped, torch.randn(7, device=device)]
    grads[0][7] = float("inf")
    expected_base = base.clone()
    expected = [grads[0].clone(), expected_base[:, ::2], grads[2].clone()]
    assert _check_against_torch(grads, expected, 0.25) == 1.0
    assert_same_bits(base, expected_base, "the skipped columns stay as they were")


def test_scale_update_follows_torch_for_every_branch(device):
    rng = random.Random(1234)
    for _ in range(200):
        scale0 = rng.choice([65536.0, 3.0e38, 1.7, 1e-30, 12345.678, 2.0**127])
        growth, backoff = rng.choice([2.0, 1.1, 3.3]), rng.choice([0.5, 0.3, 0.9999])
        interval = rng.choice([1, 2, 3, 2000])
        tracker0 = rng.randrange(interval)
        found_inf = rng.choice([0.0, 1.0, 2.0])
        ours = [
            torch.tensor(scale0, device=device),
            torch.tensor(tracker0, dtype=torch.int32, device=device),
        ]
        ref = [t.clone() for t in ours]
        flag = torch.tensor(found_inf, device=device)
        update_scale_(*ours, flag, growth, backoff, interval)
        torch._amp_update_scale_(*ref, flag, growth, backoff, interval)
        case = (scale0, growth, backoff, interval, tracker0, found_inf)
        assert_same_bits(ours[0], ref[0], f"scale {case}")
        assert torch.equal(ours[1], ref[1]), f"tracker {case}"


def test_scale_update_counts_skipped_steps_in_the_same_launch(device):
    """LossScaleOptimizer's skip count: one more for each update whose flag is set
    (0, 1 or 2: flags summed over devices), and the scale updated as without it."""
    scale, tracker = torch.tensor(1024.0, device=device), torch.zeros((), dtype=torch.int32)
    tracker = tracker.to(device)
    ref = [scale.clone(), tracker.clone()]
    skipped = torch.tensor(5, dtype=torch.int64, device=device)
    flags = [0.0, 1.0, 0.0, 2.0, 1.0, 0.0]
    for found_inf in flags:
        flag = torch.tensor(found_inf, device=device)
        update_scale_(scale, tracker, flag, 2.0, 0.5, 2, skipped_steps=skipped)
        torch._amp_update_scale_(*ref, flag, 2.0, 0.5, 2)
    assert skipped.item() == 5 + 3
    assert_same_bits(scale, ref[0], "scale")
    assert torch.equal(tracker, ref[1])


@pytest.mark.parametrize("impl", [update_scale_, scaling_ref.update_scale_ref_])
def test_scale_update_zeroes_the_flag_it_read_when_asked(device, impl):
    """LossScaleOptimizer's reused flag: zeroed by the update that read it (the kernel,
    in the same launch), after the scale, tracker and skip count were updated from its
    value as without zeroing."""
    for found_inf in (0.0, 1.0, 2.0, 1.0, 0.0, 0.0):
        state = [
            torch.tensor(1024.0, device=device),
            torch.tensor(1, dtype=torch.int32, device=device),
            torch.tensor(7, dtype=torch.int64, device=device),
        ]
        ref = [t.clone() for t in state]
        flag = torch.tensor(found_inf, device=device)
        impl(*state[:2], flag, 2.0, 0.5, 2, skipped_steps=state[2], clear_found_inf=True)
        ref_flag = torch.tensor(found_inf, device=device)
        scaling_ref.update_scale_ref_(*ref[:2], ref_flag, 2.0, 0.5, 2, skipped_steps=ref[2])
        assert flag.item() == 0.0 and ref_flag.item() == found_inf
        for ours, theirs, name in zip(state, ref, ("scale", "tracker", "skipped"), strict=True):
            assert_same_bits(ours, theirs, f"{name} after a flag of {found_inf}")


def _odd_scalar(kind, value, device, dtype=torch.float32):
    """A one-element tensor of ``value`` whose memory is not its value: a negative view
    (its memory holds -value) or, for 0, a zero tensor (no memory)."""
    if kind == "zero tensor":
        assert value == 0
        return torch._efficientzerotensor((), device=device, dtype=dtype)
    return torch._neg_view(torch.tensor(-value, device=device, dtype=dtype))


@pytest.mark.parametrize("kind", ["negative view", "zero tensor"])
def test_a_scale_whose_value_is_not_its_memory_is_read_as_its_value(device, kind):
    # The kernels read inv_scale's memory: a negative view unscaled with the wrong sign,
    # a zero tensor read address 0. A copy holds the value, as torch's op reads it.
    value = 0.5 if kind == "negative view" else 0.0
    src = [torch.tensor([3.0, -1.0, 6e4], device=device), torch.randn(7, device=device)]
    for dst in (None, [torch.full_like(t, float("nan")) for t in src]):
        ours, theirs = [t.clone() for t in src], [t.clone() for t in src]
        found, their_found = torch.zeros((), device=device), torch.zeros((), device=device)
        inv = _odd_scalar(kind, value, device)
        unscale_(ours, found, inv, dst=dst)
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, their_found, inv)
        assert inv.is_neg() == (kind == "negative view")  # (left as it was)
        for out, e in zip(ours if dst is None else dst, theirs, strict=True):
            assert_same_bits(out, e, f"{kind}, dst given: {dst is not None}")
        assert found.item() == their_found.item() == 0.0


@pytest.mark.parametrize("kind", ["negative view", "zero tensor"])
def test_a_flag_or_scale_the_op_writes_must_be_its_own_memory(device, kind):
    # A flag or scale the op writes that is a negative view (the kernels would write its
    # memory with the value meant for it) or a zero tensor (no memory: torch's ops raise
    # ZeroTensors are immutable) is refused by name, before anything is written; torch's
    # unscale refuses both too. A flag that update_scale_ only reads is read as its value.
    grads = [torch.tensor([1.0, 2.0], device=device)]
    flag = _odd_scalar(kind, 0.0, device)
    with pytest.raises(RuntimeError, match="unscale_: found_inf is a negative view or a zero"):
        unscale_(grads, flag, torch.full((), 0.5, device=device))
    with pytest.raises(RuntimeError):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, torch.ones((), device=device))
    assert grads[0].tolist() == [1.0, 2.0]

    def state():
        return [
            torch.tensor(1024.0, device=device),
            torch.tensor(1, dtype=torch.int32, device=device),
            torch.tensor(7, dtype=torch.int64, device=device),
        ]

    for name in ("scale", "growth_tracker", "skipped_steps", "found_inf"):
        scale, tracker, skipped = state()
        given = dict(scale=scale, growth_tracker=tracker, skipped_steps=skipped)
        if name != "found_inf":
            given[name] = _odd_scalar(kind, 0.0, device, given[name].dtype)
        flag = _odd_scalar(kind, 0.0, device) if name == "found_inf" else torch.zeros(())
        with pytest.raises(RuntimeError, match=f"update_scale_: {name} is a negative view"):
            update_scale_(
                found_inf=flag.to(device),
                **given,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=2,
                clear_found_inf=True,
            )
        fresh = dict(zip(("scale", "growth_tracker", "skipped_steps"), state(), strict=True))
        for key, t in given.items():  # nothing written
            assert key == name or t.item() == fresh[key].item(), (name, key)
    # Read only (not cleared), a flag of 1 as a negative view backs the scale off.
    ours, theirs = state(), state()
    flag = _odd_scalar("negative view", 1.0, device) if kind == "negative view" else None
    flag = _odd_scalar(kind, 0.0, device) if flag is None else flag
    update_scale_(*ours[:2], flag, 2.0, 0.5, 1, skipped_steps=ours[2])
    scaling_ref.update_scale_ref_(
        *theirs[:2], flag.to(copy=True), 2.0, 0.5, 1, skipped_steps=theirs[2]
    )
    for a, b, name in zip(ours, theirs, ("scale", "tracker", "skipped"), strict=True):
        assert_same_bits(a, b, f"{name} after a {kind} flag")


def test_an_inference_scale_is_updated_only_within_inference_mode(device):
    # torch's update raises for an inference scale outside torch.inference_mode; the
    # kernel wrote it. The unscale's flag may be one, as torch's op writes it anywhere.
    with torch.inference_mode():
        scale = torch.tensor(1024.0, device=device)
        flag = torch.zeros((), device=device)
    tracker = torch.tensor(1, dtype=torch.int32, device=device)
    for impl in (update_scale_, torch._amp_update_scale_):
        with pytest.raises(RuntimeError, match="inference tensor"):
            impl(scale, tracker, torch.zeros((), device=device), 2.0, 0.5, 2)
    with torch.inference_mode():
        update_scale_(scale, tracker, torch.zeros((), device=device), 2.0, 0.5, 2)
    assert scale.item() == 2048.0
    unscale_([torch.tensor([float("inf")], device=device)], flag, torch.ones((), device=device))
    assert flag.item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_off_a_16_byte_boundary(device, dtype):
    # A view one element into its storage: the kernel must not assume aligned, vector-
    # wide addresses (the launcher checks every base address).
    storage = (torch.randn(9001) * 100).to(dtype).to(device)
    grads = [storage[1:], torch.randn(300, device=device).to(dtype)]
    assert grads[0].data_ptr() % 16 != 0
    outside = storage[:1].clone()
    expected = [g.clone() for g in grads]
    assert _check_against_torch(grads, expected, 1 / 3) == 0.0
    assert_same_bits(storage[:1], outside, "the element before the view")


def test_the_aligned_flag_follows_every_base_address():
    """The kernels' ALIGNED promise (16-byte vector loads) holds only where every tensor
    of every list starts on a 16-byte boundary; a table served from the cache (same
    addresses) answers the same."""
    from mpgemm.kernels.launches import intercept

    storage = torch.randn(1001)
    cases = {True: [torch.randn(100), torch.randn(300)], False: [torch.randn(100), storage[1:]]}
    flags = []
    with intercept(lambda kernel, grid, args, kwargs, configs: flags.append(kwargs["ALIGNED"])):
        for grads in (*cases.values(), *cases.values()):
            unscale_(grads, torch.zeros(()), torch.ones(()))
    assert flags == [True, False, True, False]


def test_tables_are_cached_by_address_and_the_least_recently_used_goes(monkeypatch):
    from collections import OrderedDict

    from mpgemm.kernels import tensor_table as tables

    monkeypatch.setattr(tables, "_cache", OrderedDict())
    lists = [[torch.randn(10), torch.randn(3)] for _ in range(tables._CACHE_SIZE + 1)]
    kept = tables.tensor_table([lists[0]])[0]
    first_other = tables.tensor_table([lists[1]])[0]
    for lst in lists[2:]:  # one more than the cache holds, the first list used between
        assert tables.tensor_table([lists[0]])[0] is kept
        tables.tensor_table([lst])
    assert len(tables._cache) == tables._CACHE_SIZE
    assert tables.tensor_table([lists[0]])[0] is kept
    assert tables.tensor_table([lists[1]])[0] is not first_other  # built again


def test_a_cached_table_serves_only_calls_it_was_built_for(monkeypatch):
    # The same tensors at the same addresses, laid out otherwise: each option of the
    # table, and which list each position reads, is in its cache key.
    from array import array
    from collections import OrderedDict

    from mpgemm.kernels import tensor_table as tables

    monkeypatch.setattr(tables, "_cache", OrderedDict())
    # (the empty tensors: a program each with every_tensor)
    a = [torch.randn(5000), torch.randn(3), torch.randn(0)]
    b = [torch.randn(5000), torch.randn(3), torch.randn(0)]
    variants = {
        "plain": ([a, b, a], {}),
        "which list": ([a, b, b], {}),
        "every tensor": ([a, b, a], dict(every_tensor=True)),
        "blocks a program": ([a, b, a], dict(blocks_per_program=2, block=1024)),
        "a block": ([a, b, a], dict(block=1024)),
        "groups": ([a, b, a], dict(groups=array("q", [1, 2, 3]).tobytes())),
    }
    built = {name: tables.tensor_table(lists, **kw) for name, (lists, kw) in variants.items()}
    for name, (lists, options) in variants.items():
        table = tables.tensor_table(lists, **options)
        assert table is built[name]  # cached
        for other, theirs in built.items():
            same = torch.equal(table.table, theirs.table) and table[1:] == theirs[1:]
            assert same == (other == name), (name, other)


def test_fp64_gradients_take_torchs_op(device):
    grads = [torch.randn(300, dtype=torch.float64, device=device), torch.randn(70, device=device)]
    grads[0][5] = float("nan")
    expected = [g.clone() for g in grads]
    assert _check_against_torch(grads, expected, 0.125) == 1.0


def test_the_reference_unscales_into_a_narrower_dst_before_rounding(device):
    # FP32 gradients into FP16: 1e5 overflows FP16 only if it is copied before scaling.
    src = [torch.tensor([1e5, 2.0], device=device)]
    inv_scale = torch.tensor(2.0**-16, device=device)
    results = []
    for impl in (scaling_ref.unscale_ref_, unscale_):
        dst = [torch.empty(2, device=device, dtype=torch.float16)]
        found_inf = torch.zeros((), device=device)
        impl(src, found_inf, inv_scale, dst=dst)
        assert found_inf.item() == 0.0
        results.append(dst[0])
    expected = (src[0] * inv_scale).half()
    assert_same_bits(results[0], expected, "reference")
    assert_same_bits(results[1], expected, "kernel path")


def test_a_tensor_subclass_never_reaches_the_kernels(device):
    # The kernels read memory from data_ptr; a subclass (a DTensor's wrapper has no
    # memory of its own) takes the reference path, whose torch ops it handles.
    class Wrapped(torch.Tensor):
        pass

    grads = [torch.tensor([2.0, float("inf")], device=device).as_subclass(Wrapped)]
    found_inf = torch.zeros((), device=device)
    names, _ = launched_kernels(
        lambda: unscale_(grads, found_inf, torch.full((), 0.5, device=device))
    )
    assert names == []
    assert found_inf.item() == 1.0 and grads[0][0].item() == 1.0


@pytest.mark.parametrize("kind", ["negative view", "zero tensor"])
def test_gradients_whose_values_are_not_their_memorys_unscale_as_torchs_op(device, kind):
    # A negative view (torch._neg_view) reads as its memory negated; a zero tensor has
    # no memory (a kernel read address 0, and the interpreter's process died of it).
    # In place, torch's op refuses both, and so does unscale_, with its message; into
    # FP32 masters (dst), each is read for its values.
    def grad():
        if kind == "zero tensor":
            return torch._efficientzerotensor(3, device=device)
        return torch._neg_view(torch.tensor([-3.0, 1.0, -float("inf")], device=device))

    inv = torch.full((), 0.5, device=device)
    raised = []
    for impl in (unscale_, torch._amp_foreach_non_finite_check_and_unscale_):
        found = torch.zeros((), device=device)
        with pytest.raises(RuntimeError) as error:
            impl([torch.randn(4, device=device), grad()], found, inv)
        raised.append(str(error.value))
    assert raised[0] == raised[1]
    src = [torch.randn(5, device=device), grad()]
    dst = [torch.full_like(src[0], float("nan")), torch.full((3,), float("nan"), device=device)]
    found = torch.zeros((), device=device)
    unscale_(src, found, inv, dst=dst)
    expected = [src[0] * 0.5, grad() * 0.5]
    for out, e in zip(dst, expected, strict=True):
        assert_same_bits(out, e.resolve_neg(), kind)
    assert found.item() == (1.0 if kind == "negative view" else 0.0)


def test_an_inference_destination_is_written_only_within_inference_mode(device):
    # An inference tensor (made under torch.inference_mode) keeps no version counter;
    # torch's in-place ops raise for one outside that mode, and so did the reference's
    # copy_ into dst, where the kernels wrote it: now both raise first. In place, torch's
    # op writes an inference gradient anywhere, and so does unscale_.
    src = [torch.tensor([3.0, -1.0, 6e4], device=device), torch.randn(7, device=device)]
    with torch.inference_mode():
        dst = [torch.full_like(t, float("nan")) for t in src]
        grads = [t.clone() for t in src]
    inv = torch.full((), 0.5, device=device)
    found = torch.zeros((), device=device)
    with pytest.raises(RuntimeError, match="unscale_: dst holds an inference tensor"):
        unscale_(src, found, inv, dst=[torch.empty_like(src[0]), dst[1]])
    unscale_(src, found, None, dst=dst)  # (a check writes no dst)
    assert all(t.isnan().all() for t in dst)
    with torch.inference_mode():
        unscale_(src, found, inv, dst=dst)
    expected = [t * 0.5 for t in src]
    for out, e in zip(dst, expected, strict=True):
        assert_same_bits(out, e, "dst")
    with torch.inference_mode():
        theirs = [t.clone() for t in grads]
    unscale_(grads, found, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, torch.zeros_like(found), inv)
    for ours, e in zip(grads, theirs, strict=True):
        assert_same_bits(ours, e, "in place")
    assert found.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_destination_that_is_a_negative_view_gets_the_values(device, dtype):
    # Its memory holds their negation. torch 2.13's copy_ between FP32 and FP16 into a
    # negative view writes the negation itself (the reference's FP32 product into an
    # FP16 destination came out with the wrong sign).
    src = [torch.tensor([3.0, -1.0, 6e4], device=device)]
    dst = [torch._neg_view(torch.full((3,), float("nan"), device=device, dtype=dtype))]
    found = torch.zeros((), device=device)
    unscale_(src, found, torch.full((), 0.5, device=device), dst=dst)
    assert dst[0].is_neg() and found.item() == 0.0
    assert_same_bits(dst[0].resolve_neg(), (src[0] * 0.5).to(dtype), "dst")


def test_bf16_subnormals_unscale_bit_for_bit(device):
    # BF16 subnormals (below 1.2e-38), in and out: the interpreter's own conversions
    # between BF16 and FP32 got them wrong, so the kernels move bits instead there.
    values = torch.tensor([1e-39, -3e-39, 2e-40, 1.1e-38, 5e-41, 0.0, -0.0, 3.0])
    for inv_scale in (0.5, 2.0, 1e-3):
        grads = [values.to(torch.bfloat16).to(device)]
        expected = [grads[0].clone()]
        _check_against_torch(grads, expected, inv_scale)


def test_the_reference_path_imports_no_kernel_module():
    # is_flat is torch-only: deciding which tensors a kernel may walk imports no
    # triton module (it imported kernels/tensor_table before).
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from mpgemm import scaling\n"
        "scaling.unscale_([torch.ones(3)], torch.zeros(()), torch.tensor(0.5))\n"
        "print(sorted(m for m in sys.modules if m.startswith('mpgemm.kernels')))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "0"},
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
