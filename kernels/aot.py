"""Compile the shipped kernels ahead of time for an H100, on any machine.

The interpreter runs the kernels' Python, not the GPU compiler, which has rules of its
own (layouts, register budgets, what lowers to Hopper's wgmma, approximate math). This
compiles for ``GPUTarget("cuda", 90, 32)``, with the ptxas that ships inside the triton
wheel:
- every autotune config of each GEMM launch the autograd function makes (forward,
  input gradient, weight gradient, in FP16 and BF16), checking that the PTX uses
  ``wgmma`` and ptxas reports no spills;
- each loss-scaling kernel (unscale + check, scale update, SGD and Adam steps) for the
  dtypes it is launched with, checking for no spills, 16-byte vector loads on whole
  blocks, and no approximate FP32 math (torch's kernels divide and take square roots
  exactly, and keep denormals).
No GPU or driver is needed.

    python -m mpgemm.kernels.aot     # prints one JSON line per kernel, exit 1 on a defect

Must run without ``TRITON_INTERPRET=1``: the interpreter replaces ``triton.jit``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mpgemm.kernels.gemm import (
    ACTIVATIONS,
    PROLOGUES,
    _gemm_kernel,
    _hopper_configs,
    fits_registers,
)
from mpgemm.kernels.tensor_table import BLOCK

HOPPER = GPUTarget("cuda", 90, 32)

# The strides that are 1 in each launch of LinearFunction: the JIT turns an int argument
# of 1 into a constant. The strides not named are compiled as divisible by 16, as the JIT
# marks them for 4096-wide layers.
_LAYOUTS = {
    # y = x @ W.T: A = x (row-major), B = W.T (a transposed view), C row-major
    "forward": {"stride_ak", "stride_bk", "stride_sk", "stride_cn", "stride_gn"},
    # dx = dZ @ W: A = dY, B = W, S = the saved activation tensor, all row-major
    "grad_input": {"stride_ak", "stride_bn", "stride_sk", "stride_cn", "stride_gn"},
    # dW = dZ.T @ x: A = dY.T and S.T (transposed views), B = x, C = dW row-major
    "grad_weight": {"stride_am", "stride_bn", "stride_sm", "stride_cn", "stride_gn"},
}


@dataclass(frozen=True)
class Variant:
    """One launch of the kernel: its layout, dtypes and constexpr flags."""

    layout: str
    a: str
    b: str
    out: str
    compute_bf16: bool
    prologue: str | None = None
    has_bias: bool = False
    activation: str | None = None
    store_act_grad: bool = False
    rowsum_a: bool = False

    def flags(self) -> dict:
        return {
            "COMPUTE_BF16": self.compute_bf16,
            "INTERPRETED": False,
            "PROLOGUE": PROLOGUES[self.prologue],
            "HAS_BIAS": self.has_bias,
            "ACTIVATION": ACTIVATIONS[self.activation],
            "STORE_ACT_GRAD": self.store_act_grad,
            "ROWSUM_A": self.rowsum_a,
        }


def shipped_variants() -> list[Variant]:
    """The launches matmul and a training step make, in FP16 and BF16: a plain 16-bit
    product; layers with bias and activation from FP32 master weights (GELU storing its
    derivative; an FP32 first-layer input); the input gradient with each derivative
    prologue; the weight gradient with and without prologue and bias row sums."""
    variants = []
    for bf16, half in ((False, "fp16"), (True, "bf16")):
        variants += [
            Variant("forward", half, half, half, bf16),
            Variant("forward", half, "fp32", half, bf16, has_bias=True,
                    activation="gelu", store_act_grad=True),
            Variant("forward", "fp32", "fp32", "fp32", bf16, has_bias=True, activation="relu"),
            Variant("grad_input", half, "fp32", half, bf16, prologue="relu_mask"),
            Variant("grad_input", half, "fp32", "fp32", bf16, prologue="mul"),
            Variant("grad_weight", half, half, "fp32", bf16, prologue="mul", rowsum_a=True),
            Variant("grad_weight", half, "fp32", "fp32", bf16),
        ]
    return variants


def launched_configs(variant: Variant) -> list[triton.Config]:
    """The configs the autotuner may launch for ``variant``, after pruning."""
    return [
        config for config in _hopper_configs()
        if fits_registers(
            config,
            prologue=PROLOGUES[variant.prologue],
            store_act_grad=variant.store_act_grad,
            rowsum_a=variant.rowsum_a,
        )
    ]


def _signature(variant: Variant, config: triton.Config) -> tuple[dict, dict, dict]:
    # S is ReLU's saved output (of the output dtype) or GELU's FP32 derivative.
    saved = "fp32" if variant.prologue == "mul" else variant.out
    dtypes = {"a_ptr": variant.a, "b_ptr": variant.b, "c_ptr": variant.out,
              "bias_ptr": "fp32", "s_ptr": saved, "g_ptr": "fp32", "r_ptr": "fp32"}
    unit_strides = _LAYOUTS[variant.layout]
    constexprs = {**variant.flags(), **config.kwargs}
    signature, attrs = {}, {}
    for index, name in enumerate(_gemm_kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in dtypes:
            signature[name] = "*" + dtypes[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in unit_strides:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:  # M, N, K and the strides that are not 1
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _ptxas_path() -> str:
    # The ptxas triton itself assembles sm_90 with (the wheel ships two, by version).
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(HOPPER.arch).path


def ptxas_report(ptx: str) -> dict:
    """Registers and spill bytes per thread, from ``ptxas -v`` for sm_90a. ptxas runs a
    second time here because triton.compile discards the log of its own run."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [_ptxas_path(), "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.o")],
            check=True, capture_output=True, text=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(registers.group(1)),
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
    }


