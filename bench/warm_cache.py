"""A warm triton cache for the GPU, built here: the binaries a GPU session's stages
compile, compiled on this machine for an H100 or H200 (sm_90a) under the GPU's triton
version, in one archive that the device tool carries; installed on the device before the
stages run, so that they load those binaries instead of compiling them (a GEMM binary
takes some 0.8 s of a core: ``bench/gpu_check.py``'s ``COMPILE_S``; ``plan`` counts 1689
for the tests stage alone).

    python bench/warm_cache.py build [PART ...]    # here, under the GPU's triton version
    python bench/warm_cache.py install [ARCHIVE]   # on the device, before the stages
    python bench/warm_cache.py misses              # on the device, after them

``build`` runs each part's commands (``parts``: each stage's workloads, ``gpu_check.py``'s,
which ``plan`` records: at the GPU's sizes, every launch intercepted; and the graph
part's compile-only mode, ``ab_graph.py --once``) with every launch compiled for sm_90a
(``MPGEMM_PRECOMPILE=hopper``) into a fresh cache, recording each compile's cache key
(``MPGEMM_CACHE_KEYS``); default: every part; the commands side by side, a core each,
their output in ``.warm/build-PART-N.log``. It writes
``.warm/triton-cache.tar.xz`` (carried by the device call with ``carry: [".warm"]``):
each binary's metadata, cubin and PTX, without the intermediate IRs (some 70% of the
bytes), and the rest of its key.

Why keys are moved: triton finds a binary in its cache by the SHA-256 of a key that
begins with ``triton_key()``, a digest of the triton build's own files, among them
``libtriton.so``, which differs between a version's builds for Python 3.11 (here) and
3.12 (the GPU's). The rest of the key is the kernel's source and specialisation, the
backend's ``hash()`` (ptxas's version and the target), the compile options and the
environment variables that change a compile. ``install`` puts each binary under the
key the device's own triton computes, its ``triton_key()`` followed by the recorded
rest; a binary whose rest differs there, or that the archive lacks, is compiled there as
before. It installs nothing, and says why, where the triton version or the backend's
hash (ptxas's version, for the device's target) differs from the build's: the binaries
would not be those the device compiles. ``misses`` then counts the binaries compiled on
the device beyond those installed, by kernel.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.cache import _base32, get_cache_manager, triton_key

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = ROOT / ".warm" / "triton-cache.tar.xz"
# What a binary keeps of its folder: the metadata (the one .json that is not the
# group's), the binary and its PTX (which a test or two read: ``kernel.asm["ptx"]``).
KEPT = (".json", ".cubin", ".ptx")
MANIFEST = "manifest.json"
# Beside the cache's folders on the device: the folders ``install`` made.
INSTALLED = "mpgemm-warm-cache.json"
# (mpgemm.kernels.aot's, not imported: the device installs before mpgemm is.)
HOPPER = GPUTarget("cuda", 90, 32)


def backend_hash(target: GPUTarget) -> str:
    """What the compiler's backend adds to every key for ``target``: ptxas's version
    and the architecture."""
    return make_backend(target).hash()


def _brief(backend: str) -> str:
    """A backend's hash as a person reads it: ptxas's version and the architecture."""
    version = re.search(r"V(\d[\d.]*)", backend)
    return f"ptxas {version[1] if version else backend}, arch {backend.rsplit('-', 1)[-1]}"


def _digest(key: str) -> str:
    # As triton's compile names a key's folder: _base32 of this.
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _gpu_check():
    """``bench/gpu_check.py``, whose stages say what each runs (imported as its scripts
    import one another: from this folder)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    return gpu_check


