"""Replacing an output folder loses nothing (pipeline.folders.output_folder), on real folders in tmp_path.

The reference is always the folder as it was, read back byte for byte before anything ran: a
restore, and a recovery from a process killed at each step of a replacement, must give it back
exactly; a commit must leave exactly the new run's entries and the files that were never the run's.
The killed states are built by hand, with plain renames, as a kill at that step leaves them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from pipeline.folders.output_folder import overlap_problem, recover, set_aside


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256 of its bytes), the lock included."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def owned(path: Path) -> bool:  # a run folder's own entries, as a stage would name them
    return path.name.startswith("checkpoint-") or path.name in ("final", "metrics.jsonl", "runs")


def old_run(folder: Path) -> dict[str, str]:
    for name, text in {"checkpoint-2/weights": "w2", "checkpoint-4/weights": "w4", "final/model": "final",
                       "metrics.jsonl": "old metrics\n", "runs/events": "tb", "notes.txt": "mine", ".lock": ""}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return tree(folder)


def new_run(folder: Path) -> None:
    (folder / "checkpoint-1").mkdir()
    (folder / "checkpoint-1" / "weights").write_text("new w1")
    (folder / "metrics.jsonl").write_text("new metrics\n")


def test_restore_gives_back_the_folder_exactly_and_commit_keeps_only_the_new_run(tmp_path):
    before = old_run(tmp_path)
    aside = set_aside(tmp_path, owned)
    visible = {p.name for p in tmp_path.iterdir() if not p.name.startswith(".replaced-")}
    assert visible == {"notes.txt", ".lock"}, "the run's entries are out of the way, the rest untouched"
    new_run(tmp_path)
    aside.restore()
    assert tree(tmp_path) == before

    aside = set_aside(tmp_path, owned)
    new_run(tmp_path)
    aside.commit()
    assert tree(tmp_path) == {"notes.txt": before["notes.txt"], ".lock": before[".lock"],
                              "metrics.jsonl": hashlib.sha256(b"new metrics\n").hexdigest(),
                              "checkpoint-1/weights": hashlib.sha256(b"new w1").hexdigest()}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [".lock"]


def test_nothing_to_set_aside_is_a_no_op(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    aside = set_aside(tmp_path, owned)
    assert aside.aside is None
    aside.commit()
    aside.restore()
    assert tree(tmp_path) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}


@pytest.mark.parametrize("killed", ["while moving aside", "before committing", "while putting back",
                                    "while deleting"])
def test_a_kill_at_any_step_is_finished_by_the_next_run(tmp_path, killed):
    before = old_run(tmp_path)
    entries = sorted(p.name for p in tmp_path.iterdir() if owned(p))
    if killed == "while moving aside":  # two of the five entries moved, nothing new written yet
        moving = tmp_path / ".replacing-0123"
        moving.mkdir()
        for name in entries[:2]:
            os.replace(tmp_path / name, moving / name)
    elif killed == "before committing":  # the new run wrote its first entries, then died
        set_aside(tmp_path, owned)
        new_run(tmp_path)
    elif killed == "while putting back":  # the new entries deleted, two old ones moved back
        aside = set_aside(tmp_path, owned).aside
        restoring = aside.with_name(".restoring-" + aside.name.split("-", 1)[1])
        os.replace(aside, restoring)
        for name in entries[:2]:
            os.replace(restoring / name, tmp_path / name)
    else:  # committed: the old entries were being deleted
        set_aside(tmp_path, owned).commit()
        new_run(tmp_path)
        after = tree(tmp_path)
        doomed = tmp_path / ".deleting-0123"
        (doomed / "checkpoint-2").mkdir(parents=True)
        (doomed / "checkpoint-2" / "weights").write_text("w2")
        assert recover(tmp_path, owned) == []
        assert tree(tmp_path) == after
        return
    restored = recover(tmp_path, owned)
    assert tree(tmp_path) == before
    assert set(restored) <= set(entries) and restored
    assert recover(tmp_path, owned) == [], "a second recovery finds nothing to do"


def test_an_output_folder_that_is_holds_or_lies_in_an_input_is_named(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "copyrun"
    (run / "final").mkdir(parents=True)
    (tmp_path / "link").symlink_to(run)
    inputs = {"student.model": run / "final", "student.tokenizer": None, "data.folders[0]": "org/not-a-path"}
    assert overlap_problem(run, inputs) == \
        f"output_dir {run} holds student.model ({run / 'final'}), an input of this run"
    assert "output_dir" in overlap_problem(tmp_path / "link" / "final", inputs)  # the same folder through a link
    assert " is student.model " in overlap_problem(tmp_path / "link" / "final", inputs)
    assert " lies inside student.model " in overlap_problem(run / "final" / "sub", inputs)
    assert overlap_problem(run / "final" / "sub", inputs, inside_ok=True) is None
    assert overlap_problem(tmp_path / "runs" / "other", inputs) is None
    assert overlap_problem(tmp_path / "runs" / "copy", inputs) is None, "a name that only starts alike"
    assert overlap_problem(run / "fin", inputs) is None
    monkeypatch.setenv("HOME", str(tmp_path))
    assert " holds student.model " in overlap_problem("~/runs", inputs)
    assert overlap_problem("s3://bucket/a", [("data.folders[0]", "s3://bucket/a/v1")]) == \
        "output_dir s3://bucket/a holds data.folders[0] (s3://bucket/a/v1), an input of this run"
