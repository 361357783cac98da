"""Every kernel launch goes through ``launch``, which runs the kernel, or hands the
launch to an interceptor instead:

- ``record_to(path)`` (or ``MPGEMM_RECORD_LAUNCHES=path`` in the environment): one JSON
  line per launch saying what it would compile, and no launch. It answers, on any
  machine and without running a kernel, how many binaries a workload makes a GPU
  compile on a cold cache (``count_compiles``; ``bash bench/gpu_check.sh plan``).
- ``count_launches()``: counts the launches of a block of code, mpgemm's (not run) and
  torch's (run), and its host time: launches and host microseconds per training step.
- ``compile_launch`` (``MPGEMM_PRECOMPILE=1`` in the environment): compile the launch
  with triton's own JIT for every config the GPU would autotune over, and no launch.
  Under ``MPGEMM_PRECOMPILE=1`` the compiles run on a thread per core (triton's async
  compile mode) into triton's on-disk cache: a run of the same workload afterwards finds
  every binary there instead of compiling them one after another as it autotunes.
  ``mpgemm.kernels.aot`` compiles this way for an H100 on a machine without one, as
  does ``MPGEMM_PRECOMPILE=hopper`` (``compile_for_hopper``); with
  ``MPGEMM_CACHE_KEYS=path``, each compile's cache key is recorded
  (``record_cache_keys``): ``bench/warm_cache.py`` builds the GPU's cache so, here.

The JIT compiles one binary per *specialisation* of a kernel: its constexpr arguments,
the dtype of each pointer and whether it is 16-byte aligned, and whether each integer is
1 or a multiple of 16. An autotuned kernel compiles every config that pruning keeps,
once per new autotune key (the key's arguments and the tensors' dtypes).

While launches are intercepted nothing runs, so tensors on any device (the CPU, "meta"
excepted) take the kernel path (``mpgemm.backend``).
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode
from triton import knobs
from triton.knobs import HookChain
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from mpgemm.kernels import dependent_launch, native_launch

# interceptor(kernel, grid, args, kwargs, configs): what launch does instead of running.
# ``configs()`` gives an autotuned kernel's configs that survive pruning on a GPU (a
# function: pruning costs host time, which only the recording interceptors spend).
Configs = Callable[[], Sequence[triton.Config]]
Interceptor = Callable[[object, object, tuple, dict, Configs], None]
_interceptor: Interceptor | None = None


def intercepting() -> bool:
    """Whether launches are intercepted (recorded or compiled) rather than run."""
    return _interceptor is not None


@contextmanager
def intercept(interceptor: Interceptor) -> Iterator[None]:
    """Hand every launch in the block to ``interceptor`` instead of running it."""
    global _interceptor
    previous, _interceptor = _interceptor, interceptor
    try:
        yield
    finally:
        _interceptor = previous


def launch(kernel, grid, *args, gpu_configs: Configs = tuple, **kwargs) -> Launched | None:
    """``kernel[grid](*args, **kwargs)``, unless launches are intercepted. Returns the
    launch when it called a cached binary's launcher (below), which ``relaunch`` can
    repeat with other arguments of the same binary key; else None.

    An autotuned kernel goes through its autotuner once per launch kind (``_kind``);
    later launches of the kind run the JIT function with the config it chose
    (``_chosen``). A compiled JIT function is then launched by calling its binary's
    launcher directly, once the JIT has launched the same kind with the same integers,
    tensor dtypes and alignments on this device (``_binary_key``): the JIT's binder,
    cache key and launch metadata took 37 of its 56 us of host time on the H100
    (``bench/results/h100-2026-11-24/run1-at-f281bd9/prof/profile.md``), and an eager
    training step makes some 14 launches. The launcher is given what the JIT gives it
    (``tests/test_launches.py`` compares the two). Triton's global knobs (debug,
    instrumentation) are those of the binary's first launch; a JIT function with
    pre-run hooks, and the interpreter's kernels, always go through the JIT. With
    ``native_launch.enabled()``, a cached binary's later launches on the grid of its
    first are made from C++ by its plan (``_launch_binary``).

    A callable ``grid`` is called with the launch's arguments by name (the JIT
    function's parameters, the config's included), as triton calls it. With
    ``dependent_launch.enabled()``, every launch is a programmatic dependent launch
    (``dependent_launch.OPTIONS`` join the keyword arguments).
    ``gpu_configs()``: for an autotuned kernel, the configs that pruning keeps for this
    launch on a GPU (asked only by interceptors that record or compile; the interpreter
    tunes over a config of its own)."""
    if dependent_launch.enabled():
        kwargs = {**kwargs, **dependent_launch.OPTIONS}
    if _interceptor is not None:
        _interceptor(kernel, grid, args, kwargs, gpu_configs)
        return
    tuned = isinstance(kernel, Autotuner)
    jit = kernel.fn if tuned else kernel
    direct = isinstance(jit, JITFunction) and not jit.pre_run_hooks
    if direct:
        active = driver.active
        device = active.get_current_device()
        key = _binary_key(kernel, device, args, kwargs, _constexpr_positions(jit))
        binary = _binaries.get(key)
        if binary is not None:
            return _launch_binary(binary, active, device, grid, args)
    config, options = None, kwargs
    if tuned:
        chosen = _chosen.get(kind := _kind(kernel, args, kwargs))
        if chosen is None:
            before = getattr(kernel, "configs_timings", None)
            kernel[grid](*args, **kwargs)  # times the configs, then launches the best
            _chosen[kind] = (kernel.best_config, _options(kwargs, kernel.best_config))
            timings = getattr(kernel, "configs_timings", None)
            if timings is not None and timings is not before:  # (a new dict: timed now)
                _timed[kind] = [(config, _median_ms(t)) for config, t in timings.items()]
            return None
        config, options = chosen
        _run_pre_hook(kernel, args, config, options)
    if not direct:
        jit[grid](*args, **options)
        return None
    if len(_binaries) >= _MAX_BINARIES:  # shapes without end: keep the newest
        _binaries.clear()
    compiled = jit.run(*args, grid=grid, warmup=False, **options)
    _binaries[key] = _Binary(kernel, compiled, jit, args, options, config)
    return None


class Launched(NamedTuple):
    """A launch of a cached binary, as ``launch`` made it: the binary, the grid it
    launched (a function of the key's values: the integers and the constexprs), the
    device, and the cache the binary was found in."""

    binary: _Binary
    grid: tuple
    device: int
    binaries: dict


def current(launched: Launched) -> bool:
    """Whether ``relaunch`` may repeat ``launched`` now: nothing intercepts launches, its
    binary's cache is still the one in use (``bench/host_time.py``'s stand-in binaries
    and the tests swap it), and the current device is the one it launched on."""
    return (
        _interceptor is None
        and launched.binaries is _binaries
        and driver.active.get_current_device() == launched.device
    )


def _launch_binary(binary: _Binary, active, device: int, grid, args: tuple) -> Launched:
    """A launch of a cached binary: by its plan (``native_launch``) where it has one for
    this grid, native launches are enabled and Triton's launch hooks are not set; else by
    its launcher, planning it the first time where enabled."""
    planned = binary.plan
    if planned and grid == binary.planned_grid and native_launch.enabled() and not hooks_set():
        launched = Launched(binary, grid, device, _binaries)
        native_relaunch(launched, planned, sources_of(args))
        return launched
    launched = Launched(binary, binary.launch(active, device, grid, args), device, _binaries)
    if planned is None and native_launch.enabled():
        binary.plan, binary.planned_grid = _plan(binary, grid, args), grid
    return launched


def sources_of(args: tuple) -> tuple:
    """A launch's tensor and float arguments, in order: what its plan reads at each
    launch (``native_launch.plan``)."""
    return tuple(arg for arg in args if isinstance(arg, (torch.Tensor, float)))


def _plan(binary: _Binary, grid, args: tuple) -> object:
    """``binary``'s plan for launches of its key on ``grid`` (``native_launch.plan``), or
    () where it has none: a grid computed from the arguments (which ``launch`` would
    have to compute again to compare), a config's pre-hook (which a plan does not run),
    or a descriptor (whose shape and strides its key does not hold)."""
    if callable(grid) or binary.pre_hook is not None:
        return ()
    if any(isinstance(arg, TensorDescriptor) for arg in args):
        return ()
    return native_launch.plan(binary, grid, args, sources_of(args)) or ()


def native_relaunch(launched: Launched, planned: object, sources: tuple) -> None:
    """``relaunch`` of ``launched`` by its C++ plan (``native_launch.plan``), with
    ``sources`` in its tensors' places, on the current stream: no Python of the launch
    layer's or Triton's. The caller vouches for what ``relaunch``'s caller does, and
    that Triton's launch hooks are not set (``hooks_set``), which this does not call."""
    native_launch.launch(planned, driver.active.get_current_stream(launched.device), *sources)


