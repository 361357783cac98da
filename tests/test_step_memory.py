"""bench/step_memory.py: the live tensor storage of a training step, counted on the CPU.
A layer's activation is an autograd node of its own, so the engine frees the gradient
that reached it and its output before the layer's GEMMs run backward, as autocast's
ReLU does: mpgemm's step then holds at its peak no more than autocast's, plus the
16-bit weight copies it keeps between steps and the logits' FP32 gradient (with the
derivative inside the layer's node it held two activations more: 0.32 MiB here against
autocast's 0.26)."""

from itertools import pairwise

import pytest

from tests.bench_scripts import load

pytest.importorskip("triton")

step_memory = load("step_memory")

BATCH, FEATURES, HIDDEN = 256, 32, (64, 64)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_an_mpgemm_step_peaks_no_higher_than_autocast_plus_its_weight_copies(
    monkeypatch, activation
):
    """GELU's and SiLU's layers keep z for their backward in the output's dtype, as
    autocast's keep their input (their FP32 derivative, kept before, put this GELU MLP
    52,216 bytes above the bar; z puts it 13,320 below)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # launches are stubbed: nothing to run
    peaks = {
        mode: step_memory.step_peak(mode, BATCH, FEATURES, HIDDEN, activation)
        for mode in step_memory.MODES
    }
    weights = sum(a * b for a, b in pairwise((FEATURES, *HIDDEN, 10)))
    copies = 2 * weights  # FP16
    before = sum(n for n, made_by, *_ in peaks["mpgemm"].at_peak if made_by == "before the step")
    # Tracked from the start: parameters, Adam's moments, the copies and the batch.
    assert before >= copies + 3 * 4 * weights
    # The logits' gradient is FP32 (autocast's FP16), in rows 16 apart for the head's GEMMs.
    logits_grad = BATCH * 16 * 4
    mpgemm, autocast = peaks["mpgemm"].peak, peaks["autocast"].peak
    assert mpgemm <= autocast + copies + logits_grad, (
        f"mpgemm {mpgemm} B, autocast {autocast} + {copies} + {logits_grad} B"
    )
    assert peaks["autocast"].peak < peaks["fp32"].peak
