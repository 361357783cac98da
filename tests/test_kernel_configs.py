"""The autotune set-up of both GEMM kernels: what pruning reads is in the key, and no
launch is left without a config (triton raises AutotunerError when pruning empties the
list)."""

import itertools

import pytest
import torch

pytest.importorskip("triton")

from mpgemm.kernels import gemm, gemm_tma  # noqa: E402
from mpgemm.kernels.gemm_common import tile  # noqa: E402

LAUNCH_FLAGS = list(
    itertools.product((False, True), (None, "a", "b"), (False, True), (False, True), (16, 4096))
)
WIDE = {"N_BUCKET": 4096}


def test_everything_pruning_reads_is_in_the_autotune_key():
    # A config tuned without a flag must not be reused for a launch that prunes it away.
    assert set(gemm._PRUNE_FLAGS + gemm._PRUNE_ARGS) <= set(gemm.tuned_gemm_kernel.keys)
    # _PRUNE_FLAGS and _PRUNE_ARGS are what pruning really reads: without any, it fails.
    flags = dict(STORE_PREACT=0, K_SUMS=None, RELU_GRAD=False, ALIGNED=True)
    assert gemm._prune_configs(gemm._hopper_configs(), WIDE, **flags)
    for missing in gemm._PRUNE_FLAGS:
        with pytest.raises(KeyError):
            gemm._prune_configs(
                gemm._hopper_configs(), WIDE, **{k: v for k, v in flags.items() if k != missing}
            )
    with pytest.raises(KeyError):
        gemm._prune_configs(gemm._hopper_configs(), {}, **flags)


@pytest.mark.parametrize("store_preact, k_sums, relu_grad, aligned, n_bucket", LAUNCH_FLAGS)
def test_every_launch_keeps_a_config(store_preact, k_sums, relu_grad, aligned, n_bucket):
    flags = dict(STORE_PREACT=store_preact, K_SUMS=k_sums, RELU_GRAD=relu_grad, ALIGNED=aligned)
    width = {"N_BUCKET": n_bucket}
    kept = gemm._prune_configs(gemm._hopper_configs(), width, **flags)
    assert kept
    # At most 16 columns: the 16-wide tiles, and only then.
    assert all((c.kwargs["BLOCK_N"] == 16) == (n_bucket <= gemm.NARROW_N) for c in kept)
    # The tests stage's configs (MPGEMM_SINGLE_CONFIG=1) leave every launch one: no
    # autotuning, one compile per kernel.
    assert len(gemm._prune_configs(gemm._single_config(), width, **flags)) == 1


def test_aligned_unaligned_and_narrow_launches_tune_over_their_own_tiles():
    def kept(aligned, n_bucket):
        flags = dict(STORE_PREACT=0, K_SUMS=None, RELU_GRAD=False, ALIGNED=aligned)
        configs = gemm._prune_configs(gemm._hopper_configs(), {"N_BUCKET": n_bucket}, **flags)
        return {str(c) for c in configs}

    aligned, unaligned = kept(True, 4096), kept(False, 4096)
    assert len(aligned) == 8 and len(unaligned) == 2 and not aligned & unaligned
    narrow = kept(True, 16)
    assert len(narrow) == 2 and kept(False, 8) == narrow and not narrow & (aligned | unaligned)


@pytest.mark.parametrize(
    "pointers, strides, expected",
    [
        ((0, 16, 32), (4096, 1, 784, 1), True),  # 16-byte aligned, strides 1 or 16k
        ((0, 2, 32), (4096, 1), False),  # a view 2 bytes past a boundary
        ((0, 16), (10, 1), False),
    ],  # the logits of 10 classes: row stride 10
)
def test_operands_aligned(pointers, strides, expected):
    class Pointer:
        def __init__(self, address):
            self.address = address

        def data_ptr(self):
            return self.address

    assert gemm.operands_aligned([Pointer(p) for p in pointers], strides) is expected


# (HAS_BIAS, ACTIVATION, STORE_PREACT, RELU_GRAD) of the TMA kernel's launch kinds.
TMA_EPILOGUES = [
    (False, None, False, False),
    (True, None, False, False),
    (True, "relu", False, False),
    (True, "gelu", False, False),
    (True, "gelu", True, False),
    (False, None, False, True),  # a ReLU's input gradient
]


