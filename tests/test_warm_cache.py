"""bench/warm_cache.py, the GPU's triton cache built here: binaries compiled for sm_90a
under one triton build (``build``), packed, and installed under the keys another build
of the same version computes, are what that build's compiles then find (every one a
cache hit); the parts it builds are the session's stages and the graph part;
an archive of another triton version or backend installs nothing; the binaries compiled
beyond those installed are counted by kernel."""

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.bench_scripts import load

ROOT = Path(__file__).resolve().parents[1]
warm_cache = load("warm_cache")

# A GEMM (one tile: MPGEMM_SINGLE_CONFIG) and the unscale's kernel, each launch compiled
# for sm_90a instead of run.
WORKLOAD = (
    "import torch, mpgemm\n"
    "from mpgemm.scaling import unscale_\n"
    "a = torch.empty(64, 128, dtype=torch.float16)\n"
    "mpgemm.matmul(a, torch.empty(128, 32, dtype=torch.float16))\n"
    "unscale_([torch.empty(40), torch.empty(24)], torch.zeros(()), torch.ones(()))\n"
)

# On the "device": another triton build of the same version, whose triton_key differs
# (as a Python 3.12 build's does from a 3.11 one's), installs the archive, then compiles
# the same launches with every compile's cache hit or miss recorded.
DEVICE = """
import json, sys
import triton.runtime.cache as cache
from triton import knobs

own = cache.triton_key()
cache.triton_key = lambda: "another build of the same version " + own
sys.path.insert(0, {bench!r})
import warm_cache

warm_cache.triton_key = cache.triton_key
print(warm_cache.install(warm_cache.Path({archive!r}), warm_cache.HOPPER))
hits = []
knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
from mpgemm.kernels.launches import compile_for_hopper, intercept

with intercept(compile_for_hopper):
    exec({workload!r})
print(json.dumps(hits))
print(warm_cache.misses())
"""


def test_the_parts_are_the_stages_tests_first_and_the_graph_part():
    names = list(warm_cache.parts())
    assert names[0] == "tests"
    assert sorted(names) == sorted([*warm_cache._gpu_check().STAGES, "graph"])


def _python(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**base, "CUDA_VISIBLE_DEVICES": "", "MPGEMM_SINGLE_CONFIG": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def test_a_cache_built_here_is_what_another_builds_compiles_find(tmp_path, monkeypatch):
    archive, device = tmp_path / "warm.tar.xz", tmp_path / "device"
    # build, on a part of one command: the workload, each launch compiled for sm_90a.
    command = warm_cache._gpu_check().Command(
        [sys.executable, "-c", WORKLOAD], "tiny.log", {"MPGEMM_SINGLE_CONFIG": "1"}
    )
    monkeypatch.setattr(warm_cache, "parts", lambda: {"tiny": ([command], True)})
    built = []
    pack = warm_cache.pack
    monkeypatch.setattr(
        warm_cache,
        "pack",
        lambda cache, keys, out: built.extend(cache.iterdir()) or pack(cache, keys, out),
    )
    packed = warm_cache.build(["tiny"], archive)
    assert packed == 2  # the GEMM's binary and the unscale's
    assert (tmp_path / "build-tiny-0.log").exists()
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
        names = tar.getnames()
    kept = sorted(f for b in manifest["binaries"] for f in b["files"])
    assert {Path(f).suffix for f in kept} == {".json", ".cubin", ".ptx"}  # no IRs
    assert len(names) == len(kept) + 1
    code = DEVICE.format(bench=str(ROOT / "bench"), archive=str(archive), workload=WORKLOAD)
    lines = _python(code, TRITON_CACHE_DIR=str(device)).stdout.splitlines()
    assert lines[0].startswith("warm cache: 2 binaries installed in ")
    # Installed under other keys than the build's, and every compile found its binary.
    installed = json.loads((device / warm_cache.INSTALLED).read_text())
    assert len(installed) == 2 and not set(installed) & {p.name for p in built}
    assert json.loads(lines[1]) == [True, True]
    assert lines[2] == "warm cache: 0 binaries compiled beyond the 2 installed"


def _archive(path: Path, **manifest) -> Path:
    data = json.dumps({"binaries": [], **manifest}).encode()
    with tarfile.open(path, "w:xz") as tar:
        info = tarfile.TarInfo(warm_cache.MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("differs", ["triton", "backend"])
def test_an_archive_of_another_triton_or_backend_installs_nothing(tmp_path, monkeypatch, differs):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    manifest = {
        "triton": warm_cache.triton.__version__,
        "backend": warm_cache.backend_hash(warm_cache.HOPPER),
    }
    manifest[differs] = (
        "ptxas: Cuda compilation tools, V11.0.1-80" if differs == "backend" else "0.1"
    )
    archive = _archive(tmp_path / "warm.tar.xz", **manifest)
    said = warm_cache.install(archive, warm_cache.HOPPER)
    assert said.startswith("warm cache not installed: built ")
    assert ("ptxas 11.0.1, arch 80" in said) if differs == "backend" else ("triton 0.1" in said)
    assert not (tmp_path / "cache").exists()


def test_without_a_gpu_the_session_says_so_and_installs_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    said = warm_cache.install(_archive(tmp_path / "warm.tar.xz", triton="?", backend="?"))
    assert said.startswith("warm cache not installed: no GPU target here")


def test_misses_counts_the_binaries_beyond_those_installed_by_kernel(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    for folder, kernel in (("A", "_gemm_kernel"), ("B", "_gemm_kernel"), ("C", "_adam_kernel")):
        (cache / folder).mkdir(parents=True)
        (cache / folder / f"__grp__{kernel}.json").write_text("{}")
    (cache / "D").mkdir()  # (a launcher's folder: no group)
    (cache / warm_cache.INSTALLED).write_text(json.dumps(["C"]))
    assert warm_cache.misses() == (
        "warm cache: 2 binaries compiled beyond the 1 installed (_gemm_kernel 2)"
    )