@dataclass
class KernelReport:
    variant: dict
    config: str
    wgmma: bool
    registers: int
    spill_bytes: int
    shared_bytes: int

    @property
    def ok(self) -> bool:
        return self.wgmma and self.spill_bytes == 0


def _compile(kernel, signature: dict, constexprs: dict, attrs: dict, options: dict):
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=HOPPER, options=options)


def compile_for_hopper(variant: Variant, config: triton.Config) -> KernelReport:
    signature, constexprs, attrs = _signature(variant, config)
    compiled = _compile(
        _gemm_kernel, signature, constexprs, attrs,
        {"num_warps": config.num_warps, "num_stages": config.num_stages},
    )
    ptx = compiled.asm["ptx"]
    return KernelReport(
        variant=asdict(variant),
        config=str(config),
        wgmma="wgmma" in ptx,
        shared_bytes=compiled.metadata.shared,
        **ptxas_report(ptx),
    )


def _compile_job(job: tuple[Variant, triton.Config]) -> KernelReport:
    return compile_for_hopper(*job)


# -- loss-scaling kernels -------------------------------------------------------------

# Pointer arguments of the loss-scaling kernels, by name; the other arguments are i32.
_SCALING_POINTERS = {
    "table_ptr": "*i64", "hyper_ptr": "*fp64", "factors_ptr": "*fp64",
    "found_inf_ptr": "*fp32", "inv_scale_ptr": "*fp32", "scale_ptr": "*fp32",
    "tracker_ptr": "*i32",
}
_TL_DTYPES = {"fp32": tl.float32, "fp16": tl.float16, "bf16": tl.bfloat16}


@dataclass(frozen=True)
class ScalingVariant:
    """One launch of a loss-scaling kernel: the kernel's name and its constexpr flags
    (dtypes by name: fp32, fp16, bf16)."""

    kernel: str
    flags: tuple[tuple[str, object], ...] = ()

    def constexprs(self) -> dict:
        values = {k: _TL_DTYPES.get(v, v) if isinstance(v, str) else v for k, v in self.flags}
        if self.kernel != "scale_update":
            values.update(INTERPRETED=False, BLOCK=BLOCK)
        return values