def hooks_set() -> bool:
    """Whether Triton's launch hooks (a profiler's) are set, which a launch must call."""
    return not (
        _no_hooks(knobs.runtime.launch_enter_hook) and _no_hooks(knobs.runtime.launch_exit_hook)
    )


def relaunch(launched: Launched, args: tuple) -> None:
    """Launch ``launched``'s binary again on the current stream, with ``args``: the
    caller vouches that ``args`` have the binary key and grid of the launch repeated
    (the same integers, tensor dtypes and alignments), descriptors with the block
    shapes its config's pre-hook would give them (which is not run), and that
    ``current(launched)`` holds. This skips ``launch``'s key and the caller's
    decisions: what a launch site of fixed signature need not repeat (``triton_gemm``'s
    eager launches)."""
    launched.binary.launch(driver.active, launched.device, launched.grid, args, hooked=False)


# The config an autotuner chose, by launch kind, with the JIT function's keyword
# arguments for it (a function of the kind). Going through the autotuner took 36 us of
# host time per GEMM on the H100 (its key, read over every argument, and the pre-hook's
# arguments), more than the JIT launch behind it (28.5 us):
# bench/results/h100-2026-11-22/run5-at-4d25c67/host/profile.md.
_chosen: dict[tuple, tuple[triton.Config, dict]] = {}
# What the autotuner measured of each config it timed for a launch kind (its median, in
# ms; None for a config that failed to compile or run), where it timed them in this
# process: the time a tile won by, and what every other tile would have cost, at no
# device time beyond the tuning's own.
_timed: dict[tuple, list[tuple[triton.Config, float | None]]] = {}


