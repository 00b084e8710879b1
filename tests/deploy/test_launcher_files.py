"""The Slurm launchers without a Slurm (in the default suite): both are valid bash, and every
setting docs/configuration.md lists for them is one of the settings at the top of the file it names,
read from the environment with its documented default. ``test_slurm.py`` runs them on a real Slurm."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCHERS = REPO / "deploy" / "slurm"
FILES = {"score-teacher": LAUNCHERS / "score-teacher.sbatch", "train-student": LAUNCHERS / "train-student.sbatch"}


def documented_settings() -> list[tuple[str, str, str]]:
    """(variable, file, default) for each variable of the launchers' table in configuration.md."""
    text = (REPO / "docs" / "configuration.md").read_text()
    table = text[text.index("## The Slurm launchers"):]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            names = re.findall(r"`([A-Z_]+)`", cells[0])
            defaults = re.findall(r"`([^`]*)`", cells[2]) or [""] * len(names)
            files = list(FILES) if cells[1] == "both" else [cells[1]]
            rows += [(name, f, default) for name, default in zip(names, defaults) for f in files]
    return rows


@pytest.mark.parametrize("name", sorted(FILES))
def test_launchers_are_valid_bash(name):
    proc = subprocess.run(["bash", "-n", str(FILES[name])], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_documented_setting_is_at_the_top_of_its_file_with_its_default():
    rows = documented_settings()
    assert {name for name, _, _ in rows} >= {"TEACHER", "DATA", "OUTPUT_ROOT", "EXPERIMENT", "VENV", "RAY_PORT"}
    for name, file, default in rows:
        top = FILES[file].read_text().split("\nset -euo pipefail")[0]
        found = re.search(rf"^{name}=\$\{{{name}:?-([^}}]*)\}}", top, re.M)
        assert found, f"{name} is not a setting at the top of {FILES[file].name}"
        if default:
            assert found.group(1) == default, f"{FILES[file].name}: {name} defaults to {found.group(1)!r}, documented {default!r}"
