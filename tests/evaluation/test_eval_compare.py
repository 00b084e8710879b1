"""``make compare``: real evaluation results side by side, refusing runs that are not comparable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.evaluation.compare import compare, load_result, markdown_table, write_comparison
from pipeline.evaluation.run import run_evaluation
from test_eval_student import build_chain_model, chain_job, write_tasks

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two checkpoints evaluated on the same problems, and one on fewer problems."""
    root = tmp_path_factory.mktemp("compare")
    tasks = write_tasks(root / "tasks")
    long_model = build_chain_model(root / "long")
    short_model = build_chain_model(root / "short", context=16)  # its prompts are cut: it fails more
    out = {}
    for name, model, limit in (("long", long_model, None), ("short", short_model, None), ("fewer", long_model, 3)):
        run_evaluation(chain_job(model, tasks, root / "eval" / name, limit=limit, label=name))
        out[name] = root / "eval" / name
    return out


def test_side_by_side_table(runs):
    results = [load_result(runs["long"]), load_result(runs["short"])]
    c = compare(results, ["long", "short"], [str(runs["long"]), str(runs["short"])])
    assert c.tasks == ["gsm8k", "math"] and not c.mismatches
    assert c.cells["gsm8k"]["long"] == {"accuracy": 0.5, "correct": 3, "n": 6}
    assert c.cells["gsm8k"]["short"]["correct"] == results[1]["tasks"]["gsm8k"]["correct"]
    table = markdown_table(c)
    assert "| task | long | short |" in table and "| gsm8k | 50.0 (3/6) |" in table
    assert "| mean |" in table


def test_runs_on_different_problems_are_refused_or_flagged(runs, tmp_path):
    results = [load_result(runs["long"]), load_result(runs["fewer"])]
    with pytest.raises(ValueError, match=r"gsm8k: fewer vs long: n: 3 != 6"):
        compare(results, ["long", "fewer"], ["a", "b"])
    c = compare(results, ["long", "fewer"], ["a", "b"], allow_mismatch=True)
    assert set(c.mismatches) == {"gsm8k"}  # math has 3 problems: limit=3 changes nothing there
    table = markdown_table(c)
    assert "50.0* (3/6)" in table and "not comparable" in table
    paths = write_comparison(c, tmp_path)
    assert [p.name for p in paths] == ["compare.md", "compare.json", "compare.png"]
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths[1].read_text())["mismatches"]["gsm8k"]


def test_compare_stage(runs, tmp_path):
    out = tmp_path / "cmp"
    ok = subprocess.run([sys.executable, "-m", "stages.compare_evals", f"runs=[{runs['long']},{runs['short']}]",
                         "labels=[base,guided]", f"out_dir={out}", f"hydra.run.dir={tmp_path / 'logs'}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "| task | base | guided |" in ok.stdout and (out / "compare.png").is_file()
    assert (out / "compare.md").read_text() in ok.stdout


def test_numbers_as_labels_are_labels(runs, tmp_path):
    """``labels=[1,2]``: the command line reads numbers; they label the runs as written (it was
    refused: ``labels: [1, 2] is not a list of a string or null``)."""
    ok = subprocess.run([sys.executable, "-m", "stages.compare_evals", f"runs=[{runs['long']},{runs['short']}]",
                         "labels=[1,2.5]", f"out_dir={tmp_path / 'cmp'}", f"hydra.run.dir={tmp_path / 'logs'}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "| task | 1 | 2.5 |" in ok.stdout


def test_compare_refusals_are_one_line(runs, tmp_path):
    refused = subprocess.run([sys.executable, "-m", "stages.compare_evals", f"runs=[{runs['long']},{runs['fewer']},{tmp_path}]",
                              "labels=[a,b]", f"hydra.run.dir={tmp_path / 'logs'}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "labels: 2 labels for 3 runs" in refused.stderr
    with pytest.raises(FileNotFoundError, match="eval.json: not found"):
        load_result(tmp_path)
    with pytest.raises(ValueError, match="labels must differ"):
        compare([load_result(runs["long"])] * 2, ["a", "a"], ["x", "y"])
