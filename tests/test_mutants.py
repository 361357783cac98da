"""bench/mutants.py's list stays applicable: each mutant changes exactly one place of
its file, and names test files that exist (the run itself takes some two hours: a
tool for a session, not CI)."""

from pathlib import Path

from tests.bench_scripts import load

mutants = load("mutants")


def test_every_listed_mutant_applies_once_and_names_its_tests():
    listed = mutants.mutants()
    assert len(listed) > 100
    for mutant in listed:
        assert mutants.applied(mutant) != (mutants.REPO / mutant.file).read_text()
        assert mutant.tests and all((mutants.REPO / t).is_file() for t in mutant.tests)


def test_a_mutant_is_applied_only_while_its_tests_run(tmp_path, monkeypatch):
    # Its file restored afterwards, also where the run raises.
    target = tmp_path / "module.py"
    target.write_text("x = 1\n")
    monkeypatch.setattr(mutants, "REPO", tmp_path)
    seen = []

    def run(command, **kwargs):
        seen.append(target.read_text())
        raise KeyboardInterrupt

    monkeypatch.setattr(mutants.subprocess, "run", run)
    mutant = mutants.Mutant("module.py", "x = 1", "x = 2", ["tests/test_x.py"])
    try:
        mutants.killed(mutant)
    except KeyboardInterrupt:
        pass
    assert seen == ["x = 2\n"] and target.read_text() == "x = 1\n"
    assert Path(mutants.LIST).is_file()
