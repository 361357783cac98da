"""Float conversions that round to nearest even, compiled and interpreted alike.

The interpreter converts FP32 to BF16 by truncation (numpy has no bfloat16), where the
GPU rounds to nearest even, and its conversions between BF16 and FP32 get subnormals
wrong (1e-39 comes back as 5.9e-39); kernels that must match torch bit for bit convert
here. A BF16 is the upper half of the FP32 of the same value, so when interpreted the
conversions move bits; compiled, they are the plain conversions.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_bf16_rne(x):
    """FP32 ``x`` rounded to the nearest BF16 (ties to even), still as FP32: the
    interpreter's own conversion truncates, so it gets its rounding done here."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    # NaN becomes the quiet NaN of its sign, whose upper half is a BF16 NaN too.
    nan = (x.to(tl.uint32, bitcast=True) & 0x80000000) | 0x7FC00000
    return tl.where(x != x, nan.to(tl.float32, bitcast=True), bits.to(tl.float32, bitcast=True))


@triton.jit
def cast_rne(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even on the GPU and in the interpreter alike."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = round_to_bf16_rne(widen(x, INTERPRETED)).to(tl.uint32, bitcast=True)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def saturated(x, dtype: tl.constexpr):
    """FP32 ``x`` with its finite values beyond ``dtype``'s range (FP16's, BF16's) clamped
    to its largest finite value of their sign, so that a cast to ``dtype`` keeps them
    finite; inf and NaN as they are."""
    y = x
    if dtype == tl.float16:
        y = tl.where(tl.abs(x) < float("inf"), tl.minimum(tl.maximum(x, -65504.0), 65504.0), x)
    elif dtype == tl.bfloat16:
        big = 3.3895313892515355e38  # (2 - 2**-7) * 2**127
        y = tl.where(tl.abs(x) < float("inf"), tl.minimum(tl.maximum(x, -big), big), x)
    return y


@triton.jit
def widen(x, INTERPRETED: tl.constexpr):
    """``x.to(tl.float32)``, exact for BF16 subnormals in the interpreter too."""
    if INTERPRETED and x.dtype == tl.bfloat16:
        y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y
