"""Under torch.distributed every rank takes the same skip decision, and a model of
mpgemm.Linear layers under FSDP2 or DDP trains as one process would: two CPU
processes on the gloo backend, an inf on one rank only."""

import gc
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
    for case, reduce, use_ddp in (
        ("reduced", None, False),
        ("local", False, False),
        ("ddp", False, True),
    ):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 2)
        if use_ddp:
            model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = mpgemm.LossScaleOptimizer(
            mpgemm.optim.SGD(model.parameters(), lr=0.1), all_reduce_found_inf=reduce
        )
        skipped, scale = _train(model, optimizer, rank)
        results[case] = (skipped, scale, [p.detach().clone() for p in model.parameters()])
    _save_and_leave(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _save_and_leave(results, path):
    """Save, then tear the process group down with nothing left for exit to free.

    A CI run once aborted rank 0 at the end of the FSDP2 test ("terminate called
    without an active exception"). FSDP2's modules and states reference one another,
    so only the garbage collector frees them, and left alone it may do so during
    interpreter shutdown, where freeing gloo's objects can abort (pytorch#179291).
    They are collected here instead, and the ranks meet before either shuts down."""
    torch.save(results, path)
    gc.collect()
    dist.barrier()
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


# -- FSDP2 (each rank holds a shard of every parameter, gradient and state) and DDP ---

FSDP_STEPS = 4
FSDP_BATCH = 16


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return mpgemm.convert(
        torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 8),
        )
    )


