"""Results of different evaluations never replace each other: a bits-per-byte result, then a GSM8K
run of the same checkpoint into the same folder (the default, named after the checkpoint) is
refused through the real command line before any model loads, and the first result stays byte for
byte; ``overwrite=true`` replaces it only once the new result is written."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.evaluation.held_out import HeldOutText
from pipeline.evaluation.run import ResultExistsError, run_evaluation
from test_eval_student import GSM8K, build_chain_model, chain_job, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    return build_chain_model(tmp_path_factory.mktemp("chain") / "model")


def test_a_result_of_other_settings_is_kept_and_the_refusal_is_one_line(chain, tmp_path):
    tasks = write_jsonl(tmp_path / "tasks" / "gsm8k.jsonl", GSM8K)
    text = tmp_path / "held-out.txt"
    text.write_text("The answer is 42 . Q: The answer is 42 .")
    out = tmp_path / "eval" / "model"  # what the stage names a result of this checkpoint by default
    bpb = chain_job(chain, tasks.parent, out, tasks=(), bits_per_byte=HeldOutText(text_files=(str(text),), batch_size=2))
    first = run_evaluation(bpb)
    assert "bits_per_byte" in first and first["tasks"] == {}
    before = files(out)

    result = subprocess.run(
        [sys.executable, "-m", "stages.eval_student", f"checkpoint={chain}", "tasks=[gsm8k]", f"data_files.gsm8k={tasks}",
         "num_fewshot=0", "generation.max_new_tokens=4", "generation.cpu_threads=1", f"eval_root={tmp_path / 'eval'}",
         f"hydra.run.dir={tmp_path / 'logs'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    for words in (f"error: {out} holds the result of another evaluation", "tasks.gsm8k", "label=<a name>",
                  "overwrite=true to replace that one's eval.json, eval.md and samples.jsonl once this result is written"):
        assert words in lines[0], lines[0]
    assert files(out) == before, "the first result is untouched"

    gsm = chain_job(chain, tasks.parent, out, tasks=("gsm8k",), num_fewshot=0)
    with pytest.raises(ResultExistsError):
        run_evaluation(gsm)
    rerun = run_evaluation(bpb)  # the same request again: its own result is redone in place
    assert rerun["bits_per_byte"]["bits_per_byte"] == first["bits_per_byte"]["bits_per_byte"]
    replaced = run_evaluation(replace(gsm, overwrite=True))
    assert json.loads((out / "eval.json").read_text())["tasks"]["gsm8k"]["n"] == replaced["tasks"]["gsm8k"]["n"] == 6
    assert "bits_per_byte" not in json.loads((out / "eval.json").read_text())


def test_an_output_folder_inside_the_checkpoint_is_refused(chain, tmp_path):
    from stages.common import ConfigError
    from stages.common import override_problems, CONF_DIR
    from stages.eval_student import job_config

    tasks = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    _, cfg, _ = override_problems(CONF_DIR, "eval_student", [f"checkpoint={chain}", f"data_files.gsm8k={tasks}",
                                                             f"out_dir={chain}/eval"])
    with pytest.raises(ConfigError, match=rf"out_dir {chain}/eval lies inside checkpoint \({chain}\)"):
        job_config(cfg)
