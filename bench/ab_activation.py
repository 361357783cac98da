"""An earlier ``kernels/activation.py``'s fused activation backward against the installed
one, in one process: dZ and the bias gradient of the guide's 4096-wide layer (8192 x
4096, FP16) for ReLU (saved y, FP16) and GELU (saved z, FP16; or, for a kernel from
before 2026-11-27's tenth session, whose parameters name ``RELU``, act'(z) in FP32, as
its forward stored it), three alternating rounds, each call timed on the GPU's clock
with L2 flushed (``harness.median_us``). dZ must match bit for bit (GELU's across that
change within an FP16 ulp, or 4 ulps of its subnormals: act'(z) of the same z, taken
by torch or by the kernel); the bias gradients are FP32 sums that may add in another
order (each kernel's order is fixed), so they are compared within FP32's rounding.

    git show REV:kernels/activation.py > OLD.py
    python3 bench/ab_activation.py OLD.py [OUT.json]   # on a GPU
    python3 bench/ab_activation.py OLD.py --smoke      # small shapes, any machine

Bytes per call: dY and the saved tensor read, dZ written (the partial sums, some 0.3%
more, left out).
"""

from __future__ import annotations

import sys

import torch
from harness import DEVICE, median_us, module_from, write_rows

from mpgemm.kernels import activation
from mpgemm.reference import activation_derivative

SHAPE = (8192, 4096)
SMOKE_SHAPE = (96, 160)


def _operands(name: str, shape: tuple[int, int]):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    dy = torch.randn(shape, device=DEVICE, generator=g).half()
    z = (torch.randn(shape, device=DEVICE, generator=g) * 3).half()
    return dy, z.relu() if name == "relu" else z


def _takes_derivative(module) -> bool:
    """Whether ``module``'s kernel reads GELU's act'(z) in FP32 (before z was stored)."""
    return "RELU" in module._activation_backward_kernel.arg_names


def main(argv: list[str]) -> int:
    smoke = "--smoke" in argv
    paths = [a for a in argv if not a.startswith("--")]
    if not paths:
        sys.exit(__doc__)
    earlier = module_from(paths[0], "activation_against")
    out = paths[1] if len(paths) > 1 else None
    shape, calls = (SMOKE_SHAPE, 3) if smoke else (SHAPE, 30)
    rows, ok = [], True
    for name in ("relu", "gelu"):
        dy, z = _operands(name, shape)
        results = {}
        for round_ in range(3):
            for impl, module in (("mpgemm", activation), ("mpgemm against", earlier)):
                saved = z
                if name != "relu" and _takes_derivative(module):
                    saved = activation_derivative(z.float(), name)
                nbytes = dy.nbytes * 2 + saved.nbytes

                def call(module=module, dy=dy, saved=saved, name=name):
                    return module.triton_activation_backward(
                        dy, saved, name, torch.float16, bias_grad=True
                    )

                results[impl] = call()  # compiles; the results compared below
                us = median_us(call, calls)
                rows.append(
                    dict(
                        impl=impl, activation=name, round=round_, us=us, gb_per_s=nbytes / us / 1e3
                    )
                )
        (dz, db), (dz_then, db_then) = results["mpgemm"], results["mpgemm against"]
        same_dz = torch.equal(dz.view(torch.int16), dz_then.view(torch.int16))
        if name != "relu" and _takes_derivative(activation) != _takes_derivative(earlier):
            # Within an FP16 ulp, or 4 of its subnormals' (act'(z) in the tails, where
            # its erf or exp decides the last bits of a tiny product).
            same_dz = torch.allclose(dz.float(), dz_then.float(), rtol=2**-10, atol=2**-22)
        # Sums of up to M terms in two orders: within a few ulps of their magnitudes.
        scale = dz.float().abs().sum(0) * torch.finfo(torch.float32).eps * 4
        close_db = bool((db - db_then).abs().le(scale).all())
        rows.append(dict(activation=name, dz_same_bits=same_dz, bias_grad_close=close_db))
        ok = ok and same_dz and close_db
    write_rows(rows, out, shape=list(shape))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
