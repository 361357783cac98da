"""The autotune set-up: what pruning reads is in the key, and no launch is left without
a config (triton raises AutotunerError when pruning empties the list)."""

import itertools

import pytest

pytest.importorskip("triton")

from mpgemm.kernels import gemm  # noqa: E402


def test_every_flag_pruning_reads_is_in_the_autotune_key():
    # A config tuned without a flag must not be reused for a launch that prunes it away.
    assert set(gemm._PRUNE_FLAGS) <= set(gemm.gemm_kernel.keys)
    with pytest.raises(KeyError):  # _PRUNE_FLAGS is what pruning really reads
        gemm._prune_configs(gemm._hopper_configs(), {}, PROLOGUE=0, STORE_ACT_GRAD=0)


@pytest.mark.parametrize(
    "prologue, store_act_grad, rowsum_a", list(itertools.product((0, 1, 2), (0, 1), (0, 1)))
)
def test_every_launch_keeps_a_config(prologue, store_act_grad, rowsum_a):
    kept = gemm._prune_configs(
        gemm._hopper_configs(), {},
        PROLOGUE=prologue, STORE_ACT_GRAD=store_act_grad, ROWSUM_A=rowsum_a,
    )
    assert kept
