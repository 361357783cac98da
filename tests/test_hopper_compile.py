"""Every launch the code paths make compiles for an H100 (sm_90a) as triton's JIT would
compile it there, aligned and unaligned, with the ptxas inside the triton wheel: GEMMs
with wgmma, no stack frame (register spills) and shared memory an H100 block may have; the plain
16-bit forward GEMM and every GEMM of a training step with its MMAs in flight while the
next tiles load (async wgmma, at least one group pending) when aligned, those with
16-bit operands in the TMA kernel, but a 10-class head's weight gradient (run as its
transpose on 16-wide tiles);
the loss-scaling kernels and the activation's backward with no spills, vector loads
and no approximate FP32 math, the elementwise ones (unscale, SGD, Adam) in one thread
layout throughout; each kernel once more with programmatic dependent launch,
its wait for the prior grid before any global memory access. This
runs the GPU compiler, which the interpreter never does, and needs no GPU."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from mpgemm.kernels.gemm_tma import SMEM_BYTES  # noqa: E402

FIELDS = {
    "specialization",
    "wgmma_pending",
    "cp_async",
    "tma",
    "smem_bytes",
    "registers",
    "stack_bytes",
    "a_dtype",
    "b_dtype",
}


def test_every_launch_compiles_for_hopper_as_the_jit_would():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "mpgemm.kernels.aot"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    gemm_kernels = ("_gemm_kernel", "_gemm_tma_kernel")
    gemms = [r for r in reports if r["kernel"] in gemm_kernels]
    streaming = [r for r in reports if r["kernel"] not in gemm_kernels]
    assert gemms and all(FIELDS <= set(r) for r in gemms)
    assert {r["layout"] for r in gemms} == {"forward", "grad_input", "grad_weight"}
    assert {r["specialization"] for r in reports} == {"aligned", "unaligned"}
    assert {r["flags"]["COMPUTE_BF16"] for r in gemms} == {False, True}
    bad = [
        r
        for r in gemms
        if not (r["wgmma"] and r["stack_bytes"] == 0 and r["smem_bytes"] <= SMEM_BYTES and r["ok"])
    ]
    assert not bad, bad
    # The TMA kernel: bulk tensor copies, async wgmma, for aligned 16-bit operands only.
    tma = [r for r in gemms if r["kernel"] == "_gemm_tma_kernel"]
    assert tma and all(r["tma"] and r["wgmma_pending"] >= 1 for r in tma)
    assert all(
        r["specialization"] == "aligned" and r["a_dtype"] == r["b_dtype"] != "fp32" for r in tma
    )
    # Among them, a broadcast operand's gradient summed over the batch in the K loop,
    # into the gradient and into partial sums of parts of the batch.
    summed = [r for r in tma if r["flags"].get("SUM_BATCH")]
    assert {r["flags"].get("BATCHED", False) for r in summed} == {False, True}
    # The pointer kernel sums them too, for FP32 and unaligned 16-bit operands, and
    # over some batch dimensions only (a part per kept index) for aligned 16-bit ones;
    # fed by cp.async where aligned.
    summed = [r for r in gemms if r["kernel"] == "_gemm_kernel" and r["flags"].get("SUM_BATCH")]
    assert {(r["specialization"], "fp32" in (r["a_dtype"], r["b_dtype"])) for r in summed} == {
        ("aligned", True),
        ("unaligned", True),
        ("unaligned", False),
        ("aligned", False),
    }
    kept = [r for r in summed if r["specialization"] == "aligned" and r["b_dtype"] != "fp32"]
    assert kept and all(r["flags"]["INNER"] < r["flags"]["PRODUCTS"] for r in kept)
    # A batch over two dimensions that do not merge (attention's transposed heads) is
    # one launch of the pointer kernel, its MMAs in flight where aligned.
    outer = [r for r in gemms if r["flags"].get("OUTER")]
    assert {r["specialization"] for r in outer} == {"aligned", "unaligned"}
    assert all(r["wgmma_pending"] >= 1 for r in outer if r["specialization"] == "aligned")
    assert all(r["cp_async"] for r in summed if r["specialization"] == "aligned")

    # Every GEMM of a converted MLP's training step (16-bit weight copies, an FP32 input
    # rounded once, fused activations) has 16-bit operands, but for the head's backward
    # ones, which read the FP32 logits' gradient.
    step = [r for r in gemms if r["launch"].startswith("step:")]
    assert {r["layout"] for r in step} == {"forward", "grad_input", "grad_weight"}
    fp32 = [r for r in step if "fp32" in (r["a_dtype"], r["b_dtype"])]
    assert fp32 and all(
        r["launch"].startswith("step: head")
        and r["layout"] != "forward"
        and [r["a_dtype"], r["b_dtype"]].count("fp32") == 1
        for r in fp32
    )
    # A 10-class head's weight gradient (10 rows) runs as its transpose, x.T @ dY, on
    # 16-wide tiles whose rows are all real (the FP32 dY is B, its column sums the bias
    # gradient). dY's 10-column rows are converted into shared memory each step, which
    # the MMA then waits for: the one step GEMM without MMAs in flight, aligned.
    swapped = [r for r in step if r["b_dtype"] == "fp32"]
    assert swapped and all(
        r["launch"].startswith("step: head, ")
        and r["layout"] == "grad_weight"
        and "BLOCK_N: 16," in r["config"]
        and r["flags"]["K_SUMS"] == "b"
        for r in swapped
    )
    aligned = [r for r in step if r["specialization"] == "aligned"]
    assert all(r["wgmma_pending"] >= 1 for r in aligned if r["b_dtype"] != "fp32")
    # Aligned, every one with 16-bit operands is the TMA kernel's.
    assert all((r["kernel"] == "_gemm_tma_kernel") == (r not in fp32) for r in aligned)

    # A ReLU's backward in the input-gradient GEMM of the layer it feeds (the mask and
    # the column sums' partials in the epilogue): in both kernels, its MMAs in flight
    # where aligned (the guide MLP's head, FP32 dY, takes the pointer kernel).
    fused = [r for r in step if r["flags"].get("RELU_GRAD")]
    assert {r["kernel"] for r in fused} == set(gemm_kernels)
    assert all(r["flags"]["C_SUMS"] and r["layout"] == "grad_input" for r in fused)
    assert all(r["wgmma_pending"] >= 1 for r in fused if r["specialization"] == "aligned")

    # The guide MLP head's weight gradient is split along K, and summed by a reduction.
    split = [r for r in step if r["flags"].get("SPLIT_K", 1) > 1]
    assert split and all(r in swapped for r in split)
    assert any(r["kernel"] == "_split_k_reduce_kernel" and r["ok"] for r in reports)

    for dtype in ("float16", "bfloat16"):
        plain = [r for r in gemms if r["launch"] == f"forward 16-bit {dtype}"]
        aligned = [r for r in plain if r["specialization"] == "aligned"]
        assert aligned and all(r["wgmma_pending"] >= 1 and r["tma"] for r in aligned)
        # Without alignment (the pointer kernel) the same launch waits for every MMA:
        # the contrast is real.
        assert any(r["wgmma_pending"] == 0 for r in plain if r["specialization"] == "unaligned")

    assert {r["kernel"] for r in streaming} == {
        "_activation_backward_kernel",
        "_cross_entropy_forward_kernel",
        "_cross_entropy_backward_kernel",
        "_unscale_kernel",
        "_update_scale_kernel",
        "_sgd_kernel",
        "_adam_kernel",
        "_split_k_reduce_kernel",
    }
    bad = [r for r in streaming if not r["ok"] or r["stack_bytes"] or r["approx_fp32"]]
    assert not bad, bad
    # A 16-bit list beside FP32 ones (a weight's compute copy, an FP16 model's gradients
    # for FP32 masters) once sent every FP32 store through shared memory.
    elementwise = [
        r for r in streaming if r["kernel"] in ("_unscale_kernel", "_sgd_kernel", "_adam_kernel")
    ]
    assert elementwise and all(r["layout_conversions"] == 0 for r in elementwise)
    aligned = [
        r
        for r in streaming
        if r["specialization"] == "aligned"
        and r["kernel"] not in ("_update_scale_kernel", "_split_k_reduce_kernel")
    ]
    assert aligned and all(r["vector_loads"] > 0 for r in aligned)

    # Programmatic dependent launch: each kernel once with it, waiting for the prior
    # grid before any global memory access and letting the next one start; every other
    # binary without it.
    dependent = [r for r in reports if r["pdl"]]
    assert sorted(r["kernel"] for r in dependent) == sorted({r["kernel"] for r in reports})
    assert all(r["ok"] and r["waits_first"] and r["launches_dependents"] for r in dependent)
    assert not any(r["waits_first"] or r["launches_dependents"] for r in reports if not r["pdl"])


# A kernel that holds a whole block in one warp's registers until its sum is known:
# 256 FP32 values a thread, more than the 255 registers a thread may have, so it spills.
_SPILLING_KERNEL = """
import json

import triton
import triton.language as tl
from triton.compiler import ASTSource

from mpgemm.kernels.aot import HOPPER, resource_usage


@triton.jit
def centred(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    tl.store(y_ptr + offsets, x - tl.sum(x) / BLOCK)


for block in (256, 8192):
    source = ASTSource(
        centred, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"},
        constexprs={"BLOCK": block},
    )
    compiled = triton.compile(source, target=HOPPER, options={"num_warps": 1})
    print(json.dumps({"block": block, **resource_usage(compiled.asm["cubin"])}))
"""


def test_the_binarys_stack_frame_shows_its_spills(tmp_path):
    script = tmp_path / "spills.py"
    script.write_text(_SPILLING_KERNEL)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    usage = {r["block"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert usage[256]["stack_bytes"] == 0 and 0 < usage[256]["registers"] < 64
    assert usage[8192]["stack_bytes"] > 0 and usage[8192]["registers"] > 200