def _median_ms(timing) -> float | None:
    """The median of an autotuner's timing of a config (triton's ``do_bench`` with
    quantiles gives [median, p20, p80]; inf where the config failed)."""
    median = timing[0] if isinstance(timing, (list, tuple)) else timing
    return float(median) if math.isfinite(median) else None


def config_text(config: triton.Config) -> str:
    """A config in a few words: its meta-parameters, warps and stages (and a register
    cap, if any)."""
    words = [f"{name} {value}" for name, value in config.kwargs.items()]
    words += [f"warps {config.num_warps}", f"stages {config.num_stages}"]
    if config.maxnreg is not None:
        words.append(f"maxnreg {config.maxnreg}")
    return ", ".join(words)


def chosen_configs() -> list[dict[str, object]]:
    """What each autotuner chose so far, one entry per launch kind (``_kind``): the JIT
    function's name, the kind's key values, tensor dtypes and keyword arguments (as
    strings), and the config; where the autotuner timed its configs in this process,
    also ``timings``, [config_text, median ms or None] for each it timed. JSON-ready,
    for a benchmark's record of the tiles that its timings ran."""
    entries = []
    for kind, (config, _) in _chosen.items():
        entry: dict[str, object] = {
            "kernel": kind[0].fn.__name__,
            "kind": [str(v) for v in kind[1:]],
            "config": str(config),
        }
        if kind in _timed:
            entry["timings"] = [[config_text(c), ms] for c, ms in _timed[kind]]
        entries.append(entry)
    return entries