def scaling_variants() -> list[ScalingVariant]:
    """The launches GradScaler and the fused optimizers make: unscale in place for each
    dtype, FP16/BF16 gradients into FP32 masters, the check alone; the scale update;
    SGD and Adam/AdamW steps of FP32 (and BF16) parameters with FP32 or 16-bit
    gradients; one unaligned launch of each elementwise kind."""
    def v(kernel, **flags):
        return ScalingVariant(kernel, tuple(sorted(flags.items())))

    variants = [v("unscale", SRC_DTYPE=a, DST_DTYPE=b, WRITE=True, ALIGNED=True)
                for a, b in (("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"),
                             ("fp16", "fp32"), ("bf16", "fp32"))]
    variants += [v("unscale", SRC_DTYPE=a, DST_DTYPE=a, WRITE=False, ALIGNED=True)
                 for a in ("fp32", "fp16", "bf16")]
    variants.append(v("unscale", SRC_DTYPE="fp16", DST_DTYPE="fp16", WRITE=True,
                      ALIGNED=False))
    variants.append(v("scale_update"))
    for param, grad in (("fp32", "fp32"), ("fp32", "fp16"), ("fp32", "bf16"),
                        ("bf16", "bf16")):
        common = dict(PARAM_DTYPE=param, GRAD_DTYPE=grad, MAXIMIZE=False,
                      HAS_FOUND_INF=True, HAS_INV_SCALE=True, ALIGNED=True)
        variants.append(v("sgd", HAS_MOMENTUM=True, NESTEROV=False, **common))
        variants += [v("adam", DECOUPLED_WEIGHT_DECAY=d, **common) for d in (False, True)]
    variants.append(v("sgd", PARAM_DTYPE="fp32", GRAD_DTYPE="fp32", HAS_MOMENTUM=False,
                      NESTEROV=False, MAXIMIZE=True, HAS_FOUND_INF=False,
                      HAS_INV_SCALE=False, ALIGNED=False))
    variants.append(v("adam", PARAM_DTYPE="fp32", GRAD_DTYPE="fp32",
                      DECOUPLED_WEIGHT_DECAY=True, MAXIMIZE=True, HAS_FOUND_INF=False,
                      HAS_INV_SCALE=False, ALIGNED=False))
    return variants


def _scaling_kernel(name: str):
    from mpgemm.kernels import optim, scale_update, unscale

    return {
        "unscale": unscale._unscale_kernel,
        "scale_update": scale_update._update_scale_kernel,
        "sgd": optim._sgd_kernel,
        "adam": optim._adam_kernel,
    }[name]


# FP32 operations that round differently from torch's: approximate division, square
# root, reciprocal, or flushing denormals to zero.
_APPROX_FP32 = re.compile(r"\b(div\.(approx|full)|sqrt\.approx|rcp\.approx)[.\w]*\.f32\b"
                          r"|\b(add|sub|mul|fma)\.\w*ftz\w*\.f32\b")


@dataclass
class ScalingReport:
    variant: dict
    registers: int
    spill_bytes: int
    vector_loads: int
    approx_fp32: list[str]

    @property
    def ok(self) -> bool:
        vectorised = self.vector_loads > 0 or self.variant["kernel"] == "scale_update" or not (
            dict(self.variant["flags"]).get("ALIGNED"))
        return self.spill_bytes == 0 and not self.approx_fp32 and vectorised


def compile_scaling_for_hopper(variant: ScalingVariant) -> ScalingReport:
    kernel = _scaling_kernel(variant.kernel)
    constexprs = variant.constexprs()
    signature = {
        name: "constexpr" if name in constexprs else _SCALING_POINTERS.get(name, "i32")
        for name in kernel.arg_names
    }
    ptx = _compile(kernel, signature, constexprs, {}, {"num_warps": 8}).asm["ptx"]
    return ScalingReport(
        variant={"kernel": variant.kernel, "flags": [list(f) for f in variant.flags]},
        vector_loads=len(re.findall(r"ld\.global(\.\w+)*\.v[24]\.", ptx)),
        approx_fp32=sorted({m.group(0) for m in _APPROX_FP32.finditer(ptx)}),
        **ptxas_report(ptx),
    )


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("mpgemm.kernels.aot: unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    jobs = [(v, c) for v in shipped_variants() for c in launched_configs(v)]
    # Compiles are independent and CPU-bound: one process per core.
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        reports = list(pool.map(_compile_job, jobs))
        reports += list(pool.map(compile_scaling_for_hopper, scaling_variants()))
    for report in reports:
        print(json.dumps({**asdict(report), "ok": report.ok}))
    defects = sum(not report.ok for report in reports)
    print(f"{len(reports)} kernels compiled for sm_90a, {defects} with a defect (GEMM: no "
          "wgmma or spills; loss scaling: spills, approximate FP32 math, scalar loads)")
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
