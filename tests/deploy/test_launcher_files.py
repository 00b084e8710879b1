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


def header_settings(name: str, **env: str) -> dict[str, str]:
    """The variables at the top of a launcher (everything before ``set -euo pipefail``) as bash
    evaluates them in the environment ``env`` (nothing else inherited)."""
    top = FILES[name].read_text().split("\nset -euo pipefail")[0]
    names = sorted(set(re.findall(r"^([A-Z_]+)=\$\{", top, re.M)))
    script = top + "\n" + "".join(f'printf "%s=%s\\n" {n} "${n}"\n' for n in names)
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env},
                          check=True)
    return dict(line.split("=", 1) for line in proc.stdout.splitlines())


@pytest.mark.parametrize("name", sorted(FILES))
def test_large_outputs_and_the_hub_cache_go_to_scratch_not_home(name):
    """Where the site sets SCRATCH, every default folder that grows (scored data, runs, logs, the
    Hugging Face cache) is under it, none under $HOME; without it the defaults are the checkout's
    outputs/ and Hugging Face's own cache folder, as before."""
    home, submit = "/home/u", "/home/u/vocagno"
    grows = {"score-teacher": ["OUTPUT_ROOT", "LOG_DIR", "HF_HOME"],
             "train-student": ["SCORED_ROOT", "STUDENT_ROOT", "LOG_DIR", "HF_HOME"]}[name]
    on_scratch = header_settings(name, HOME=home, SLURM_SUBMIT_DIR=submit, SCRATCH="/scratch/u")
    for var in grows:
        assert on_scratch[var].startswith("/scratch/u/"), f"{name}: {var}={on_scratch[var]} with SCRATCH set"
    assert on_scratch["HF_HUB_OFFLINE"] == "0"
    plain = header_settings(name, HOME=home, SLURM_SUBMIT_DIR=submit)
    assert plain["HF_HOME"] == f"{home}/.cache/huggingface"  # huggingface_hub's own default
    assert all(plain[var].startswith("outputs/") for var in grows if var != "HF_HOME")
    chosen = header_settings(name, HOME=home, SLURM_SUBMIT_DIR=submit, SCRATCH="/scratch/u", HF_HOME="/data/hf",
                             HF_HUB_OFFLINE="1", OUTPUTS="/lustre/me")
    assert (chosen["HF_HOME"], chosen["HF_HUB_OFFLINE"]) == ("/data/hf", "1")
    assert all(chosen[var].startswith("/lustre/me/") for var in grows if var != "HF_HOME")


@pytest.mark.parametrize("name", sorted(FILES))
def test_memory_the_hub_settings_and_the_gpus_of_each_step_are_stated(name):
    text = FILES[name].read_text()
    assert re.search(r"^#SBATCH --mem(-per-gpu|-per-cpu)?=\S+", text, re.M), f"{name}: no #SBATCH --mem"
    exports = " ".join(re.findall(r"^export (.*)$", text, re.M)).split()
    assert {"HF_HOME", "HF_HUB_OFFLINE"} <= set(exports), f"{name}: HF_HOME and HF_HUB_OFFLINE are not exported"
    # every srun step asks for the node's GPUs (an empty list on CPUs), so what it sees is not left
    # to the site's defaults
    assert re.search(r'^\s*if \(\((RAY_NODE_GPUS|gpus) > 0\)\); then step_gpus=\(--gpus-per-node="\$\1"\); fi$', text, re.M)
    steps = re.findall(r"^\s*srun (.*)$", text.replace("\\\n", " "), re.M)  # continuation lines joined
    assert steps and all('"${step_gpus[@]}"' in step for step in steps), f"{name}: an srun step without the node's GPUs"