def parts() -> dict[str, tuple[list, bool]]:
    """What ``build`` can compile, by the name of the session's part (``gpu_session.sh``)
    that would compile it on the GPU: each ``gpu_check`` stage's workloads, and the
    compile-only mode of a script part that has one; with whether its commands must
    exit 0 (the tests stage's suite does not: its checks read what intercepted
    launches never compute). The tests stage first: the longest (the whole suite), it
    runs beside the rest."""
    gpu_check = _gpu_check()
    found = {
        name: (stage.workloads(), stage.workloads_pass)
        for name, stage in sorted(gpu_check.STAGES.items(), key=lambda item: item[0] != "tests")
    }
    # The suite on a pytest-xdist worker per core: alone it took 744 of the build's 925 s.
    suite, must_pass = found["tests"]
    workers = ["-n", str(os.cpu_count()), "--dist", "loadfile"]
    found["tests"] = ([replace(c, argv=[*c.argv, *workers]) for c in suite], must_pass)
    # The graphed steps' variants, PDL's and the fused ReLU's binaries among them.
    graph = gpu_check.Command([gpu_check.PYTHON, "bench/ab_graph.py", "--once"], "graph.log")
    found["graph"] = ([graph], True)
    return found


def build(names: list[str], archive: Path = ARCHIVE) -> int:
    """Compile every launch of the ``parts`` named for sm_90a into a fresh cache and
    pack it into ``archive`` (``pack``); returns the binaries packed. The commands run
    side by side, one a core (the cache takes each binary once: a command that meets
    one another has compiled finds it), each with its output in a log beside the
    archive."""
    gpu_check, table = _gpu_check(), parts()
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache, keys = Path(tmp) / "cache", Path(tmp) / "keys"
        keys.mkdir()
        env = gpu_check._environment(dry=True)  # (no GPU to be seen)
        # Compiled, not interpreted: the test suite interprets where it sees no GPU.
        env.update(TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(cache))
        jobs = [
            (name, index, command) for name in names for index, command in enumerate(table[name][0])
        ]

        def run(job) -> str:
            name, index, command = job
            start, log = time.monotonic(), archive.with_name(f"build-{name}-{index}.log")
            with open(log, "w") as sink:
                done = subprocess.run(
                    command.argv,
                    cwd=ROOT,
                    env={
                        **env,
                        **command.env,
                        "MPGEMM_PRECOMPILE": "hopper",
                        "MPGEMM_CACHE_KEYS": str(keys / f"{name}-{index}.jsonl"),
                    },
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            said = f"warm_cache: {name}, `{' '.join(command.argv[1:4])} ...`,"
            # A failed command stops before its later launches: a colder cache.
            failed = done.returncode and table[name][1]
            return f"{said} took {time.monotonic() - start:.0f} s" + (
                f", exited with {done.returncode} ({log})" if failed else ""
            )

        with ThreadPoolExecutor(os.cpu_count()) as pool:
            for line in pool.map(run, jobs):
                print(line, flush=True)
        return pack(cache, sorted(keys.glob("*.jsonl")), archive)


def pack(cache: Path, keys: list[Path], archive: Path) -> int:
    """Pack the binaries in ``cache`` that the files ``keys`` (``MPGEMM_CACHE_KEYS``'s, of
    this process's triton) name: ``manifest.json`` (the triton version, the backend's
    hash for sm_90a, and per binary the rest of its key and its files) and each
    binary's kept files (``KEPT``) in a folder of its own. A key met twice (a compile
    that found its binary), or whose compile failed, is packed once or not at all."""
    prefix = triton_key()
    rests: dict[str, str] = {}
    lines = [line for path in keys if path.exists() for line in path.read_text().splitlines()]
    for line in lines:
        key = json.loads(line)["key"]
        if not key.startswith(prefix):
            raise ValueError("warm_cache: a key recorded by another triton build than this one")
        folder = _base32(_digest(key))
        if folder not in rests and any((cache / folder).glob("__grp__*.json")):
            rests[folder] = key[len(prefix) :]
    manifest: dict = {"triton": triton.__version__, "backend": backend_hash(HOPPER)}
    binaries = manifest["binaries"] = []
    with tarfile.open(archive, "w:xz") as tar:
        for index, (folder, rest) in enumerate(rests.items()):
            files = sorted(
                f.name
                for f in (cache / folder).iterdir()
                if f.suffix in KEPT and not f.name.startswith("__grp__")
            )
            binaries.append({"key_rest": rest, "files": files})
            for name in files:
                tar.add(cache / folder / name, arcname=f"{index}/{name}")
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return len(binaries)


def install(archive: Path = ARCHIVE, target: GPUTarget | None = None) -> str:
    """Put ``archive``'s binaries into this machine's triton cache, each under the key its
    triton computes (this ``triton_key()`` and the recorded rest), for ``target`` (None:
    the current GPU's); returns what was done, in a line. Nothing is installed where
    the triton version or the backend's hash differs from the build's."""
    from triton import knobs

    if target is None:
        from triton.runtime import driver

        try:
            target = driver.active.get_current_target()
        except RuntimeError as error:  # (triton finds no GPU driver: "0 active drivers")
            return f"warm cache not installed: no GPU target here ({error})"
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        unpacked = Path(tmp)
        manifest = json.loads((unpacked / MANIFEST).read_text())
        if manifest["triton"] != triton.__version__:
            return (
                f"warm cache not installed: built with triton {manifest['triton']}, "
                f"this machine has {triton.__version__}"
            )
        here = backend_hash(target)
        if manifest["backend"] != here:
            return (
                f"warm cache not installed: built for {_brief(manifest['backend'])}, this "
                f"machine compiles with {_brief(here)}"
            )
        prefix = triton_key()
        folders = []
        for index, binary in enumerate(manifest["binaries"]):
            digest = _digest(prefix + binary["key_rest"])
            manager = get_cache_manager(digest)
            group = {}
            for name in binary["files"]:
                data = (unpacked / str(index) / name).read_bytes()
                if name.endswith(".json"):  # the metadata, which names its key's digest
                    metadata = json.loads(data)
                    metadata["hash"] = digest
                    group[name] = manager.put(json.dumps(metadata), name, binary=False)
                    metadata_name = name
                else:
                    group[name] = manager.put(data, name, binary=True)
            manager.put_group(metadata_name, group)
            folders.append(_base32(digest))
    record = Path(knobs.cache.dir) / INSTALLED
    record.parent.mkdir(parents=True, exist_ok=True)  # (an archive of no binaries)
    record.write_text(json.dumps(folders))
    return (
        f"warm cache: {len(folders)} binaries installed in {knobs.cache.dir} (triton "
        f"{triton.__version__}, {_brief(here)})"
    )


def misses() -> str:
    """The binaries in this machine's triton cache that ``install`` did not put there
    (compiled since, or before it), by kernel, in a line."""
    from triton import knobs

    cache = Path(knobs.cache.dir)
    record = cache / INSTALLED
    installed = set(json.loads(record.read_text())) if record.exists() else set()
    kernels = Counter(
        group.name.removeprefix("__grp__").removesuffix(".json")
        for folder in (cache.iterdir() if cache.is_dir() else ())
        if folder.is_dir() and folder.name not in installed
        for group in folder.glob("__grp__*.json")
    )
    listing = ", ".join(f"{name} {count}" for name, count in kernels.most_common())
    return (
        f"warm cache: {sum(kernels.values())} binaries compiled beyond the "
        f"{len(installed)} installed" + (f" ({listing})" if listing else "")
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        known = list(parts())
        names = argv[1:] or known
        unknown = set(names) - set(known)
        if unknown:
            print(
                f"warm_cache: no part {', '.join(sorted(unknown))} (parts: {' '.join(known)})",
                file=sys.stderr,
            )
            return 2
        count = build(names)
        print(f"warm_cache: {count} binaries in {ARCHIVE} ({ARCHIVE.stat().st_size >> 20} MiB)")
        return 0
    if argv[:1] == ["install"] and len(argv) <= 2:
        print(install(Path(argv[1]) if len(argv) == 2 else ARCHIVE))
        return 0
    if argv == ["misses"]:
        print(misses())
        return 0
    print("usage: warm_cache.py build [PART ...] | install [ARCHIVE] | misses", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