@pytest.mark.parametrize("c_aligned", [True, False])
@pytest.mark.parametrize("n_bucket", [16, 4096])
@pytest.mark.parametrize("c_bytes", [2, 4])
@pytest.mark.parametrize("has_bias, activation, store_preact, relu_grad", TMA_EPILOGUES)
def test_every_tma_launch_keeps_a_config_within_shared_memory(
    c_bytes, has_bias, activation, store_preact, relu_grad, n_bucket, c_aligned
):
    c = torch.empty(0, dtype=torch.float16 if c_bytes == 2 else torch.float32)
    flags = dict(
        HAS_BIAS=has_bias,
        ACTIVATION=activation,
        STORE_PREACT=store_preact,
        RELU_GRAD=relu_grad,
        C_ALIGNED=c_aligned,
    )
    named = {"c_ptr": c, "N_BUCKET": n_bucket}
    kept = gemm_tma._prune_configs(gemm_tma._hopper_configs(), named, **flags)
    # 16-wide tiles for launches of at most 16 columns (a 10-class head's forward), which
    # keep the wider ones too.
    narrow = [k for k in kept if tile(k)[1] <= gemm_tma.NARROW_N]
    assert bool(narrow) == (n_bucket <= 16) and len(narrow) < len(kept)
    assert kept and all(
        gemm_tma.smem_estimate(k, c_bytes=c_bytes, c_aligned=c_aligned) <= gemm_tma.SMEM_BYTES
        for k in kept
    )
    single = gemm_tma._prune_configs(gemm_tma._single_config(), named, **flags)
    assert len(single) == 1
    plain = not has_bias and activation is None and not relu_grad
    # Tiles whose binaries spilled under Triton 3.9: a ReLU mask's over 64x256, and
    # 8-warp ones with an epilogue storing an FP32 or unaligned C.
    assert not relu_grad or all(tile(k)[0] * tile(k)[1] <= 64 * 256 for k in kept)
    eight_warps = [k for k in kept if tile(k)[3] == 8]
    assert bool(eight_warps) == (plain or (c_bytes == 2 and c_aligned))
    if not c_aligned:
        # An unaligned C's conversion may take a whole tile: no 4-stage tile of 128x256's
        # accumulator in 16 bits (256x128 took 262,176 bytes so, on an H200); FP32's
        # quarters still fit.
        deep = [k for k in kept if tile(k)[0] * tile(k)[1] == 128 * 256 and k.num_stages == 4]
        assert bool(deep) == (c_bytes == 4 and plain)
        # Its element-by-element stores leave an epilogue half the registers: 64 of FP32
        # accumulator a thread beside a ReLU, 32 beside GELU's pre-activation.
        widest = max(tile(k)[0] * tile(k)[1] // (32 * tile(k)[3]) for k in kept)
        assert widest == (128 if plain else 32 if store_preact else 64)
        return
    # Tiles stored in parts serve plain products only (an FP32 weight gradient's).
    in_parts = [k for k in kept if gemm_tma.stores_in_parts(k, c_bytes=c_bytes)]
    assert bool(in_parts) == (c_bytes == 4 and plain)
    # The 256-row tile, cuBLAS's for the input gradients: not beside GELU's
    # pre-activation (the accumulator's registers), nor stored in parts with an epilogue.
    tall = [k for k in kept if tile(k)[0] == 256]
    assert bool(tall) == (not store_preact and not relu_grad and (c_bytes == 2 or plain))


@pytest.mark.parametrize("c_bytes", [2, 4])
@pytest.mark.parametrize("has_bias, activation, store_preact, relu_grad", TMA_EPILOGUES)
def test_the_four_stage_wide_tile_serves_16_bit_outputs_and_plain_fp32_ones(
    c_bytes, has_bias, activation, store_preact, relu_grad
):
    # 128x256x64 in 4 stages takes 192 KB of operands: with a 16-bit output's layout
    # conversion (32 KB compiled) it fits an H100 block, and with an FP32 output's stored
    # in quarters (32 KB each), which serve plain products only (an FP32 weight
    # gradient's); GELU's pre-activation beside the output keeps the tiles of fewer than
    # 128 accumulator registers a thread.
    c = torch.empty(0, dtype=torch.float16 if c_bytes == 2 else torch.float32)
    flags = dict(
        HAS_BIAS=has_bias,
        ACTIVATION=activation,
        STORE_PREACT=store_preact,
        RELU_GRAD=relu_grad,
        C_ALIGNED=True,
    )
    kept = gemm_tma._prune_configs(
        gemm_tma._hopper_configs(), {"c_ptr": c, "N_BUCKET": 4096}, **flags
    )
    deep = [k for k in kept if tile(k) == (128, 256, 64, 8) and k.num_stages == 4]
    plain = not has_bias and activation is None and not relu_grad
    assert bool(deep) == (not store_preact and not relu_grad if c_bytes == 2 else plain)
    for config in deep:
        assert gemm_tma.smem_estimate(config, c_bytes=c_bytes, c_aligned=True) == 230400
    if c_bytes == 4:
        assert gemm_tma.epilogue_parts(128, 256, 4) == 4  # quarters of 32 KB


def test_what_tma_pruning_reads_is_in_its_autotune_key():
    # C's dtype triton adds to the key.
    keys = gemm_tma.tuned_gemm_tma_kernel.keys
    pruning = {"STORE_PREACT", "HAS_BIAS", "ACTIVATION", "RELU_GRAD", "C_ALIGNED", "N_BUCKET"}
    assert pruning <= set(keys)
