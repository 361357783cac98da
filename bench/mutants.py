"""Mutants the test suite must kill: each a one-place change to the package (a check
dropped, a condition loosened, a rounding moved) that some test fails, listed with the
test files that fail it in ``bench/mutants.json``. A run applies each alone, runs its
tests, puts the file back, and reports KILLED or SURVIVED: a survivor is a behaviour
no test holds any more.

    python3 bench/mutants.py             # all of them (some two hours on 2 cores)
    python3 bench/mutants.py 3 17 40     # those, by index
    python3 bench/mutants.py --list      # index, file and change of each

The list holds what the suite kills, as of 2026-11-27 (``bench/NOTES.md``, thirteenth
to sixteenth sessions): mutants the interpreter cannot tell apart (an IEEE division
for an approximate one, a NaN-dropping maximum; the compile check,
``test_hopper_compile``, and a GPU's test run see those) and mutants that change
nothing observable are left out. Exit status 1 if any survived. The files are restored
whatever happens, from what they held before; run it on a clean tree (``git status``)
all the same, and nothing else on that tree meanwhile: tests run there would import
the mutant (a git worktree of its own, with ``mpgemm`` imported from it, keeps other
work apart)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
LIST = Path(__file__).with_name("mutants.json")


class Mutant(NamedTuple):
    file: str  # relative to the repository
    old: str  # occurs exactly once in the file
    new: str
    tests: list[str]  # test files, one of which must fail


def mutants() -> list[Mutant]:
    return [Mutant(**entry) for entry in json.loads(LIST.read_text())]


def applied(mutant: Mutant) -> str:
    """The mutated file's text. ValueError where ``old`` does not occur exactly once."""
    text = (REPO / mutant.file).read_text()
    if text.count(mutant.old) != 1:
        raise ValueError(
            f"{mutant.file}: {mutant.old!r} occurs {text.count(mutant.old)} times, not once"
        )
    return text.replace(mutant.old, mutant.new)


def killed(mutant: Mutant) -> tuple[bool, str]:
    """Whether a test of ``mutant.tests`` fails with the mutant applied, and pytest's
    last line."""
    path = REPO / mutant.file
    original = path.read_text()
    path.write_text(applied(mutant))
    try:
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "2", "-p", "no:cacheprovider"]
        run = subprocess.run(
            [*command, *mutant.tests], cwd=REPO, capture_output=True, text=True, timeout=1800
        )
    finally:
        path.write_text(original)
    last = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    return run.returncode != 0, last


def _change(mutant: Mutant) -> str:
    return f"{mutant.file}: {mutant.old.strip()[:60]!r} -> {mutant.new.strip()[:60]!r}"


def main() -> None:
    listed = mutants()
    if "--list" in sys.argv:
        for index, mutant in enumerate(listed):
            print(f"{index:3d} {_change(mutant)}")
        return
    chosen = [int(a) for a in sys.argv[1:]] or list(range(len(listed)))
    survivors = []
    for index in chosen:
        start = time.time()
        dead, last = killed(listed[index])
        verdict = "KILLED" if dead else "SURVIVED"
        print(
            f"[{index}] {verdict} {time.time() - start:.0f}s {_change(listed[index])} | {last}",
            flush=True,
        )
        if not dead:
            survivors.append(index)
    print(f"{len(chosen) - len(survivors)} of {len(chosen)} killed; survivors: {survivors}")
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()
