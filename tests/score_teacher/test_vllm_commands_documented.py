"""The documented vLLM commands (docs/gpus-and-vllm.md, the README) run after the quick start as
written: a dataset scored by vLLM is another dataset (the backend and its window are in the
identity), so each command names a folder of its own, never the one the same command scores with
transformers, where it would be refused. The reference is Hydra's own composition of each command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from hydra import compose, initialize_config_dir

import stages.score_teacher  # noqa: F401  (registers the defaults and the dataset_dir resolver)

REPO = Path(__file__).resolve().parents[2]


def vllm_commands() -> list[list[str]]:
    """The overrides of every documented vLLM scoring command."""
    text = (REPO / "docs" / "gpus-and-vllm.md").read_text().replace("\\\n", " ")
    commands = re.findall(r"\.venv-vllm/bin/python -m stages\.score_teacher ([^\n]*)", text)
    found = [shlex.split(m.split("#")[0]) for m in commands]
    readme = re.search(r"then `(scorer\.backend=vllm[^`]*)`", (REPO / "README.md").read_text())
    return found + [shlex.split(readme.group(1))]


def output_dir(overrides: list[str]) -> str:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return str(compose("score_teacher", overrides=overrides).output_dir)


def test_each_documented_vllm_command_scores_into_a_folder_of_its_own():
    commands = vllm_commands()
    assert len(commands) == 3 and all("scorer.backend=vllm" in c for c in commands), commands
    quick_start = output_dir([])
    for command in commands:
        with_transformers = output_dir([o for o in command if o != "scorer.backend=vllm"
                                        and not o.startswith(("output_root=", "output_dir="))])
        assert output_dir(command) not in (with_transformers, quick_start), command
