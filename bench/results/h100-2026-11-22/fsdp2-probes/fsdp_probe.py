"""tests/test_distributed.py's FSDP2 training (mpgemm, reference path, 2 gloo ranks)
against one process, with the test's inf at step 2 and with none; prints the largest
difference per parameter. Run from the repository root."""

import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

sys.path.insert(0, "tests")
import test_distributed as td  # noqa: E402

# The spawned ranks import this module again: they read the step to inject from here.
if "PROBE_INF_STEP" in os.environ:
    td.INF_STEP = int(os.environ["PROBE_INF_STEP"])

if __name__ == "__main__":
    for inf_step in (td.INF_STEP, -1):
        os.environ["PROBE_INF_STEP"] = str(inf_step)
        td.INF_STEP = inf_step
        d = tempfile.mkdtemp()
        mp.spawn(td._fsdp_worker, args=(td._free_port(), d, "reference"), nprocs=2, join=True)
        ranks = [torch.load(f"{d}/reference{r}.pt") for r in range(2)]
        for case in ("loss_scale_optimizer", "grad_scaler"):
            scale, expected = td._fsdp_train(td._mlp(), 0, 1, case)
            for r, rank in enumerate(ranks):
                got_scale, params = rank[case]
                diffs = [
                    f"{float((g - w).abs().max()):.1e}"
                    for g, w in zip(params, expected, strict=True)
                ]
                print(
                    f"inf_step {inf_step} {case} rank {r}: scale {got_scale} vs {scale}; "
                    f"max diff per param {diffs}",
                    flush=True,
                )
