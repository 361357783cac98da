"""The fused optimizer steps' launch shape against their speed, for issue 11's gap. On the H100
the guide MLP's Adam step (FP32 masters writing FP16 compute copies) first took 356 us
where torch's fused Adam took 252: at 182 registers a thread one 8-warp program fitted
on an SM, and each program waited on its table, its step count and the flag before it
streamed. Per-block int32 offsets and loads issued ahead of the bias corrections bring
it to 100 registers (two programs per SM) and 248 to 258 us
(``bench/results/h100-2026-11-22/run7-adam``).

For each (elements a program steps at a time, warps, register cap, blocks a program),
this runs
``mpgemm.scaling.adam_step_`` on the guide MLP's parameters (784-4096-4096-10, FP32,
weights with FP16 copies, biases without: one launch, as in a training step), then on the same
parameters without copies (an unconverted model's: one launch, which ptxas compiles
to fewer registers at 2048 elements a program than at 4096), checks that each wrote
the same bits as the default shape, and times it on the GPU's clock with L2 flushed
(``harness.DeviceClock``); then torch.optim.Adam(fused=True) with a grad scale. The
same for ``sgd_step_`` with momentum against torch.optim.SGD(fused=True): SGD ran
4096 elements a program at 122 to 132 registers under triton 3.6, up to 146 under 3.9
(one 8-warp program per SM above 128), until 2048 took it to 52 to 69, untimed.

    python3 bench/sweep_optim.py [OUT.json]     # on a GPU
    python3 bench/sweep_optim.py --smoke        # tiny shapes, wall clock, any machine
    python3 bench/sweep_optim.py [OUT.json] --against=OLD.py [--against-table=OLD_TABLE.py]

``--against``: an earlier ``kernels/fused_optim.py`` (``git show REV:kernels/fused_optim.py
> OLD.py``), loaded beside the installed one, whose launchers must take the same
arguments: then both trees' Adam steps at the default shape, with copies, with and
without a loss scale (a ``LossScaleOptimizer`` unscales before its step: the guide
step's launch), alternating three rounds in this process, each checked to write the
same bits as the other (rows ``mpgemm`` and ``mpgemm against``, ``round``).
``--against-table``: that revision's ``kernels/tensor_table.py``, which the earlier
module then imports in place of the installed one (before 2026-11-27's spans of
several blocks a program, it took tables of one block a program).
"""

from __future__ import annotations

import functools
import itertools
import sys

import torch
from harness import DEVICE, median_us, module_from, write_rows

from mpgemm import scaling
from mpgemm.kernels import fused_optim
from mpgemm.kernels.tensor_table import blocks_per_program_for
from mpgemm.scaling import adam_step_, sgd_step_

GUIDE = [(4096, 784), (4096,), (4096, 4096), (4096,), (10, 4096), (10,)]
SMOKE = [(64, 48), (64,), (10, 64), (10,)]
# (block, warps, register cap, blocks a program); the first is the default (8 warps, no
# cap, blocks a program by the launch's size: _launch's).
DEFAULT = (fused_optim.OPTIMIZER_BLOCK, 8, None, None)
SHAPES = [DEFAULT] + [
    (block, warps, None, None)
    for block, warps in itertools.product((1024, 2048, 4096), (4, 8))
    if (block, warps, None, None) != DEFAULT
]
# Blocks a program: the guide's Adam gets 4 on 132 SMs (blocks_per_program_for); 1, one
# block a program as before 2026-11-27 (each block paying for the table's reads, the
# step count's arrival and the bias corrections), in the loop the spans take.
SHAPES += [(fused_optim.OPTIMIZER_BLOCK, 8, None, k) for k in (1, 2, 4, 8, 16)]
# Register caps: a cap of 80 fits three 8-warp programs an SM, 64 four. Adam's default
# shape took 84 registers under triton 3.6 (run8's ncu), two programs an SM, and a cap
# of 80 spilled; looping over a span of blocks, ptxas here gives the guide's launch 120
# under 3.6 and 3.9 (still two); at a cap of 80 its binary uses no local memory under
# 3.6 (under 3.9 it keeps 8 words on the stack, reloaded every block); 64 spills 96
# bytes under 3.6 (120 under 3.9).
SHAPES += [(2048, 8, 80, None), (2048, 8, 64, None), (1024, 4, 80, None), (1024, 4, 64, None)]
HYPER = dict(
    lr=1e-3,
    beta1=0.9,
    beta2=0.999,
    eps=1e-8,
    weight_decay=0.0,
    decoupled_weight_decay=False,
    maximize=False,
)
SGD_HYPER = dict(lr=1e-3, momentum=0.9, weight_decay=0.0, nesterov=False, maximize=False)
# Bytes per element each step moves, copies aside: Adam reads p, g, m, v and writes
# them (g unscaled); SGD reads p, g and its momentum buffer and writes them.
FP32_ACCESSES = {"adam": 8, "sgd": 6}


