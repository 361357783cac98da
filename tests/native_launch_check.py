"""Run by tests/test_native_launch.py in a process of its own, under the stand-in driver
(``fake_driver``: its ``environment``, then ``activate``): each case's GEMM launches
are compiled for an H100 and made until ``triton_gemm`` replays them by C++ plans
(``native_launch``); then, in one more call, each replay is made twice on the same
tensors, by Triton's own launcher and by its plans, and what the driver was handed each
time is compared, byte for byte. Prints one JSON line per case. Besides the cases, a
few specials (a launch that cannot be planned, another grid, new threads, and
``mpgemm.matmul``'s replay at its entry against its full path).

CPU tensors stand for the GPU's (the stand-in reads no memory). Allocations come from a
bump allocator (``Pool``), so that the partials split-K allocates within a replay are
the same memory both times.

    python3 tests/native_launch_check.py [CASE ...]     # the cases (default: all)
    python3 tests/native_launch_check.py --random SEED COUNT   # drawn layers instead
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import re
import sys
import threading

import fake_driver
import torch

import mpgemm
from mpgemm import functional
from mpgemm.app.train import Recipe, TrainConfig, build_mlp
from mpgemm.kernels import dependent_launch, gemm, launches, native_launch
from mpgemm.scaling import unscale_

PDL = "matmul with programmatic dependent launch, TMA"
fake: ctypes.CDLL  # the stand-in (fake_driver.activate)


class Pool:
    """``torch.empty`` and ``torch.empty_like`` from one buffer, 256-byte aligned, from its
    start again after each ``reset``."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes + 256, dtype=torch.uint8)
        self.storage = self.buffer.untyped_storage()
        self.start = (-self.buffer.data_ptr()) % 256
        self.offset = self.start
        self.empty, self.empty_like = torch.empty, torch.empty_like

    def reset(self) -> None:
        self.offset = self.start

    def take(self, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        dtype = dtype or torch.get_default_dtype()
        strides = self.empty(shape, device="meta").stride()
        # A tensor of its own over the buffer's storage (a view would share the
        # buffer's version counter with every other, which autograd checks).
        tensor = self.empty(0, dtype=dtype)
        tensor.set_(self.storage, self.offset // dtype.itemsize, shape, strides)
        self.offset += (math.prod(shape) * dtype.itemsize + 255) // 256 * 256
        return tensor

    def install(self) -> None:
        def empty(*shape, dtype=None, device=None, **kwargs):
            # torch.empty((M, N)) or torch.empty(M, N)
            sizes = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
            return self.take(tuple(sizes), dtype)

        def empty_like(t, *, dtype=None, **kwargs):
            return self.take(tuple(t.shape), dtype or t.dtype)

        torch.empty, torch.empty_like = empty, empty_like


def param_sizes(ptx: str) -> list[int]:
    """The byte size of each parameter of the PTX's kernel, in order."""
    entry = ptx[ptx.index(".entry") :]
    declared = entry[entry.index("(") + 1 : entry.index(")")]
    sizes = []
    for line in declared.split(","):
        kind = re.search(r"\.(u|s|b|f)(8|16|32|64)\b", line)
        count = re.search(r"\[(\d+)\]", line)
        sizes.append(int(kind.group(2)) // 8 * (int(count.group(1)) if count else 1))
    return sizes


def describe_binaries() -> None:
    # Each binary's parameter sizes, for the stand-in to record its launches by.
    for binary in launches._binaries.values():
        sizes = param_sizes(binary.compiled.asm["ptx"])
        array = (ctypes.c_uint64 * len(sizes))(*sizes)
        fake.fake_set_param_sizes(ctypes.c_void_p(binary.function), len(sizes), array)


def compare(name: str, call, pool: Pool) -> dict:
    """``call`` until its replays and launches have plans; then, in one more call, each
    replay and launch that has them made twice on the same tensors, once by Triton's
    launcher and once by the plans: the driver's records of the two, launch by launch."""
    # The first call compiles, the second launches the cached binary, the third replays
    # by the launch layer and plans; the next ones launch by the plans.
    for _ in range(5):
        pool.reset()
        call()
    describe_binaries()
    pairs = []
    encodes = []  # the tensor maps encoded by each launcher, replay by replay
    relaunch = gemm._relaunch

    def twice(replay, *tensors):
        if replay.native is None:
            return relaunch(replay, *tensors)
        start = pool.offset  # (split-K's partials: the same memory both times)
        fake.fake_clear()
        native_launch._ENABLED = False
        relaunch(replay._replace(native=None), *tensors)
        by_triton, encoded = fake_driver.recorded(fake), fake.fake_encodes()
        pool.offset = start
        fake.fake_clear()
        native_launch._ENABLED = True
        relaunch(replay, *tensors)
        pairs.append((by_triton, fake_driver.recorded(fake)))
        encodes.append((encoded, fake.fake_encodes()))
        return None

    launch_binary = launches._launch_binary

    def binary_twice(binary, active, device, grid, args):
        if not (binary.plan and grid == binary.planned_grid):
            return launch_binary(binary, active, device, grid, args)
        fake.fake_clear()
        native_launch._ENABLED = False
        launch_binary(binary, active, device, grid, args)
        by_triton = fake_driver.recorded(fake)
        fake.fake_clear()
        native_launch._ENABLED = True
        launched = launch_binary(binary, active, device, grid, args)
        pairs.append((by_triton, fake_driver.recorded(fake)))
        return launched

    gemm._relaunch, launches._launch_binary = twice, binary_twice
    try:
        pool.reset()
        call()
    finally:
        gemm._relaunch, launches._launch_binary = relaunch, launch_binary
    return {
        "case": name,
        "planned": len(pairs),
        "launches": sum(len(a) for a, _ in pairs),
        "same": all(a == b and a for a, b in pairs),
        "params_bytes": sum(len(r["params"]) // 2 for a, _ in pairs for r in a),
        "attributes": sum(r["config"][9] for a, _ in pairs for r in a),
        "encodes": [sum(e[0] for e in encodes), sum(e[1] for e in encodes)],
        "differences": [[a, b] for a, b in pairs if a != b],
    }


def cases() -> dict:
    f16 = torch.float16
    torch.manual_seed(0)
    a, b = torch.randn(256, 512, dtype=f16), torch.randn(512, 384, dtype=f16)
    odd_a, odd_b = torch.randn(250, 509, dtype=f16), torch.randn(509, 381, dtype=f16)
    q, k = torch.randn(2, 4, 128, 64, dtype=f16), torch.randn(2, 4, 128, 64, dtype=f16)
    layer = mpgemm.Linear(512, 256, activation="relu")
    odd_layer = mpgemm.Linear(509, 250, activation="gelu")
    head = mpgemm.Linear(4096, 10)
    x = torch.randn(128, 512)
    odd_x = torch.randn(100, 509)
    head_x = torch.randn(4096, 4096, dtype=f16, requires_grad=True)

    def recipe(optimizer: str) -> Recipe:
        config = TrainConfig(hidden=(8,), batch_size=4, optimizer=optimizer)
        return Recipe("mpgemm", build_mlp(8, (8,), 10), config)

    adam, sgd = recipe("adam"), recipe("sgd")
    batch = torch.randn(4, 8), torch.randint(0, 10, (4,))
    logits, target = torch.randn(64, 10), torch.randint(0, 10, (64,))
    # The compared call's operands are the second pair, the call before's the first: a
    # tensor map kept from the last launch is of other addresses.
    alternating = [(torch.randn(128, 256, dtype=f16), torch.randn(256, 192, dtype=f16))]
    alternating.append((alternating[0][0].clone(), alternating[0][1].clone()))
    turns = itertools.count()
    smoothing = itertools.count(1)  # a float argument, new at every call

    bf16_layer = mpgemm.Linear(256, 128, activation="silu", compute_dtype=torch.bfloat16)
    bf16_x = torch.randn(64, 256, requires_grad=True)
    # A batch of products whose second operand is broadcast: its gradient is summed
    # over the batch (the TMA kernel's SUM_BATCH).
    q_grad = torch.randn(2, 4, 128, 64, dtype=f16, requires_grad=True)
    k_shared = torch.randn(1, 4, 64, 128, dtype=f16, requires_grad=True)
    decayed = mpgemm.Linear(64, 64)
    adamw = mpgemm.LossScaleOptimizer(
        mpgemm.optim.AdamW(
            [{"params": [decayed.weight], "weight_decay": 0.1}, {"params": [decayed.bias]}],
            weight_decay=0.0,
        )
    )
    decayed_x = torch.randn(32, 64)

    def backward(module, inputs):
        # No gradient kept from the last call: the pool hands its memory out again.
        for t in (*module.parameters(), inputs):
            t.grad = None
        module(inputs).float().sum().backward()

    def batched_backward():
        q_grad.grad = k_shared.grad = None
        mpgemm.matmul(q_grad, k_shared).float().sum().backward()

    def adamw_step():
        adamw.zero_grad(set_to_none=True)
        adamw.backward(decayed(decayed_x).float().sum())
        adamw.step()

    return {
        "matmul, TMA": lambda: mpgemm.matmul(a, b),
        "matmul, TMA, operands alternating between two pairs": lambda: mpgemm.matmul(
            *alternating[next(turns) % 2]
        ),
        "matmul, A transposed, TMA": lambda: mpgemm.matmul(b.t(), a.t()),
        "matmul, unaligned (pointer kernel)": lambda: mpgemm.matmul(odd_a, odd_b),
        "batched matmul, TMA": lambda: mpgemm.matmul(q, k.transpose(-1, -2)),
        "Linear relu forward and backward, TMA": lambda: backward(layer, x),
        "Linear gelu forward and backward, pointer kernel": lambda: backward(odd_layer, odd_x),
        "10-class head's backward, split-K": lambda: backward(head, head_x),
        # Every other kernel: the cross-entropy, the ReLU's backward, the unscale, the
        # optimizers' steps, the scale's update (launches of a cached binary).
        "training step, Adam": lambda: adam.step(*batch),
        "training step, SGD with momentum": lambda: sgd.step(*batch),
        "cross-entropy, its label smoothing new each call": lambda: mpgemm.cross_entropy(
            logits, target, label_smoothing=next(smoothing) / 64
        ),
        "Linear silu BF16 forward and backward": lambda: backward(bf16_layer, bf16_x),
        "batched matmul backward, an operand broadcast": batched_backward,
        "AdamW step, two param groups, loss scaled": adamw_step,
        # Last: from here on every launch is a programmatic dependent launch.
        PDL: lambda: mpgemm.matmul(a, b),
    }


UNPLANNED = "a launch that cannot be planned"


def unplanned() -> dict:
    """A replay whose plan cannot be made (``plan`` answering None): the calls of
    ``plan`` over 5 calls of a product of its own, the launches the driver got, and
    what the replay keeps."""
    asked = 0
    planner = native_launch.plan

    def refused(*args):
        nonlocal asked
        asked += 1
        return None

    native_launch.plan = refused
    try:
        a, b = torch.randn(64, 96, dtype=torch.float16), torch.randn(96, 80, dtype=torch.float16)
        fake.fake_clear()
        for _ in range(5):
            mpgemm.matmul(a, b)
    finally:
        native_launch.plan = planner
    (kept,) = [r.native for r in gemm._replays.values() if r.integers[:3] == (64, 80, 96)]
    return {"case": UNPLANNED, "plan_calls": asked, "launches": fake.fake_launches(), "kept": kept}


REGRIDDED = "a cached binary launched on another grid"


def regridded(pool: Pool) -> dict:
    """An unscale planned on one grid (three tensors of 1000 elements), then launched
    with tensors of 6000 (the same binary key: its grid, one program a block, is not
    an argument), by Triton's launcher and with native launches enabled: the driver's
    records of the two."""
    found, inv_scale = torch.zeros(1), torch.ones(1)
    small = [torch.randn(1000) for _ in range(3)]
    large = [torch.randn(6000) for _ in range(3)]
    for _ in range(3):
        pool.reset()
        unscale_(small, found, inv_scale)
    records = []
    for native in (False, True):
        native_launch._ENABLED = native
        pool.reset()
        fake.fake_clear()
        unscale_(large, found, inv_scale)
        records.append(fake_driver.recorded(fake))
    native_launch._ENABLED = True
    grids = [r["config"][:3] for r in records[0]]
    return {"case": REGRIDDED, "same": records[0] == records[1], "grids": grids}


THREADED = "a planned launch from a thread with no current context"


def threaded() -> dict:
    """A product planned on this thread, then made on new threads, which have no current
    context until a launcher makes one (as Triton's does): by Triton's launcher, then by
    the plan. What each made: its launches, or the error it raised."""
    a, b = torch.randn(128, 64, dtype=torch.float16), torch.randn(64, 96, dtype=torch.float16)
    for _ in range(4):
        mpgemm.matmul(a, b)
    made = {}

    def run(native: bool) -> None:
        native_launch._ENABLED = native
        fake.fake_clear()
        try:
            mpgemm.matmul(a, b)
            made[native] = fake.fake_launches()
        except RuntimeError as error:
            made[native] = str(error)

    for native in (False, True):
        thread = threading.Thread(target=run, args=(native,))
        thread.start()
        thread.join()
    native_launch._ENABLED = True
    return {"case": THREADED, "by_triton": made[False], "by_plan": made[True]}


ENTRY = "matmul's replay at its entry"


def entry(pool: Pool) -> dict:
    """Products made until ``mpgemm.matmul`` replays them from its entry
    (``functional._replay_key``), by Triton's launcher and by plans: for each, the
    calls of ``_linear_function`` (the full path's) in one more call, and whether the
    driver got the same launches as from the full path (the decisions kept cleared) on
    the same tensors."""
    f16, bf16 = torch.float16, torch.bfloat16
    products = {
        "TMA": (torch.randn(128, 64, dtype=f16), torch.randn(64, 96, dtype=f16), {}),
        "pointer": (torch.randn(50, 37, dtype=f16), torch.randn(37, 45, dtype=f16), {}),
        # B as a transposed view, BF16 into FP32
        "TMA, B transposed, BF16 to FP32": (
            torch.randn(128, 64, dtype=bf16),
            torch.randn(96, 64, dtype=bf16).t(),
            {"out_dtype": torch.float32},
        ),
        # FP16 and BF16 operands, computed in BF16 (compute_dtype_for)
        "pointer, mixed dtypes": (
            torch.randn(50, 37, dtype=f16),
            torch.randn(37, 45, dtype=bf16),
            {},
        ),
        # C.T = B.T @ A.T (M <= 16 < N), and split-K with its reduction
        "pointer, transposed product": (
            torch.randn(10, 136, dtype=f16),
            torch.randn(136, 96, dtype=f16),
            {},
        ),
        "split-K": (torch.randn(16, 8192, dtype=f16), torch.randn(8192, 16, dtype=f16), {}),
    }
    layers = functional._linear_function
    full_path = 0

    def counted(*args):
        nonlocal full_path
        full_path += 1
        return layers(*args)

    results = {}
    for native in (False, True):
        native_launch._ENABLED = native
        for name, (a, b, kwargs) in products.items():
            for _ in range(5):
                pool.reset()
                mpgemm.matmul(a, b, **kwargs)
            describe_binaries()
            records = []
            for kept in (True, False):
                if not kept:
                    functional._matmul_replays.clear()
                full_path = 0
                functional._linear_function = counted
                pool.reset()
                fake.fake_clear()
                try:
                    mpgemm.matmul(a, b, **kwargs)
                finally:
                    functional._linear_function = layers
                records.append((full_path, fake_driver.recorded(fake)))
            (entered, from_entry), (walked, from_full_path) = records
            results[f"{name}, {'plans' if native else 'triton'}"] = [
                entered,
                walked,
                len(from_entry),
                from_entry == from_full_path,
            ]
    native_launch._ENABLED = True
    return {"case": ENTRY, "products": results}


def drawn(seed: int, count: int) -> dict:
    """``count`` layers drawn from ``seed``, forward and backward (``--random SEED
    COUNT``): sizes from 1 to 300 (aligned or not, so that both kernels run), FP32, FP16
    or BF16 inputs and weights, either compute dtype, the weight as itself or a
    transposed view, a bias or none, any activation, an FP32 output or the compute
    dtype's, and gradients for the input, the weight, both or neither (a no-grad
    product)."""
    generator = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=generator))]

    made = {}
    for index in range(count):
        m, k, n = (pick([1, 8, 16, 64, 100, 128, 250, 256, 300]) for _ in range(3))
        compute = pick([torch.float16, torch.bfloat16])
        x_dtype, w_dtype = pick([torch.float32, compute]), pick([torch.float32, compute])
        weight = torch.randn(n, k, dtype=w_dtype)
        if pick([False, True]):  # W as the transpose of a (K, N) tensor
            weight = torch.randn(k, n, dtype=w_dtype).t()
        bias = pick([None, torch.randn(n, dtype=pick([torch.float32, compute]))])
        activation = pick([None, "relu", "gelu", "gelu_tanh", "silu"])
        out_dtype = pick([None, torch.float32])
        grads = pick([(), ("x",), ("w",), ("x", "w")])
        x = torch.randn(m, k, dtype=x_dtype)
        x.requires_grad_("x" in grads)
        weight.requires_grad_("w" in grads)
        if bias is not None:
            bias.requires_grad_("w" in grads)

        def layer(x=x, weight=weight, bias=bias, activation=activation, out_dtype=out_dtype,
                  compute=compute):  # fmt: skip
            for t in (x, weight, bias):
                if t is not None:
                    t.grad = None
            y = mpgemm.linear(
                x, weight, bias, activation=activation, compute_dtype=compute,
                out_dtype=out_dtype,
            )  # fmt: skip
            if y.requires_grad:
                y.float().sum().backward()

        name = (
            f"drawn {index}: {m}x{k}x{n}, x {x_dtype}, W {w_dtype}"
            f"{' (a transpose)' if weight.stride(0) == 1 and k > 1 else ''}, compute "
            f"{compute}, bias {None if bias is None else bias.dtype}, {activation}, out "
            f"{out_dtype}, gradients {grads}"
        )
        made[name] = layer
    return made


def main() -> None:
    global fake
    fake = fake_driver.activate()
    pool = Pool(1 << 28)
    if sys.argv[1:2] == ["--random"]:
        drawn_cases = drawn(int(sys.argv[2]), int(sys.argv[3]))
        pool.install()
        for name, call in drawn_cases.items():
            print(json.dumps(compare(name, call, pool)), flush=True)
        return
    prepared = cases()  # made before the pool stands in for torch.empty
    pool.install()
    special = {
        UNPLANNED: unplanned,
        REGRIDDED: lambda: regridded(pool),
        THREADED: threaded,
        ENTRY: lambda: entry(pool),
    }
    names = sys.argv[1:] or [*special, *prepared]
    for name in names:
        if name in special:
            print(json.dumps(special[name]()), flush=True)
            continue
        if name == PDL:
            dependent_launch._requested = dependent_launch._active = True  # (no GPU to ask)
            launches.forget_binaries()
        print(json.dumps(compare(name, prepared[name], pool)), flush=True)


if __name__ == "__main__":
    main()
