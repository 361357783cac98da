"""Where a step's time goes on a GPU (issue 11's profiles): one eager GEMM's host time
layer by layer (``launch``) and where a step synchronises (``syncs``); then, for the
guide and small MLP steps (mpgemm and autocast + fused Adam), the unscale of 200
tensors, a 512^3 FP16 product, the guide's 4096-wide input gradient with dZ in either
layout (``matmul 8192x4096x4096``, ``... A.T``, ``torch ... A.T``), the guide head's
weight gradient three ways (``head dW``, ``head dW unswapped``, ``head dW torch``) and
a 4096-wide layer's ReLU backward with its bias gradient two ways (``dZ relu``, ``dZ
relu torch``), and a transformer MLP's GELU, tanh GELU and SiLU backward from the
stored z (``dZ gelu``, ``dZ gelu torch``, ``dZ gelu 4 warps``, the same for
``gelu_tanh`` and ``silu``): the host time to enqueue one call, the wall time of a
synchronised call, torch.profiler's kernel table, and cProfile's top host functions. ``phases``: the
host time of each phase of the guide and small steps in each mode. ``idle``: why a GEMM
from an idle GPU trails its kernel (``idle_rounds``). Last, the tiles the autotuners
chose for the sections' launches, with every config they timed (``write_autotuned``).

    python3 bench/profile_gpu.py [OUT_DIR]
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import triton
from harness import L2_FLUSH_BYTES, SYNC_WARNING, median
from host_time import PHASE_COLUMNS, full_path, phase_times, replays_off
from report import autotuned_lines
from thread_handoffs import summary as handoff_summary
from torch.profiler import ProfilerActivity, profile

import mpgemm
from mpgemm import loss_scale_optimizer
from mpgemm.app.train import Recipe, TrainConfig, build_mlp
from mpgemm.kernels import activation, gemm, gemm_tma, native_launch
from mpgemm.kernels.activation import triton_activation_backward
from mpgemm.kernels.cross_entropy import padded_rows
from mpgemm.kernels.gemm import triton_gemm, use_kernel
from mpgemm.kernels.launches import (
    chosen_configs,
    intercept,
    jit_function,
    launch,
    launch_options,
)
from mpgemm.reference import activation_backward_ref
from mpgemm.scaling import unscale_

DEVICE = torch.device("cuda")


def _times(fn, calls: int = 20) -> tuple[float, float]:
    """(host ms to enqueue a call, wall ms of a synchronised call), medians."""
    host, wall = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wall.append(t2 - t0)
    host.sort()
    wall.sort()
    return host[calls // 2] * 1e3, wall[calls // 2] * 1e3


def report(name: str, fn, out: Path) -> None:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    host, wall = _times(fn)
    text = [f"## {name}\nhost enqueue {host:.3f} ms, wall {wall:.3f} ms (medians of 20)\n"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    text.append(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    )
    trace = out / f"{name.replace(' ', '_')}.trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    text.append(_last_call_kernels(events, calls=5))
    text.append(handoff_summary(events))
    if not name.startswith("guide"):  # the files that come back are few
        trace.unlink()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    stream = io.StringIO()
    pstats.Stats(pr, stream=stream).sort_stats("tottime").print_stats(30)
    text.append(stream.getvalue())
    body = "\n".join(text)
    print(body, flush=True)
    with open(out / "profile.md", "a") as f:
        f.write(body + "\n")


def _last_call_kernels(trace_events: list[dict], calls: int) -> str:
    """The kernels of the last of ``calls`` profiled calls (from a chrome trace's
    events): start (us from the first), duration (us), name, grid, shared memory."""
    events = sorted((e for e in trace_events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    last = events[-(len(events) // calls) :]
    t0 = last[0]["ts"]
    rows = [
        f"{e['ts'] - t0:9.1f} {e['dur']:8.1f}  {e['name'][:70]:70s} "
        f"grid={e['args'].get('grid')} smem={e['args'].get('shared memory')}"
        for e in last
    ]
    busy = sum(e["dur"] for e in last)
    span = last[-1]["ts"] + last[-1]["dur"] - t0
    return "\n".join(
        [f"kernels of one call: {len(last)}, busy {busy:.0f} us, span {span:.0f} us", *rows]
    )


@triton.jit
def _empty_kernel(x_ptr):
    pass


def _captured_launch(fn) -> tuple:
    """(kernel, grid, args, kwargs) of the one launch ``fn`` makes, intercepted."""
    captured = []
    with intercept(
        lambda kernel, grid, args, kwargs, configs: captured.append((kernel, grid, args, kwargs))
    ):
        fn()
    (launched,) = captured
    return launched


def launch_costs(out: Path) -> None:
    """Host microseconds per call, 300 calls queued without a sync between them: torch's
    ops, then one eager FP16 GEMM layer by layer, from the whole call down to the JIT
    function launched with the autotuner's choice."""
    x = torch.zeros(16, device=DEVICE)
    a = torch.randn(512, 512, device=DEVICE).half()
    b = torch.randn(512, 512, device=DEVICE).half()
    c = torch.empty(512, 512, device=DEVICE).half()
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count

    def pointer():
        with use_kernel("pointer"):
            mpgemm.matmul(a, b)

    def by_plans(fn):  # the replays by C++ plans (native_launch), off as shipped
        def run():
            shipped, native_launch._ENABLED = native_launch._ENABLED, True
            try:
                fn()
            finally:
                native_launch._ENABLED = shipped

        return run

    def not_replayed():  # matmul's full path, where triton_gemm decides and keys anew
        with replays_off():
            mpgemm.matmul(a, b)

    def tma_launcher():
        gemm_tma.launch_tma_gemm(
            a, b, c, bias=None, g=None, layout=(False, False), sms=sms, flags=flags
        )

    mpgemm.matmul(a, b)  # tunes
    flags = gemm._flags(torch.float16, None, None, False, None, False)
    kernel, grid, args, kwargs = _captured_launch(tma_launcher)
    kernel[grid](*args, **kwargs)
    jit_kwargs = launch_options(kernel, args, kwargs, kernel.best_config)
    jit = jit_function(kernel)
    cases = {
        "triton empty kernel": lambda: _empty_kernel[(1,)](x),
        "torch add_": lambda: x.add_(1),
        "torch.matmul fp16 512": lambda: torch.matmul(a, b),
        "mpgemm.matmul 512 (tma)": lambda: mpgemm.matmul(a, b),
        "mpgemm.matmul 512 (pointer)": pointer,
        "mpgemm.matmul 512 (tma), replays by C++ plans": by_plans(lambda: mpgemm.matmul(a, b)),
        "mpgemm.matmul 512 (pointer), replays by C++ plans": by_plans(pointer),
        "mpgemm.matmul 512 (tma), full path": full_path(lambda: mpgemm.matmul(a, b)),
        "mpgemm.matmul 512 (tma), full path, replays by C++ plans": by_plans(
            full_path(lambda: mpgemm.matmul(a, b))
        ),
        "mpgemm.matmul 512 (tma), not replayed": not_replayed,
        "  triton_gemm (no autograd, no checks)": lambda: triton_gemm(
            a, b, compute_dtype=torch.float16, out_dtype=torch.float16
        ),
        "  launch_tma_gemm (output given)": tma_launcher,
        "  two TMA descriptors": lambda: (
            gemm_tma._descriptor(a, False, gemm_tma.TensorDescriptor, None),
            gemm_tma._descriptor(b, False, gemm_tma.TensorDescriptor, None),
        ),
        "  autotuner[grid](captured arguments)": lambda: kernel[grid](*args, **kwargs),
        "  launch(captured arguments): kind, pre-hook, the binary's launcher": lambda: launch(
            kernel, grid, *args, **kwargs
        ),
        "  JIT[grid](captured arguments, best config)": lambda: jit[grid](*args, **jit_kwargs),
        "  launch(JIT function, best config): a cached binary's launcher": lambda: launch(
            jit, grid, *args, **jit_kwargs
        ),
        **_jit_parts(jit, grid, args, jit_kwargs),
    }
    lines = ["## launch costs (host us per call, 300 queued calls, median of 5 runs)"]
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        runs = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                fn()
            runs.append((time.perf_counter() - t0) / 300 * 1e6)
            torch.cuda.synchronize()
        lines.append(f"{name}: {sorted(runs)[2]:.1f} us")
    body = "\n".join(lines)
    print(body, flush=True)
    with open(out / "profile.md", "a") as f:
        f.write(body + "\n\n")