def _state(shapes):
    """Parameters, gradients (scaled by 2**16), moments, steps and copies, seeded."""
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(shape, scale=1.0):
        return torch.randn(shape, device=DEVICE, generator=g) * scale

    params = [rand(s) for s in shapes]
    return dict(
        params=params,
        grads=[rand(s, 2.0**16 * 1e-3) for s in shapes],
        exp_avgs=[rand(s, 1e-3) for s in shapes],
        exp_avg_sqs=[rand(s, 1e-6).abs() for s in shapes],
        steps=[torch.full((), 7.0, device=DEVICE) for _ in shapes],
        copies=[p.half() if p.dim() == 2 else p for p in params],
    )


def _fresh(state):
    """A copy of ``state`` to step; a bias is its own copy (none is written)."""
    fresh = {k: [t.clone() for t in v] for k, v in state.items() if k != "copies"}
    fresh["copies"] = [
        c.clone() if c.dtype != p.dtype else q
        for c, p, q in zip(state["copies"], state["params"], fresh["params"], strict=True)
    ]
    return fresh


def _ours(name, state, grad_scale, found_inf, copies=True):
    options = dict(
        compute_copies=state["copies"] if copies else None,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )
    if name == "sgd":  # the first moments stand for the momentum buffers
        sgd_step_(state["params"], state["grads"], state["exp_avgs"], **options, **SGD_HYPER)
        return
    adam_step_(
        state["params"],
        state["grads"],
        state["exp_avgs"],
        state["exp_avg_sqs"],
        state["steps"],
        **options,
        **HYPER,
    )


def _torch_fused(name, state, grad_scale, found_inf):
    """torch's fused optimizer of ``name`` over ``state``'s parameters and gradients."""
    params = [torch.nn.Parameter(p) for p in state["params"]]
    for p, grad in zip(params, state["grads"], strict=True):
        p.grad = grad
    if name == "sgd":
        fused = torch.optim.SGD(
            params, lr=SGD_HYPER["lr"], momentum=SGD_HYPER["momentum"], fused=True
        )
    else:
        fused = torch.optim.Adam(params, lr=HYPER["lr"], fused=True)
    fused.grad_scale, fused.found_inf = grad_scale, found_inf
    return fused


def _with_shape(block, num_warps, maxnreg, per_program, launched: list):
    """fused_optim's launcher with this launch shape, whatever its callers pass; each
    launch's answer (a cached binary's launch, else None) appended to ``launched``."""
    launch = fused_optim._launch

    @functools.wraps(launch)
    def shaped(*args, **kwargs):
        kwargs.update(
            block=block, num_warps=num_warps, maxnreg=maxnreg, blocks_per_program=per_program
        )
        launched.append(launch(*args, **kwargs))
        return launched[-1]

    return shaped