def _no_hooks(hook) -> bool:
    return hook is None or (type(hook) is HookChain and not hook.calls)


def _binary_key(
    kernel, device: int, args: tuple, kwargs: dict, constexprs: tuple[int, ...]
) -> tuple:
    """What the launch's binary depends on, or more: the kernel (by id: a JIT
    function's hash is computed in Python; the binary holds the kernel, so that its id
    is not reused while the key is kept), the device, the keyword arguments (constexprs
    and launch options, which also fix an autotuner's kind), the value of each
    constexpr at ``constexprs`` (positions), and per positional argument an integer's
    value (the JIT's: whether it is 1, a multiple of 16, its width), a tensor's dtype
    and 16-byte alignment, a descriptor's dtype, block shape and options, or the type of
    any other value (a float is an FP32)."""
    key = [id(kernel), device, *kwargs.items(), *[args[i] for i in constexprs if i < len(args)]]
    for a in args:
        if type(a) is int:
            key.append(a)
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        elif isinstance(a, TensorDescriptor):
            key.append((a.base.dtype, *a.block_shape, *_descriptor_options(a)))
        else:
            key.append(type(a))
    return tuple(key)


def _constexpr_positions(jit: JITFunction) -> tuple[int, ...]:
    # By id: a JIT function's own hash (what functools.cache would take) is a property
    # computed under a lock, a microsecond a launch. The entry keeps the function, so
    # that its id is not reused.
    known = _constexprs.get(id(jit))
    if known is None:
        positions = tuple(i for i, param in enumerate(jit.params) if param.is_constexpr)
        known = _constexprs[id(jit)] = (jit, positions)
    return known[1]


_constexprs: dict[int, tuple[JITFunction, tuple[int, ...]]] = {}


def _descriptor_options(descriptor: TensorDescriptor) -> tuple:
    """A descriptor's fields besides its tensor, shapes and strides: ``padding``, and
    triton 3.9's ``round_f32_to_tf32``."""
    return descriptor.padding, getattr(descriptor, "round_f32_to_tf32", False)


# Binaries by ``_binary_key``, at most so many: a run whose shapes never repeat (a new
# sequence length each batch) makes one per launch.
_MAX_BINARIES = 4096
_binaries: dict[tuple, _Binary] = {}


def forget_binaries() -> None:
    """Start a new cache of binaries: the launches made so far are no longer
    ``current``, so nothing repeats them (``dependent_launch.enable`` changes what every
    launch passes)."""
    global _binaries
    _binaries = {}