def _jit_parts(jit, grid, args: tuple, jit_kwargs: dict) -> dict:
    """The JIT launch of ``launch_costs`` in its parts, through triton 3.6's internals
    (whether a launch path of our own would pay): the binder and the cache lookup
    (``warmup=True`` returns the cached binary), the compiled kernel's launcher given
    the bound arguments, and its encoding of the two tensor maps. Where the internals
    differ, one line says so and the other cases still run."""
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        compiled = jit.run(*args, grid=grid, warmup=True, **jit_kwargs)
        binder = jit.device_caches[torch.cuda.current_device()][-1]
        bound = list(binder(*args, **jit_kwargs)[0].values())
        programs = grid(jit_kwargs)[0]
        stream = torch.cuda.current_stream().cuda_stream
        metas = compiled.metadata.tensordesc_meta
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    except Exception as error:  # noqa: BLE001 - reported, not fatal
        return {f"  JIT parts unavailable ({type(error).__name__}: {error})": lambda: None}
    return {
        "  JIT binder and cache lookup (warmup=True)": lambda: jit.run(
            *args, grid=grid, warmup=True, **jit_kwargs
        ),
        "  compiled kernel's launcher, arguments bound": lambda: run(
            programs, 1, 1, stream, function, packed, None, None, None, *bound
        ),
        "  two tensor maps encoded (the launcher's make_tensordesc_arg)": lambda: [
            make_tensordesc_arg(desc, meta) for desc, meta in zip(args[:2], metas, strict=True)
        ],
    }