def _train_on_share(model, rank, world, case, inf_in="gradient", compiled=False):
    """Each rank trains on its share of the same batches; at INF_STEP one element of
    rank 1's shard of the first weight's gradient is inf (world 1: of the whole one),
    or, ``inf_in="input"``, the first element of rank 1's first sample (world 1: of
    the same sample). ``compiled``: the optimizer's step (the scaler's step and
    update) is compiled whole."""
    params = list(model.parameters())
    # The optimizers' extra state: AMSGrad's maxima (DTensors, as the moments) and
    # damped SGD's step counts (plain tensors beside DTensor parameters).
    if case == "loss_scale_optimizer":
        optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(params, lr=1e-2, amsgrad=True))
        scaler = None
    else:
        optimizer = mpgemm.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.5)
        scaler = mpgemm.GradScaler("cpu", init_scale=2.0**16)

    def step():
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

    if compiled:
        # aot_eager: inductor (torch 2.13) fails to guard its reinplacing of the ops'
        # in-place writes to FSDP2's gradients, views into one reduce-scatter buffer
        # ("sources must not be empty for symbol"; README).
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    for i in range(FSDP_STEPS):
        x = torch.randn(FSDP_BATCH, 16, generator=g)
        y = torch.randn(FSDP_BATCH, 8, generator=g)
        if i == INF_STEP and inf_in == "input":
            x[FSDP_BATCH // WORLD, 0] = float("inf")
        loss = torch.nn.functional.mse_loss(
            model(x.chunk(world)[rank]).float(), y.chunk(world)[rank]
        )
        optimizer.zero_grad()
        (scaler.scale(loss) if scaler else optimizer.scale_loss(loss)).backward()
        if i == INF_STEP and rank == world - 1 and inf_in == "gradient":
            grad = params[0].grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
        step()
    scale = scaler.get_scale() if scaler else optimizer.loss_scale
    return scale, [
        p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()
    ]


def _fsdp_worker(rank, port, out_dir, path):
    # The reference path (torch ops) or the kernels through the interpreter.
    os.environ["TRITON_INTERPRET"] = "1" if path == "interpreter" else "0"
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # A CPU mesh: on a machine with a GPU, fully_shard's default mesh would move the
    # parameters to it, away from the CPU batches.
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for case in ("loss_scale_optimizer", "grad_scaler"):
        results["fsdp2", case] = _fsdp_case(mesh, rank, case)
        results["fsdp2 compiled", case] = _fsdp_case(mesh, rank, case, compiled=True)
        # DDP all-reduces the gradients in the backward, so a rank's inf reaches every
        # rank's gradients: it is put in rank 1's input.
        for wrapper, options in (
            ("ddp", {}),
            ("ddp bucket views", {"gradient_as_bucket_view": True}),
        ):
            model = torch.nn.parallel.DistributedDataParallel(_mlp(), **options)
            results[wrapper, case] = _train_on_share(model, rank, WORLD, case, inf_in="input")
    results["fsdp2 bf16"] = _fsdp_bf16_case(mesh, rank)
    results["converted after fully_shard"] = _convert_after_sharding(mesh)
    results["fsdp2 checkpoint"] = _fsdp_checkpoint_resumes(mesh, rank)
    _save_and_leave(results, os.path.join(out_dir, f"{path}{rank}.pt"))


def _fsdp_case(mesh, rank, case, compiled=False):
    from torch.distributed.fsdp import fully_shard  # FSDP2 (torch >= 2.6)

    model = _mlp()
    for layer in model:
        if isinstance(layer, mpgemm.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train_on_share(model, rank, WORLD, case, compiled=compiled)


def _fsdp_bf16_case(mesh, rank):
    """FSDP2 casting the gathered weights to BF16 (``MixedPrecisionPolicy``) over FP32
    masters, inputs some 1e5: (skipped steps, the losses). The layers compute in the
    weights' BF16, so inputs beyond FP16's 65504 stay finite (rounded to FP16 they
    became inf, and every step was skipped)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _mlp()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, mpgemm.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(2):
        x = torch.randn(FSDP_BATCH, 16, generator=g).chunk(WORLD)[rank] * 1e5
        loss = model(x).float().square().mean()
        optimizer.zero_grad()
        optimizer.scale_loss(loss).backward()
        optimizer.step()
        losses.append(loss.item())
    return optimizer.skipped_steps, losses


def _fsdp_checkpoint_resumes(mesh, rank) -> bool:
    """A LossScaleOptimizer over FSDP2's shards saved and loaded by
    ``torch.distributed.checkpoint``'s state-dict functions (the scaler's state beside,
    as for torch's GradScaler): whether the resumed run continues as the original, bit
    for bit."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def train(model, optimizer, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(FSDP_BATCH, 16, generator=g).chunk(WORLD)[rank]
            optimizer.zero_grad()
            optimizer.backward(model(x).float().square().mean())
            optimizer.step()

    def sharded():
        from torch.distributed.fsdp import fully_shard

        model = _mlp()
        for layer in model:
            if isinstance(layer, mpgemm.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, mpgemm.LossScaleOptimizer(mpgemm.optim.Adam(model.parameters(), lr=1e-2))

    model, optimizer = sharded()
    train(model, optimizer, 3, seed=3)
    model_state, optim_state = copy.deepcopy(get_state_dict(model, optimizer))
    resumed, resumed_optimizer = sharded()
    set_state_dict(
        resumed, resumed_optimizer, model_state_dict=model_state, optim_state_dict=optim_state
    )
    resumed_optimizer.scaler.load_state_dict(optimizer.scaler.state_dict())
    train(model, optimizer, 2, seed=4)
    train(resumed, resumed_optimizer, 2, seed=4)
    return all(
        torch.equal(p.full_tensor(), q.full_tensor())
        for p, q in zip(model.parameters(), resumed.parameters(), strict=True)
    )


def _convert_after_sharding(mesh) -> tuple[str, list[str]]:
    """convert on a model already sharded: its layers' class, and the warnings."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    fully_shard(model[0], mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mpgemm.convert(model)
    return type(model[0]).__name__, [str(w.message) for w in caught]


def _interpreter_runs_the_gemms() -> bool:
    # Triton 3.6's interpreter fails on the GEMM kernels' loops over ranges that start
    # at a program id ("only 0-dimensional arrays can be converted to Python scalars");
    # 3.9's runs them.
    try:
        import triton
    except ImportError:
        return False
    return tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9)


@pytest.mark.parametrize(
    "path",
    [
        "reference",
        pytest.param(
            "interpreter",
            marks=pytest.mark.skipif(
                not _interpreter_runs_the_gemms(),
                reason="this Triton's interpreter cannot run them",
            ),
        ),
    ],
)
def test_fsdp2_and_ddp_match_one_process_on_the_whole_batch(tmp_path, path):
    """A model of mpgemm.Linear layers sharded by FSDP2 or replicated by DDP (also with
    its gradients as views into its buckets, ``gradient_as_bucket_view``) over two
    ranks, each on half of every batch, trains as one process on the whole batches,
    with LossScaleOptimizer(Adam with AMSGrad) or GradScaler and damped SGD; rank 1's
    inf skips the same step on both ranks. Under FSDP2's BF16 param_dtype the layers
    compute in BF16 (``_fsdp_bf16_case``). A run saved and loaded through
    ``torch.distributed.checkpoint`` resumes bit for bit (``_fsdp_checkpoint_resumes``).
    A layer sharded before convert is left as it is, with a warning
    (``_convert_after_sharding``)."""
    mp.spawn(_fsdp_worker, args=(_free_port(), str(tmp_path), path), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"{path}{r}.pt") for r in range(WORLD)]
    for rank in ranks:
        # A layer sharded before convert is left, with a warning saying so.
        assert rank.pop("fsdp2 checkpoint")  # resumed through torch.distributed.checkpoint
        kind, warned = rank.pop("converted after fully_shard")
        assert kind == "FSDPLinear"
        assert any(
            "'0' left as they are" in w and "convert before fully_shard" in w for w in warned
        )
        skipped, losses = rank.pop("fsdp2 bf16")
        assert skipped == 0 and all(0 < loss < float("inf") for loss in losses), losses
    for wrapper, case in ranks[0]:
        inf_in = "input" if wrapper.startswith("ddp") else "gradient"
        scale, expected = _train_on_share(_mlp(), 0, 1, case, inf_in)
        # Rank 1's inf skipped the step on both ranks: the scale backed off once.
        assert scale == 2.0**15
        for rank in ranks:
            got_scale, params = rank[wrapper, case]
            assert got_scale == scale, (wrapper, case)
            for got, want in zip(params, expected, strict=True):
                torch.testing.assert_close(
                    got,
                    want,
                    rtol=1e-4,
                    atol=1e-5,
                    msg=lambda m, w=wrapper, c=case: f"{w} {c}: {m}",
                )