def _per_program(block: int, per_program: int | None, shapes) -> int:
    """The blocks a program of the launch over ``shapes`` takes (None: as chosen)."""
    if per_program is not None:
        return per_program
    blocks = sum(-(-torch.Size(s).numel() // block) for s in shapes)
    return blocks_per_program_for(blocks, DEVICE)


def _binary_facts(launched: list) -> dict:
    """The registers and spilled registers a thread of the last launch's binary used
    (None through the interpreter, whose launches have no binary)."""
    last = launched[-1] if launched else None
    if last is None:
        return dict(registers=None, spills=None)
    compiled = last.binary.compiled
    return dict(registers=compiled.n_regs, spills=compiled.n_spills)


def _against(
    path: str, table: str | None, state, grad_scale, found_inf, numel, copied, calls
) -> list[dict]:
    """The ``--against`` rows: Adam through the installed launcher and through
    ``path``'s (importing ``table``'s tensor table, if given), alternating."""
    replacing = {"mpgemm.kernels.tensor_table": table} if table else None
    earlier = module_from(path, "fused_optim_against", replacing)
    launchers = scaling.kernels()  # the table the ops dispatch through
    installed = launchers["adam_step"]
    rows = []
    try:
        for round_, scaled in itertools.product(range(3), (False, True)):
            scale = grad_scale if scaled else None
            written = {}
            for impl, launcher in (
                ("mpgemm", installed),
                ("mpgemm against", earlier.triton_adam_step_),
            ):
                launchers["adam_step"] = launcher
                written[impl] = _fresh(state)
                _ours("adam", written[impl], scale, found_inf)  # compiles; the bits
                work = _fresh(state)
                us = median_us(lambda w=work, s=scale: _ours("adam", w, s, found_inf), calls)
                # Without a scale the gradient is read, not written back.
                accesses = FP32_ACCESSES["adam"] - (0 if scaled else 1)
                nbytes = numel * 4 * accesses + copied * 2
                rows.append(
                    dict(
                        impl=impl,
                        optimizer="adam",
                        copies=True,
                        scaled=scaled,
                        round=round_,
                        us=us,
                        gb_per_s=nbytes / us / 1e3,
                    )
                )
            same = all(
                torch.equal(a, b)
                for k in written["mpgemm"]
                for a, b in zip(written["mpgemm"][k], written["mpgemm against"][k], strict=True)
            )
            rows[-1]["same_bits_as_default"] = rows[-2]["same_bits_as_default"] = same
    finally:
        launchers["adam_step"] = installed
    return rows


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    against = next((a.split("=", 1)[1] for a in argv if a.startswith("--against=")), None)
    table = next((a.split("=", 1)[1] for a in argv if a.startswith("--against-table=")), None)
    out = next((a for a in argv if not a.startswith("--")), None)
    # (smoke: one timed call a row, the rows' bits being what it checks)
    shapes, calls = (SMOKE, 1) if smoke else (GUIDE, 30)
    numel = sum(torch.Size(s).numel() for s in shapes)
    copied = sum(torch.Size(s).numel() for s in shapes if len(s) == 2)
    grad_scale = torch.full((), 2.0**16, device=DEVICE)
    found_inf = torch.zeros((), device=DEVICE)
    state = _state(shapes)
    rows, expected = [], {}
    original = fused_optim._launch
    for name in ("adam", "sgd"):
        try:
            for copies, (block, warps, cap, k) in itertools.product((True, False), SHAPES):
                launched: list = []
                fused_optim._launch = _with_shape(block, warps, cap, k, launched)
                once = _fresh(state)
                _ours(name, once, grad_scale, found_inf, copies)  # compiles; the bits
                want = expected.setdefault((name, copies), once)
                same = all(
                    torch.equal(a, b) for k in once for a, b in zip(once[k], want[k], strict=True)
                )
                work = _fresh(state)
                us = median_us(
                    lambda n=name, w=work, c=copies: _ours(n, w, grad_scale, found_inf, c), calls
                )
                # FP32 reads and writes of the step, and the FP16 copies written.
                nbytes = numel * 4 * FP32_ACCESSES[name] + (copied * 2 if copies else 0)
                rows.append(
                    dict(
                        impl="mpgemm",
                        optimizer=name,
                        copies=copies,
                        block=block,
                        num_warps=warps,
                        maxnreg=cap,
                        blocks_per_program=_per_program(block, k, shapes),
                        **_binary_facts(launched),
                        us=us,
                        gb_per_s=nbytes / us / 1e3,
                        same_bits_as_default=same,
                    )
                )
        finally:
            fused_optim._launch = original
        us = median_us(_torch_fused(name, _fresh(state), grad_scale, found_inf).step, calls)
        # Its rate as the bytes ours moves less the copies, which torch's does not write.
        nbytes = numel * 4 * FP32_ACCESSES[name]
        rows.append(dict(impl=f"torch fused {name}", us=us, gb_per_s=nbytes / us / 1e3))
    if against:
        rows += _against(against, table, state, grad_scale, found_inf, numel, copied, calls)
    write_rows(rows, out, elements=numel)
    return 0 if all(r.get("same_bits_as_default", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
