"""FSDP2 (2 gloo ranks, a CPU mesh) against one process, in plain torch: nn.Linear layers
and torch.optim.Adam / SGD, 4 steps; prints the largest difference per parameter.
Run from the repository root (it borrows tests/test_distributed.py's free port)."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, "tests")
import test_distributed as td  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def train(model, rank, world, opt_name):
    params = list(model.parameters())
    if opt_name == "adam":
        opt = torch.optim.Adam(params, lr=1e-2)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(16, 16, generator=g)
        y = torch.randn(16, 8, generator=g)
        out = model(x.chunk(world)[rank])
        loss = torch.nn.functional.mse_loss(out, y.chunk(world)[rank])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [
        p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()
    ]


def worker(rank, port, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    res = {}
    for name in ("adam", "sgd"):
        m = mlp()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        res[name] = train(m, rank, 2, name)
    torch.save(res, f"{out}/{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    d = tempfile.mkdtemp()
    mp.spawn(worker, args=(td._free_port(), d), nprocs=2, join=True)
    got = torch.load(f"{d}/0.pt")
    for name in ("adam", "sgd"):
        want = train(mlp(), 0, 1, name)
        diffs = [f"{float((a - b).abs().max()):.1e}" for a, b in zip(got[name], want, strict=True)]
        print("plain torch", torch.__version__, name, diffs, flush=True)
