"""``make help`` lists every target the Makefile declares, each with its line of explanation."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_make_help_lists_every_phony_target_with_a_line():
    makefile = (REPO / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    shown = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    listed = dict(re.findall(r"^  make (\S+)\s+(.+)$", shown, re.M))
    assert sorted(listed) == sorted(phony), "every .PHONY target, and only those, in make help"
    assert all(len(text) > 10 for text in listed.values())
    plain = subprocess.run(["make", "-s"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert plain == shown, "make alone shows the help"


def test_make_clean_keeps_scored_data_and_runs_and_clean_outputs_asks_first(tmp_path):
    """Run in a copy of the Makefile beside a stand-in outputs/ tree (nothing of the project touched)."""
    (tmp_path / "Makefile").write_text((REPO / "Makefile").read_text())
    kept = ["outputs/scored/owm-sample/tiny/v1/shard-000000.parquet", "outputs/students/owm-sample/run/final/config.json",
            "outputs/eval/run-final/eval.json"]
    rebuilt = ["outputs/logs/train_student/x/train_student.log", "outputs/cache/student-lengths/a.json", ".pytest_cache/v"]
    for name in kept + rebuilt:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    subprocess.run(["make", "-s", "clean"], cwd=tmp_path, check=True, capture_output=True)
    assert all((tmp_path / n).exists() for n in kept) and not any((tmp_path / n).exists() for n in rebuilt)

    refused = subprocess.run(["make", "-s", "clean-outputs"], cwd=tmp_path, capture_output=True, text=True,
                             stdin=subprocess.DEVNULL)
    assert refused.returncode != 0 and "kept outputs/" in refused.stdout, refused.stdout + refused.stderr
    assert "outputs/scored" in refused.stdout, "it lists what it would delete"
    assert all((tmp_path / n).exists() for n in kept)
    subprocess.run(["make", "-s", "clean-outputs", "CONFIRM=yes"], cwd=tmp_path, check=True, capture_output=True)
    assert not (tmp_path / "outputs").exists()