def sync_sites(out: Path) -> None:
    """Where a step synchronises with the GPU: the Python stack of each synchronising
    CUDA call of one step after warm-up (torch.cuda.set_sync_debug_mode)."""
    lines = ["## host synchronisations per step, with where they happen"]
    for name, build in {
        "guide mpgemm": lambda: step_case("mpgemm", 8192, (4096, 4096), False),
        "small mpgemm": lambda: step_case("mpgemm", 128, (128,), False),
    }.items():
        step = build()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        stacks = []

        def record(message, *args, stacks=stacks, **kwargs):
            if SYNC_WARNING in str(message):
                stacks.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-1]))

        # catch_warnings puts showwarning back on leaving.
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        lines.append(f"### {name}: {len(stacks)}")
        lines += stacks
    body = "\n".join(lines)
    print(body, flush=True)
    with open(out / "profile.md", "a") as f:
        f.write(body + "\n\n")


def idle_rounds(out: Path, rounds: int = 10) -> None:
    """Why a GEMM from an idle GPU trails its kernel time (the bench report's
    unexplained ms): FP16 squares of 2048, 4096 and 8192 by mpgemm's TMA kernel, its
    pointer kernel and cuBLAS, ``rounds`` rounds as the bench times them from an idle
    GPU (the L2 flush, then the call, then a wait), then ``rounds`` calls back to back,
    under torch.profiler. Medians of the host's enqueue, the GPU's wait from the flush's
    end to the call's first kernel, and the call's kernel time idle and busy: a wait
    near the enqueue less the flush is host time; an idle kernel slower than a busy one
    is the device's. Then the host's enqueue again with each round's wait a spin on an
    event's query in Python instead of ``torch.cuda.synchronize`` (the driver's wait,
    which spins, yields or blocks by the device's schedule flags): an enqueue that is
    shorter spun than synchronized is the host thread's own slowness after a long wait,
    not the call's work."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=DEVICE)
    lines = [
        f"## GEMMs from an idle GPU (us, medians of {rounds})",
        "| case | impl | host enqueue | flush | wait after the flush | kernels idle | busy "
        "| host enqueue, rounds spin-waited |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    api_lines = [
        f"## Host API calls inside each call (us, medians of {rounds}; a second pass, with "
        "torch.profiler's CPU activity)",
        "| case | impl | idle: call | API calls | longest API call | busy: call | API calls "
        "| longest API call |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size in (2048, 4096, 8192):
        a, b = (torch.randn(size, size, device=DEVICE).half() for _ in range(2))

        def pointer(a=a, b=b):
            with use_kernel("pointer"):
                return mpgemm.matmul(a, b)

        calls = {
            "mpgemm": lambda a=a, b=b: mpgemm.matmul(a, b),
            "mpgemm_pointer": pointer,
            "torch_fp16": lambda a=a, b=b: torch.matmul(a, b),
        }
        for impl, fn in calls.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            hosts = []
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(rounds):
                    flush.zero_()
                    start = time.perf_counter()
                    fn()
                    hosts.append((time.perf_counter() - start) * 1e6)
                    torch.cuda.synchronize()
                for _ in range(rounds):
                    fn()
                torch.cuda.synchronize()
            kernels = sorted(
                (
                    (e["name"], e["ts"], e["dur"])
                    for e in _trace_events(prof)
                    if e.get("cat") == "kernel"
                ),
                key=lambda kernel: kernel[1],
            )
            flushes, waits, idle, busy = idle_waits(kernels, rounds)
            spun = []
            for _ in range(rounds):
                flush.zero_()
                start = time.perf_counter()
                fn()
                spun.append((time.perf_counter() - start) * 1e6)
                done = torch.cuda.Event()
                done.record()
                while not done.query():
                    pass
            cells = [
                median(hosts),
                median(flushes),
                median(waits),
                median(idle),
                median(busy),
                median(spun),
            ]
            lines.append(f"| {size}^3 | {impl} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
            try:
                api = _api_cells(fn, flush, rounds)
            except Exception as error:  # the first table stands without this one
                api = f"failed: {type(error).__name__}: {error}"
            api_lines.append(f"| {size}^3 | {impl} | {api} |")
    lines += ["", *api_lines]
    body = "\n".join(lines)
    print(body, flush=True)
    with open(out / "profile.md", "a") as f:
        f.write(body + "\n\n")


def _api_cells(fn, flush: torch.Tensor, rounds: int) -> str:
    """The host API row of ``idle_rounds``: ``rounds`` calls from an idle GPU, then
    ``rounds`` back to back, each inside a labelled range, under torch.profiler with
    CPU activity (which adds its own host time to each torch op, so the call spans here
    run longer than the first table's enqueue), read by ``api_calls_within``."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            flush.zero_()
            with torch.profiler.record_function("idle call"):
                fn()
            torch.cuda.synchronize()
        for _ in range(rounds):
            with torch.profiler.record_function("busy call"):
                fn()
        torch.cuda.synchronize()
    events = _trace_events(prof)
    cells = []
    for label in ("idle call", "busy call"):
        spans, totals, longest = api_calls_within(events, label)
        # The call that is most often the longest, and its median duration there.
        names = [name for name, _ in longest]
        name = max(set(names), key=names.count) if names else None
        durations = [duration for n, duration in longest if n == name]
        cells += [
            f"{median(spans):.1f}",
            f"{median(totals):.1f}",
            f"{name} {median(durations):.1f}" if name else "-",
        ]
    return " | ".join(cells)


def _trace_events(prof: profile) -> list[dict]:
    """A finished profile's chrome-trace events (written to a temporary file, as
    torch.profiler exports them, and read back)."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return json.loads(trace.read_text())["traceEvents"]


def api_calls_within(
    events: list[dict], label: str
) -> tuple[list[float], list[float], list[tuple[str, float]]]:
    """For each range named ``label`` (torch.profiler's user annotations) in a chrome
    trace's ``events``: its span (us), the summed duration of the CUDA runtime and driver
    API calls that start inside it, and its longest such call (name, us), by the
    range's start."""
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name") == label
    )
    calls = sorted(
        (e["ts"], e["dur"], e["name"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver")
    )
    if not ranges:
        raise ValueError(f"no {label!r} ranges in the trace")
    spans, totals, longest = [], [], []
    for start, end in ranges:
        inside = [(dur, name) for ts, dur, name in calls if start <= ts < end]
        spans.append(end - start)
        totals.append(sum(dur for dur, _ in inside))
        if inside:
            dur, name = max(inside)
            longest.append((name, dur))
    return spans, totals, longest


def idle_waits(
    kernels: list[tuple[str, float, float]], rounds: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """From the kernels of ``idle_rounds``' profile in start order, (name, start us,
    duration us): ``rounds`` flushes (torch's fill kernel), each followed by a call's
    kernels, then ``rounds`` calls' kernels back to back, every call making as many.
    Returns the flushes' durations, each idle round's wait from its flush's end to its
    call's first kernel, each idle call's span (first kernel's start to last's end),
    and each busy call's span."""
    starts = [i for i, (name, _, _) in enumerate(kernels) if "FillFunctor" in name]
    if len(starts) != rounds:
        raise ValueError(f"expected {rounds} flushes in the profile, found {len(starts)}")
    per_call = (len(kernels) - rounds) // (2 * rounds)
    if per_call < 1 or len(kernels) != rounds + 2 * rounds * per_call:
        raise ValueError(f"{len(kernels)} kernels do not make {rounds} idle and busy calls")

    def span(call: list[tuple[str, float, float]]) -> float:
        return call[-1][1] + call[-1][2] - call[0][1]

    flushes, waits, idle = [], [], []
    for i in starts:
        _, start, duration = kernels[i]
        call = kernels[i + 1 : i + 1 + per_call]
        flushes.append(duration)
        waits.append(call[0][1] - (start + duration))
        idle.append(span(call))
    tail = kernels[starts[-1] + 1 + per_call :]
    busy = [span(tail[j : j + per_call]) for j in range(0, len(tail), per_call)]
    return flushes, waits, idle, busy


# The phases' variants of a mode's step, by the backward's thread: mpgemm's
# (``LossScaleOptimizer.backward``, on the calling thread) on autograd's worker thread
# of the GPU, as torch runs a backward by default; autocast's on the calling thread.
WORKER_THREAD = "backward on autograd's worker thread"
CALLING_THREAD = "backward on the calling thread"
PHASE_VARIANTS = (
    ("mpgemm", ""),
    ("mpgemm", WORKER_THREAD),
    ("autocast", ""),
    ("autocast", CALLING_THREAD),
    ("fp32", ""),
)


def variant_phase_times(mode: str, variant: str, batch: int, hidden: tuple[int, ...]) -> dict:
    """``phase_times`` of a step of ``mode`` (autocast with fused Adam, FP32 with
    torch's default foreach Adam) as shipped, or as ``variant`` says (``PHASE_VARIANTS``)."""
    inputs = step_inputs(mode, batch, hidden, mode == "autocast")
    calling = loss_scale_optimizer._CALLING_THREAD
    loss_scale_optimizer._CALLING_THREAD = variant != WORKER_THREAD
    try:
        # (autograd's setting is the calling thread's, read by each backward it starts)
        with torch.autograd.set_multithreading_enabled(variant != CALLING_THREAD):
            return phase_times(*inputs)
    finally:
        loss_scale_optimizer._CALLING_THREAD = calling


def phases(out: Path, rounds: int = 2) -> None:
    """``phase_times`` of the guide and small steps in each mode, and by the backward's
    thread (``PHASE_VARIANTS``), as one table: ``rounds`` rounds over the variants in
    turn, so that a drift of the host's speed shows as a difference between rounds."""
    lines = [
        "## host time of a step by phase (us, medians of 50 steps)",
        "| case | round | " + " | ".join(PHASE_COLUMNS) + " |",
        "|" + " --- |" * (len(PHASE_COLUMNS) + 2),
    ]
    for size, batch, hidden in (("guide", 8192, (4096, 4096)), ("small", 128, (128,))):
        for round_ in range(1, rounds + 1):
            for mode, variant in PHASE_VARIANTS:
                times = variant_phase_times(mode, variant, batch, hidden)
                row = " | ".join(f"{times[name]:.0f}" for name in PHASE_COLUMNS)
                label = f"{size} {mode}, {variant}" if variant else f"{size} {mode}"
                lines.append(f"| {label} | {round_} | {row} |")
    body = "\n".join(lines)
    print(body, flush=True)
    with open(out / "profile.md", "a") as f:
        f.write(body + "\n\n")


def step_case(mode: str, batch: int, hidden: tuple[int, ...], fused: bool):
    recipe, x, y = step_inputs(mode, batch, hidden, fused)
    return lambda: recipe.step(x, y)


def step_inputs(mode: str, batch: int, hidden: tuple[int, ...], fused: bool):
    """(recipe, x, y): a step of the 784-input MLP with ``hidden`` widths, on the GPU."""
    torch.manual_seed(0)
    config = TrainConfig(hidden=hidden, batch_size=batch, device="cuda")
    net = build_mlp(784, hidden, 10).to(DEVICE)
    recipe = Recipe(mode, net, config, fused_torch_optimizer=fused)
    x = torch.randn(batch, 784, device=DEVICE)
    y = torch.randint(0, 10, (batch,), device=DEVICE)
    return recipe, x, y


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    cases = {
        "guide mpgemm": lambda: step_case("mpgemm", 8192, (4096, 4096), False),
        "guide mpgemm_cuda_graph": lambda: step_case(
            "mpgemm_cuda_graph", 8192, (4096, 4096), False
        ),
        "guide autocast_fused": lambda: step_case("autocast", 8192, (4096, 4096), True),
        "small mpgemm": lambda: step_case("mpgemm", 128, (128,), False),
        "small fp32": lambda: step_case("fp32", 128, (128,), False),
        "unscale 200": lambda: _unscale(),
        "matmul 512": lambda: _matmul(512),
        "matmul 4096": lambda: _matmul(4096),
        "matmul 8192x4096x4096": lambda: _layer_product("mpgemm", transposed_a=False),
        "matmul 8192x4096x4096 A.T": lambda: _layer_product("mpgemm", transposed_a=True),
        "torch 8192x4096x4096 A.T": lambda: _layer_product("torch", transposed_a=True),
        "matmul 8192x4096x4096 A.T relu": lambda: _layer_product("relu", transposed_a=True),
        "head dW": lambda: _head_weight_gradient("mpgemm"),
        "head dW 4 splits": lambda: _head_weight_gradient("4 splits"),
        "head dW unswapped": lambda: _head_weight_gradient("unswapped"),
        "head dW torch": lambda: _head_weight_gradient("torch"),
        "head dX": lambda: _head_input_gradient("mpgemm"),
        "head dX fp16 padded": lambda: _head_input_gradient("fp16 padded"),
        "head dX fp32 padded": lambda: _head_input_gradient("fp32 padded"),
        "head dX torch": lambda: _head_input_gradient("torch"),
        "head dX relu": lambda: _head_input_gradient("relu"),
        "head forward": lambda: _head_forward("mpgemm"),
        "head forward torch": lambda: _head_forward("torch"),
        "dZ relu": lambda: _relu_backward("mpgemm"),
        "dZ relu torch": lambda: _relu_backward("torch"),
        "dZ relu 6 per SM": lambda: _relu_backward("mpgemm", 6),
        "dZ relu 8 per SM": lambda: _relu_backward("mpgemm", 8),
        "dZ relu 16 per SM": lambda: _relu_backward("mpgemm", 16),
        "dZ relu 1 stage": lambda: _relu_backward("mpgemm", stages=1),
        "dZ relu 2 stages": lambda: _relu_backward("mpgemm", stages=2),
        "dZ relu 3 stages": lambda: _relu_backward("mpgemm", stages=3),
        **{
            f"dZ {act}{how}": lambda act=act, how=how: _stored_z_backward(act, how)
            for act in ("gelu", "gelu_tanh", "silu")
            for how in ("", " torch", " 4 warps")
        },
    }
    sections = {
        "launch": lambda: launch_costs(out),
        "syncs": lambda: sync_sites(out),
        "phases": lambda: phases(out),
        "idle": lambda: idle_rounds(out),
        **{
            name: lambda build=build, name=name: report(name, build(), out)
            for name, build in cases.items()
        },
    }
    unknown = sorted((only or set()) - sections.keys())
    if unknown:  # before anything runs: a misspelt case would cost a device call
        sys.exit(f"profile_gpu: no section {', '.join(unknown)}; sections: {', '.join(sections)}")
    failed = [
        name
        for name, run in sections.items()
        if (only is None or name in only) and not _ran(name, run, out)
    ]
    write_autotuned(out)
    if failed:
        sys.exit(f"profile_gpu: {len(failed)} section(s) failed: {', '.join(failed)}")


def write_autotuned(out: Path) -> None:
    """Append to profile.md the tiles the sections' launches ran and what each config
    the autotuner timed for them cost (the guide step's GEMMs among them): the bench
    report's tables (``report.autotuned_lines``), at no device time of their own."""
    tuned = autotuned_lines(chosen_configs())
    if tuned:
        with open(out / "profile.md", "a") as f:
            f.write("\n".join(tuned) + "\n")


def _ran(name: str, run, out: Path) -> bool:
    """Run one section; a section that raises is reported in profile.md (and on stderr)
    and the others still run: a device call's minutes are not lost to one stale case."""
    try:
        run()
    except Exception:
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        with open(out / "profile.md", "a") as f:
            f.write(f"## {name}: failed\n\n```\n{text}```\n\n")
        return False
    return True


def _unscale():
    grads = [torch.randn(500_000, device=DEVICE) for _ in range(200)]
    found, inv = torch.zeros((), device=DEVICE), torch.ones((), device=DEVICE)
    return lambda: unscale_(grads, found, inv)


def _layer_product(how: str, *, transposed_a: bool):
    """The guide's 4096-wide layer's input gradient, dZ @ W (8192 x 4096 x 4096, FP16),
    with dZ as the backward lays it out (A.T: unit stride down M, the transpose of the
    weight gradient's A) or row-major as a forward's A; mpgemm's TMA kernel or cuBLAS;
    or ("relu") the gradient at the input of the ReLU whose output y the layer read,
    masked by y and summed by column in the epilogue, as the step runs it now
    (``functional._fusable_relu``: against this case without it plus ``dZ relu``).
    In run5's step profile this launch took 413 us against 353 for the forward's."""
    a = torch.randn(8192, 4096, device=DEVICE).half()
    if transposed_a:
        a = a.t().contiguous().t()
    b = torch.randn(4096, 4096, device=DEVICE).half()
    if how == "torch":
        return lambda: torch.matmul(a, b)
    if how == "relu":
        y = torch.relu(torch.randn(8192, 4096, device=DEVICE)).half()
        args = dict(compute_dtype=torch.float16, out_dtype=torch.float16)
        return lambda: triton_gemm(a, b, relu_output=y, colsum_c=True, **args)
    return lambda: mpgemm.matmul(a, b)


def _head_weight_gradient(how: str):
    """The guide head's weight and bias gradients from the FP32 logits' gradient dY
    (8192 x 10, in the rows 16 apart that mpgemm's loss lays it out in) and the FP16
    hidden output x (8192 x 4096): mpgemm's (x.T @ dY on 16-wide tiles, K split 8 ways,
    the bias gradient from dY's column sums), the same with K split 4 ways (as before
    the split rule filled two programs an SM: run8 took 34.5 us, cuBLAS 29.0 on 256
    programs), the same launch unswapped (dY.T @ x, as before 8f82757: NARROW_N set to
    0), or torch's under autocast (dY cast to FP16, cuBLAS, the product cast to FP32;
    the bias gradient a sum)."""
    dy = padded_rows(8192, 10, torch.float32, DEVICE)
    dy.copy_(torch.randn(8192, 10, device=DEVICE))
    x = torch.randn(8192, 4096, device=DEVICE).half()
    out = torch.empty(10, 4096, device=DEVICE)
    args = dict(compute_dtype=torch.float16, out_dtype=torch.float32, rowsum_a=True, out=out)
    if how == "torch":
        return lambda: (torch.matmul(dy.t().half(), x).float(), dy.sum(0))
    if how == "mpgemm":
        return lambda: triton_gemm(dy.t(), x, **args)
    if how == "4 splits":

        def four_splits():
            # A replay keeps the split it was made with: none is kept across the swap.
            split_k_for, gemm.split_k_for = gemm.split_k_for, lambda m, n, k, device: 4
            gemm._replays.clear()
            try:
                return triton_gemm(dy.t(), x, **args)
            finally:
                gemm.split_k_for = split_k_for
                gemm._replays.clear()

        return four_splits

    def unswapped():
        narrow, gemm.NARROW_N = gemm.NARROW_N, 0
        try:
            return triton_gemm(dy.t(), x, **args)
        finally:
            gemm.NARROW_N = narrow

    return unswapped


def _head_input_gradient(how: str):
    """The guide head's input gradient, dY @ W (8192 x 10 by 10 x 4096, into FP16; run6's
    step on the H200: 43.4 us, 1.56 TB/s of the 64 MB it writes): as the step ran it
    until the loss's backward padded its rows (dY the FP32 logits' gradient, 40-byte
    rows: the pointer kernel's unaligned tiles); from dY rounded to FP16 into rows padded
    to 16 (the rounding inside the call, a torch copy; then the TMA kernel, its
    descriptor's bounds at 10 columns); from dY in FP32 rows padded to 16 (64 bytes: the
    pointer kernel's aligned tiles; run8: 36.7 us against 41.9), as the step runs it
    now (``cross_entropy.padded_rows``), or so and at the input of the ReLU whose output
    the head read ("relu": masked and summed by column in the epilogue, as the step runs
    it now, ``functional._fusable_relu``); or torch's under autocast (dY cast to FP16,
    cuBLAS)."""
    dy = torch.randn(8192, 10, device=DEVICE)
    w = torch.randn(10, 4096, device=DEVICE).half()
    args = dict(compute_dtype=torch.float16, out_dtype=torch.float16)
    if how == "torch":
        return lambda: torch.matmul(dy.half(), w)
    if how == "mpgemm":
        return lambda: triton_gemm(dy, w, **args)
    # dY's 10 columns in rows of 16 (the loss's layout): FP32 as the loss's backward
    # writes it, or FP16 rounded at each call
    dtype = torch.float16 if how == "fp16 padded" else torch.float32
    rows = padded_rows(8192, 10, dtype, DEVICE)
    rows.copy_(dy)
    if how == "fp32 padded":
        return lambda: triton_gemm(rows, w, **args)
    if how == "relu":
        y = torch.relu(torch.randn(8192, 4096, device=DEVICE)).half()
        return lambda: triton_gemm(rows, w, relu_output=y, colsum_c=True, **args)

    def rounded():
        rows.copy_(dy)
        return triton_gemm(rows, w, **args)

    return rounded


def _head_forward(how: str):
    """The guide head's forward, the FP32 logits x @ W.T + bias (8192 x 4096 by 4096 x
    10; run6's step: 29.9 us for the 64 MB of x, on 64 programs of 128 rows): mpgemm's
    (the TMA kernel, autotuned), or torch's under autocast (cuBLAS with the bias, in
    FP16, then cast to FP32)."""
    x = torch.randn(8192, 4096, device=DEVICE).half()
    w = torch.randn(10, 4096, device=DEVICE).half()
    bias = torch.randn(10, device=DEVICE)
    if how == "torch":
        return lambda: torch.nn.functional.linear(x, w, bias.half()).float()
    return lambda: triton_gemm(
        x, w.t(), compute_dtype=torch.float16, out_dtype=torch.float32, bias=bias
    )


def _relu_backward(how: str, programs_per_sm: int | None = None, stages: int | None = None):
    """dZ = dY masked where y <= 0 and the bias gradient, dZ's FP32 column sums, for the
    guide's 4096-wide layer (8192 x 4096, FP16): mpgemm's one pass
    (``mpgemm.kernels.activation``) or torch's two (threshold_backward, then a sum that
    reads dZ again: 60 + 42 us in run5's step profile). ``programs_per_sm``: the
    programs the launch aims for per SM in place of ``activation._PROGRAMS_PER_SM`` (4:
    the H200 ran 512 programs of 16 row steps at 2.96 TB/s in the guide step, run6; on
    the H100 the kernel took 76.6 us where torch's threshold_backward took 60.7);
    ``stages``: the row steps in flight per program in place of ReLU's
    ``activation._STAGES`` (4; 1 is the loop without pipelining, as run6 ran it)."""
    dy = torch.randn(8192, 4096, device=DEVICE).half()
    y = torch.randn(8192, 4096, device=DEVICE).relu().half()
    if how == "torch":
        return lambda: activation_backward_ref(dy, y, "relu", torch.float16, bias_grad=True)

    def run():
        defaults = activation._PROGRAMS_PER_SM, activation._STAGES["relu"]
        activation._PROGRAMS_PER_SM = programs_per_sm or defaults[0]
        activation._STAGES["relu"] = stages or defaults[1]
        try:
            return triton_activation_backward(dy, y, "relu", torch.float16, bias_grad=True)
        finally:
            activation._PROGRAMS_PER_SM, activation._STAGES["relu"] = defaults

    return run


def _stored_z_backward(act: str, how: str):
    """dZ = dY act'(z) and the bias gradient for a transformer MLP's up-projection
    (8192 x 11008, FP16), from z as its forward stored it: mpgemm's one pass (``""``;
    ``" 4 warps"``: at 4 warps a program in place of ``activation._WARPS``'s 8), or
    autocast's ops (``" torch"``: its backward from its 16-bit z, then a sum that reads
    dZ again)."""
    dy = torch.randn(8192, 11008, device=DEVICE).half()
    z = (torch.randn(8192, 11008, device=DEVICE) * 3).half()
    if how == " torch":
        if act == "silu":
            return lambda: torch.ops.aten.silu_backward(dy, z).sum(0, dtype=torch.float32)
        approximate = "tanh" if act == "gelu_tanh" else "none"
        return lambda: torch.ops.aten.gelu_backward(dy, z, approximate=approximate).sum(
            0, dtype=torch.float32
        )

    def run():
        default = activation._WARPS[act]
        activation._WARPS[act] = 4 if how == " 4 warps" else default
        try:
            return triton_activation_backward(dy, z, act, torch.float16, bias_grad=True)
        finally:
            activation._WARPS[act] = default

    return run


def _matmul(s: int):
    a = torch.randn(s, s, device=DEVICE).half()
    b = torch.randn(s, s, device=DEVICE).half()
    return lambda: mpgemm.matmul(a, b)


if __name__ == "__main__":
    main()
