"""The mutation table applies to the tree as it is: every mutant's file exists, its snippet occurs
exactly once there and the mutated file compiles, and every test path it names exists (code moves;
the table must follow). The checker itself is tried on planted broken entries."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

from mutation.__main__ import REPO, Mutant, check_table, load_mutants, table_problems


def test_every_mutant_applies_to_the_tree():
    mutants = load_mutants()
    assert len(mutants) > 50
    problems = table_problems(mutants)
    assert problems == [], "mutation/mutants.toml no longer applies:\n" + "\n".join(f"{i}: {p}" for i, p in problems)


def test_planted_broken_entries_are_each_reported(tmp_path, capsys):
    (tmp_path / "mod.py").write_text("x = 1\nif x:\n    x = 1\n")
    (tmp_path / "test_mod.py").write_text("")
    good = Mutant(id="G", area="a", file="mod.py", original="if x:", replacement="if not x:",
                  tests=["test_mod.py::test_a"], what="w")
    planted = [
        good,
        replace(good, id="B1", original="if y:"),  # the snippet moved away
        replace(good, id="B2", original="x = 1"),  # twice
        replace(good, id="B3", replacement="if x"),  # the mutated file does not compile
        replace(good, id="B4", file="gone.py"),  # the file was renamed
        replace(good, id="B5", tests=["test_mod.py", "tests/old_place/test_x.py::test_y"]),  # a test moved
    ]
    problems = dict(table_problems(planted, tmp_path))
    assert set(problems) == {"B1", "B2", "B3", "B4", "B5"}
    assert "occurs 0 times" in problems["B1"] and "occurs 2 times" in problems["B2"]
    assert "does not compile" in problems["B3"] and "gone.py: no such file" in problems["B4"]
    assert problems["B5"] == "tests: tests/old_place/test_x.py::test_y does not exist: update the table"


def test_check_prints_each_problem_and_fails(monkeypatch, capsys):
    mutants = load_mutants()[:2]
    broken = replace(mutants[1], original=mutants[1].original + "  # not in the file")
    assert check_table(mutants) == 0
    assert check_table([mutants[0], broken]) == 1
    out = capsys.readouterr().out
    assert f"{broken.id}: {broken.file}: the original snippet occurs 0 times" in out and "2 mutants, 1 apply" in out


def test_unknown_mutant_ids_and_settings_are_refused_at_once(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mutation", "check=true", "only=[W1,NOPE]", "timeout=0",
                          f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "only: 'NOPE' is not a mutant id of mutants.toml" in run.stderr and "timeout: 0 must be > 0" in run.stderr
