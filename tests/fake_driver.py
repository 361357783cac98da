"""A stand-in CUDA driver for a machine without a GPU (``fake_libcuda.c``): built with
``build``, put before a process starts with ``environment`` (the loader reads
LD_LIBRARY_PATH then), and made Triton's active driver inside it with ``activate``. Then
mpgemm's kernels compile for an H100 and launch through Triton's real launchers, and
mpgemm's replays through ``native_launch``, into the stand-in, which runs nothing and
records what it is handed (``recorded``). For ``tests/test_native_launch.py`` and
``bench/native_launch_time.py``."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fake_libcuda.c"
# The stream every launch is given (any value: the stand-in only records it).
STREAM = 0x5157


def build(folder: Path) -> Path:
    """Compile the stand-in into ``folder`` as libcuda.so.1 (and libcuda.so, which Triton
    links its utilities against), with the CUDA header in the triton wheel; returns
    ``folder``."""
    import triton

    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    library = folder / "libcuda.so.1"
    subprocess.run(
        ["gcc", "-O1", "-Wall", "-Werror", "-shared", "-fPIC", f"-I{include}",
         "-Wl,-soname,libcuda.so.1", "-o", str(library), str(SOURCE)],
        check=True,
    )  # fmt: skip
    link = folder / "libcuda.so"
    if not link.exists():
        link.symlink_to(library.name)
    return folder


def environment(folder: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child that loads the stand-in in ``folder``
    (not interpreted: the kernels compile), with ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(LD_LIBRARY_PATH=str(folder), TRITON_LIBCUDA_PATH=str(folder), **extra)
    return env


def _untimed(self, *args, config, **meta) -> list[float]:
    return [1.0, 1.0, 1.0]  # every config alike: the autotuner keeps the first


def _uncached(self, tuning_key, configs, bench_fn) -> bool:
    bench_fn()  # and no timing written to triton's cache
    return False


def activate() -> ctypes.CDLL:
    """In a process started with ``environment``: make Triton's CUDA driver the active one,
    answering for device 0 (compute capability 9.0) and ``STREAM``; let CPU tensors take
    mpgemm's kernel path (they stand for the GPU's: nothing reads them); and let the
    autotuners keep their first config untimed (nothing runs to time; triton 3.6 times
    even a single pruned config). Returns the stand-in library."""
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner

    from mpgemm import functional

    Autotuner._bench, Autotuner.check_disk_cache = _untimed, _uncached
    active = CudaDriver()
    active.get_current_device = lambda: 0
    active.get_current_stream = lambda device=None: STREAM
    active.get_device_capability = lambda device=None: (9, 0)
    active.set_current_device = lambda device: None
    driver.set_active(active)
    functional._intercepting = lambda: True
    fake = ctypes.CDLL("libcuda.so.1")
    fake.fake_launch.restype = ctypes.c_uint64
    return fake


def recorded(fake: ctypes.CDLL) -> list[dict]:
    """The launches the stand-in recorded since its last ``fake_clear``: each one's
    configuration (grid, block, shared memory, stream, function, attribute count), its
    attributes' bytes and its parameters' bytes (hex)."""
    launched = []
    for i in range(fake.fake_recorded()):
        params = ctypes.create_string_buffer(4096)
        config = (ctypes.c_uint64 * 10)()
        attrs = ctypes.create_string_buffer(72 * 8)
        size = fake.fake_launch(i, params, config, attrs)
        launched.append(
            {
                "config": list(config),
                "attrs": attrs.raw[: 72 * config[9]].hex(),
                "params": params.raw[:size].hex(),
            }
        )
    return launched