class _Binary:
    """A compiled kernel and how ``launch`` calls its launcher: its function handle and
    packed metadata, the arguments after the positional ones (constexprs given by
    keyword and defaults, constant for a key) as the JIT binds them, and the chosen
    config (None for a kernel not autotuned) and its pre-hook, if any. ``launched``:
    the kernel given to ``launch`` (a JIT function or its autotuner)."""

    def __init__(self, launched, compiled, jit, args: tuple, options: dict, config) -> None:
        self.launched = launched
        self.compiled = compiled
        self.launcher = compiled.run  # loads the module on first use: before .function
        self.function = compiled.function
        self.packed_metadata = compiled.packed_metadata
        self.config = config
        self.pre_hook = None if config is None else config.pre_hook
        # The JIT's own signature of the kernel, its parameters in order.
        given = {name: value for name, value in options.items() if name in jit.arg_names}
        bound = jit.signature.bind(*args, **given)
        bound.apply_defaults()
        self.tail = [bound.arguments[name] for name in jit.arg_names[len(args) :]]
        self.positions = {name: index for index, name in enumerate(jit.arg_names)}
        # The launches of this key by C++ (native_launch), where enabled: None until
        # ``launch`` has made one by the launcher, then the plan (or (): none) and the
        # grid it holds, which a launch must have to take it.
        self.plan: object = None
        self.planned_grid: tuple | None = None

    def launch(self, active, device: int, grid, args: tuple, *, hooked: bool = True) -> tuple:
        """Launch on ``device``'s current stream, after the config's pre-hook unless not
        ``hooked``; returns the grid launched."""
        values = [*args, *self.tail]
        pre_hook = self.pre_hook if hooked else None
        if pre_hook is not None or callable(grid):
            named = _Arguments(self.positions, values)
            if pre_hook is not None:
                pre_hook(named)
            if callable(grid):
                grid = grid(named)
        size = len(grid)
        stream = active.get_current_stream(device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        # Hook chains are always set; the JIT builds the launch metadata even for empty
        # ones.
        if _no_hooks(enter) and _no_hooks(leave):
            metadata = enter = leave = None
        else:
            metadata = self.compiled.launch_metadata(grid, stream, *values)
        self.launcher(
            grid[0],
            grid[1] if size > 1 else 1,
            grid[2] if size > 2 else 1,
            stream,
            self.function,
            self.packed_metadata,
            metadata,
            enter,
            leave,
            *values,
        )
        return grid


class _Arguments(Mapping):
    """A launch's arguments by parameter name, as triton hands them to a grid function
    and a config's pre-hook, read from the bound values without building a dict."""

    __slots__ = ("_positions", "_values")

    def __init__(self, positions: dict[str, int], values: list) -> None:
        self._positions = positions
        self._values = values

    def __getitem__(self, name: str):
        return self._values[self._positions[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._positions)

    def __len__(self) -> int:
        return len(self._positions)


def _kind(kernel: Autotuner, args: tuple, kwargs: dict) -> tuple:
    """What an autotuner's choice depends on, as its own cache key reads it: the values
    of its key arguments and the dtype of every tensor (a descriptor's too), and the
    constexprs. Sizes that share their key's buckets share a kind, so that the kinds a
    run meets stay few whatever its shapes (a ragged batch, a new sequence length)."""
    return (
        kernel,
        *[args[i] for i in _key_positions(kernel) if i < len(args)],
        *[
            a.dtype if isinstance(a, torch.Tensor) else a.base.dtype
            for a in args
            # Asked on every launch: integers, most of the arguments, are passed over
            # first (an isinstance chain for each took 3x the time).
            if type(a) is not int and isinstance(a, (torch.Tensor, TensorDescriptor))
        ],
        *kwargs.items(),
    )


@functools.cache
def _key_positions(kernel: Autotuner) -> tuple[int, ...]:
    """The positions of the autotuner's key arguments among the JIT function's (those
    passed by keyword are in the kind with every other keyword argument)."""
    names = kernel.fn.arg_names
    return tuple(names.index(key) for key in kernel.keys if key in names)


def jit_function(kernel):
    """The ``triton.jit`` function behind ``kernel`` (itself, or what an autotuner tunes)."""
    return kernel.fn if isinstance(kernel, Autotuner) else kernel


def named_arguments(kernel, args: tuple, kwargs: dict) -> dict:
    return {**dict(zip(jit_function(kernel).arg_names, args, strict=False)), **kwargs}


def launch_options(kernel, args: tuple, kwargs: dict, config: triton.Config | None) -> dict:
    """The keyword arguments the autotuner passes for ``config`` (None: a plain kernel),
    after running the config's pre-hook on the arguments as the autotuner does (the TMA
    GEMM's sets its descriptors' block shapes)."""
    if config is None:
        return dict(kwargs)
    options = _options(kwargs, config)
    _run_pre_hook(kernel, args, config, options)
    return options


def _options(kwargs: dict, config: triton.Config) -> dict:
    return {**kwargs, **config.all_kwargs()}


def _run_pre_hook(kernel, args: tuple, config: triton.Config, options: dict) -> None:
    if config.pre_hook is not None:
        config.pre_hook(named_arguments(kernel, args, options))


def compile_launch(kernel, grid, args, kwargs, configs: Configs) -> list:
    """The interceptor that compiles: the JIT's binaries for this launch (one per
    config), as the JIT would build them to run it (``warmup``)."""
    jit = jit_function(kernel)
    return [
        jit.warmup(*args, grid=grid, **launch_options(kernel, args, kwargs, config))
        for config in (configs() or [None])
    ]


def record_launch(kernel, grid, args, kwargs, configs, *, path: str) -> None:
    """The interceptor of ``record_to``: appends one JSON line per launch to ``path``."""
    named = named_arguments(kernel, args, kwargs)
    # Positional arguments are the kernel's run-time ones, keyword ones its constexprs
    # (and launch options), which specialise by value.
    runtime = named_arguments(kernel, args, {})
    record = {
        "kernel": jit_function(kernel).fn.__name__,
        "specialization": {
            **{name: _specialization(value) for name, value in runtime.items()},
            **{name: _plain(value) for name, value in kwargs.items()},
        },
        "tune_key": None,
        # An autotuned launch's configs that pruning keeps, each as the keywords it adds
        # to the binary's specialisation (count_compiles); none for a plain kernel's.
        "tiles": [],
    }
    if isinstance(kernel, Autotuner):
        dtypes = [str(v.dtype) for v in named.values() if isinstance(v, torch.Tensor)]
        # As triton's autotuner reads its key: the keys given (a keyword left to its
        # default, such as a batch flag, is not).
        keys = [_plain(named[key]) for key in kernel.keys if key in named]
        record["tune_key"] = keys + dtypes
        record["tiles"] = [
            json.dumps(c.all_kwargs(), sort_keys=True, default=str) for c in configs()
        ]
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


@contextmanager
def record_to(path: str) -> Iterator[None]:
    with intercept(lambda *launch_args: record_launch(*launch_args, path=path)):
        yield


def _specialization(value) -> object:
    if isinstance(value, torch.Tensor):
        return [str(value.dtype), value.data_ptr() % 16 == 0]
    if isinstance(value, TensorDescriptor):
        # Its block shape is the config's: the binary specialises on its dtype only.
        return ["descriptor", str(value.base.dtype)]
    if isinstance(value, int) and not isinstance(value, bool):
        return "1" if value == 1 else "d16" if value % 16 == 0 else "i"
    return _plain(value)


def _plain(value) -> object:
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


def count_compiles(records: Iterable[dict]) -> int:
    """Binaries a cold cache compiles for these launch records: every kept config of
    each autotune key (autotuning compiles them all), then one binary for each further
    specialisation of the chosen config; one per specialisation of a plain kernel. A
    config of one key and the same config of another key with the same specialisation
    (the key's sizes, each bucketed to a power of two, are arguments that specialise
    alike) are one binary: compiled once, then found in the JIT's cache."""
    tuned: dict[tuple, set[str]] = {}
    binaries: set[tuple] = set()
    for record in records:
        spec = (record["kernel"], json.dumps(record["specialization"], sort_keys=True))
        if record["tune_key"] is None:
            binaries.add(spec)
            continue
        key = (record["kernel"], json.dumps(record["tune_key"]))
        if key not in tuned:
            tuned[key] = {spec[1]}
            binaries.update((*spec, tile) for tile in record["tiles"])
        elif spec[1] not in tuned[key]:
            tuned[key].add(spec[1])
            binaries.add((*spec, *key))  # (the config chosen for the key: not known here)
    return len(binaries)


# torch ops that launch no kernel: allocations without a fill, metadata, host reads,
# and _unsafe_view, a view whose schema does not say so (reshape ends in it).
_NO_KERNEL = frozenset(
    {
        "_unsafe_view",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "detach",
        "lift_fresh",
        "set_",
        "_local_scalar_dense",
        "_has_compatible_shallow_copy_type",
        "is_same_size",
    }
)


class LaunchCount(TorchDispatchMode):
    """What ``count_launches`` counted: ``triton`` (mpgemm's kernels, by name) and
    ``torch`` (torch ops that launch a kernel, by op; views, allocations and the
    profiler's markers launch none). One torch op is counted as one launch, which is
    what almost every op launches (a foreach op over many tensors may launch more)."""

    def __init__(self) -> None:
        super().__init__()
        self.triton: dict[str, int] = {}
        self.torch: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.torch.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        aliases = any(
            r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
        )
        if not aliases and packet.__name__ not in _NO_KERNEL and func.namespace != "profiler":
            self.torch[str(packet)] = self.torch.get(str(packet), 0) + 1
        return func(*args, **(kwargs or {}))

    def _launched(self, kernel, grid, args, kwargs, configs) -> None:
        name = jit_function(kernel).fn.__name__
        self.triton[name] = self.triton.get(name, 0) + 1


@contextmanager
def count_launches() -> Iterator[LaunchCount]:
    """Count the launches in the block: mpgemm's are intercepted (they do not run, so
    their outputs hold garbage) and torch's run. With the kernels stubbed so, the
    block's host time is what the host spends on each step (``mpgemm.backend`` sends
    CPU tensors to the kernel path meanwhile, so this works on any machine)."""
    count = LaunchCount()
    with intercept(count._launched), count:
        yield count


def _precompile_in_background() -> None:
    """Make every compile of this process asynchronous, on a thread per core (the GIL
    is released while triton's passes and ptxas run); wait for them all at exit."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    mode = AsyncCompileMode(ThreadPoolExecutor(os.cpu_count()))
    mode.__enter__()
    atexit.register(mode.__exit__, None, None, None)


def compile_for_hopper(kernel, grid, args, kwargs, configs: Configs) -> list:
    """``compile_launch`` for an H100 or H200 (sm_90a) on a machine with neither: the JIT
    asks ``mpgemm.kernels.aot``'s stand-in driver for its target."""
    from mpgemm.kernels.aot import _hopper_target  # (aot imports this module)

    with _hopper_target():
        return compile_launch(kernel, grid, args, kwargs, configs)


def record_cache_keys(path: str) -> None:
    """From now on, append each compile's key in triton's cache to ``path``, one JSON
    line ``{"key": ...}`` per compile (also a compile that finds its binary there). The
    key's SHA-256 names the binary's folder in the cache; the key less its first part,
    ``triton_key()`` (a digest of the triton build's own files), is what the same
    triton version built for another Python hashes to find it (``bench/warm_cache.py``
    moves a cache so)."""
    import threading

    from triton.compiler import compiler

    keyed = compiler.get_cache_key
    lock = threading.Lock()  # (compiles run on threads: _precompile_in_background)

    def get_cache_key(*args, **kwargs) -> str:
        key = keyed(*args, **kwargs)
        with lock, open(path, "a") as f:
            f.write(json.dumps({"key": key}) + "\n")
        return key

    compiler.get_cache_key = get_cache_key


# A process started to be counted or to fill the compile cache (``gpu_check.sh``;
# ``hopper``: for an H100 on any machine, ``bench/warm_cache.py``) is intercepted from
# the start.
if os.environ.get("MPGEMM_RECORD_LAUNCHES"):
    _interceptor = lambda *launch_args: record_launch(  # noqa: E731
        *launch_args, path=os.environ["MPGEMM_RECORD_LAUNCHES"]
    )
elif os.environ.get("MPGEMM_PRECOMPILE") == "1":
    _interceptor = compile_launch
    _precompile_in_background()
elif os.environ.get("MPGEMM_PRECOMPILE") == "hopper":
    # One compile at a time: the test suite, compiled so on Python 3.11 with triton's
    # compiles on threads, ended in "SystemError: AST constructor recursion depth
    # mismatch" (ast.parse on two threads at once, pytest's and triton's).
    _interceptor = compile_for_hopper
if os.environ.get("MPGEMM_CACHE_KEYS"):
    record_cache_keys(os.environ["MPGEMM_CACHE_KEYS"])
