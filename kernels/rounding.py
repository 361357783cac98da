"""Float conversions that round to nearest even, compiled and interpreted alike.

The interpreter converts FP32 to BF16 by truncation (numpy has no bfloat16), where the
GPU rounds to nearest even; kernels that must match torch bit for bit convert here.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_bf16_rne(x):
    """FP32 ``x`` rounded to the nearest BF16 (ties to even), still as FP32: the
    interpreter's own conversion truncates, so it gets its rounding done here."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def cast_rne(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even on the GPU and in the interpreter alike."""
    if INTERPRETED and dtype == tl.bfloat16:
        x = round_to_bf16_rne(x.to(tl.float32))
    return x.to(dtype)
