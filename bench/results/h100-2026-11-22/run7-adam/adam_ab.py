"""A/B on one GPU, in one process: HEAD's fused Adam and unscale kernels (.scratch/old)
against the working tree's, on the guide MLP's tensors, L2 flushed, GPU clock; the
working tree's Adam under a few launch shapes; torch fused Adam.

    python3 .scratch/adam_ab.py OUT.json
"""

import functools
import json
import sys

sys.path[:0] = ["bench", ".scratch/old"]
import old_fused_optim  # noqa: E402
import old_unscale  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from sweep_optim import GUIDE, HYPER, _fresh, _state, _time  # noqa: E402

from mpgemm.kernels import fused_optim, unscale  # noqa: E402

DEVICE = "cuda"
SHAPES = [
    (4096, 2048, 8),
    (2048, 2048, 8),
    (1024, 1024, 8),
    (2048, 2048, 4),
    (1024, 1024, 4),
    (4096, 4096, 8),
]


def adam(module, state, scale, found):
    module.triton_adam_step_(
        state["params"],
        state["grads"],
        state["exp_avgs"],
        state["exp_avg_sqs"],
        state["steps"],
        compute_copies=state["copies"],
        grad_scale=scale,
        found_inf=found,
        **HYPER,
    )


def shaped(module, block, block_with_copy, warps):
    launch = module._launch

    @functools.wraps(launch)
    def f(*args, **kwargs):
        kwargs.update(block=block, block_with_copy=block_with_copy, num_warps=warps)
        return launch(*args, **kwargs)

    return f


def main(out):
    scale = torch.full((), 2.0**16, device=DEVICE)
    found = torch.zeros((), device=DEVICE)
    state = _state(GUIDE)
    numel = sum(p.numel() for p in state["params"])
    copied = sum(p.numel() for p in state["params"] if p.dim() == 2)
    nbytes = numel * 32 + copied * 2
    rows = []
    ref = _fresh(state)
    adam(old_fused_optim, ref, scale, found)
    cases = [("old", old_fused_optim, None)] + [("new", fused_optim, s) for s in SHAPES]
    for _round in range(2):
        for name, module, shape in cases:
            original = module._launch
            if shape:
                module._launch = shaped(module, *shape)
            try:
                once = _fresh(state)
                adam(module, once, scale, found)
                same = all(
                    torch.equal(a, b) for k in once for a, b in zip(once[k], ref[k], strict=True)
                )
                work = _fresh(state)
                us = _time(lambda w=work, m=module: adam(m, w, scale, found), 30)
            finally:
                module._launch = original
            row = dict(
                impl=f"mpgemm {name}",
                shape=shape,
                us=round(us, 1),
                gb_per_s=round(nbytes / us / 1e3),
                same_bits_as_head=same,
                round=_round,
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
        t = _fresh(state)
        params = [torch.nn.Parameter(p) for p in t["params"]]
        for p, g in zip(params, t["grads"], strict=True):
            p.grad = g
        fused = torch.optim.Adam(params, lr=HYPER["lr"], fused=True)
        fused.grad_scale, fused.found_inf = scale, found
        us = _time(fused.step, 30)
        row = dict(
            impl="torch fused Adam",
            us=round(us, 1),
            gb_per_s=round(numel * 32 / us / 1e3),
            round=_round,
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
        # unscale + inf check of the guide's FP32 gradients, in place
        grads = [g.clone() for g in state["grads"]]
        inv = torch.full((), 2.0**-16, device=DEVICE)
        for name, module in (("old", old_unscale), ("new", unscale)):
            module.triton_unscale_(grads, found, inv)
            us = _time(lambda m=module, g=grads, i=inv: m.triton_unscale_(g, found, i), 30)
            row = dict(
                impl=f"unscale {name}",
                us=round(us, 1),
                gb_per_s=round(numel * 8 / us / 1e3),
                round=_round,
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
        found.zero_()
        us = _time(
            lambda g=grads, i=inv: torch._amp_foreach_non_finite_check_and_unscale_(g, found, i), 30
        )
        row = dict(
            impl="unscale torch",
            us=round(us, 1),
            gb_per_s=round(numel * 8 / us / 1e3),
            round=_round,
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
        found.zero_()
    env = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        elements=numel,
    )
    with open(out, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
