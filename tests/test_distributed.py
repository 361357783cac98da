"""Under torch.distributed every rank takes the same skip decision: two CPU processes
on the gloo backend, an inf gradient on one rank only."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mpgemm

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)
WORLD = 2
INF_STEP = 2


def _train(model, optimizer, rank, steps=5):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for step in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        if step == INF_STEP and rank == 1:
            x[0, 0] = float("inf")  # only rank 1's gradient is non-finite
        optimizer.zero_grad()
        optimizer.scale_loss(torch.nn.functional.mse_loss(model(x), y)).backward()
        optimizer.step()
    return optimizer.skipped_steps, optimizer.loss_scale


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    for case, reduce, use_ddp in (("reduced", None, False), ("local", False, False),
                                  ("ddp", False, True)):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 2)
        if use_ddp:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = mpgemm.LossScaleOptimizer(
            mpgemm.optim.SGD(model.parameters(), lr=0.1), all_reduce_found_inf=reduce
        )
        skipped, scale = _train(model, optimizer, rank)
        results[case] = (skipped, scale, [p.detach().clone() for p in model.parameters()])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_skip_together(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    # Default: the flag is all-reduced, so rank 0 skips rank 1's bad step too.
    assert [r["reduced"][:2] for r in ranks] == [(1, 2.0**15)] * WORLD
    # The reduction is what does it: without it, only rank 1 skips.
    assert [r["local"][0] for r in ranks] == [0, 1]
    # DDP all-reduces the gradients, which carries the inf to every rank.
    assert [r["ddp"][:2] for r in ranks] == [(1, 2.0**15)] * WORLD
    for a, b in zip(ranks[0]["ddp"][2], ranks[1]["ddp"][2], strict=True):
        assert torch.equal(a, b)
