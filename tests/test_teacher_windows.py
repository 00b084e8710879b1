"""Each teacher preset's window and stride: the documented rule (the stride is half the window
unless set) holds for any ``teacher.window``, and every preset's own default is what it was, so
folders scored before keep their identity."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import stages.score_teacher  # noqa: F401  (registers the defaults the YAML overrides)

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
PRESETS = sorted(p.stem for p in (CONF / "teacher").glob("*.yaml"))
# (window, stride) each preset pinned before the stride became half the window by default:
# the 7B teachers 4096 and 2048, the tiny teacher its own 512 positions and 384; SmolLM2-135M, added
# later, 2048 and 1024 (its training context, half of it as stride).
BEFORE = {"tiny": (None, 384), "smollm2-135m": (2048, 1024),
          **{p: (4096, 2048) for p in PRESETS if p not in ("tiny", "smollm2-135m")}}


def job(*overrides: str):
    from stages.score_teacher import job_config

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return job_config(compose(config_name="score_teacher", overrides=list(overrides)))


def planned(teacher, positions: int) -> tuple[int, int]:
    """The window and stride stage 1 scores with (docs/configuration.md): the window, else the
    model's positions; the stride, else half the window."""
    window = teacher.window or positions
    return window, teacher.stride or window // 2


@pytest.mark.parametrize("preset", PRESETS)
def test_every_presets_own_window_and_stride_are_unchanged(preset):
    window, stride = BEFORE[preset]
    assert planned(job(f"teacher={preset}").teacher, positions=512) == (window or 512, stride)


@pytest.mark.parametrize("preset", PRESETS)
def test_another_window_takes_half_of_it_unless_the_stride_is_set(preset):
    assert planned(job(f"teacher={preset}", "teacher.window=256").teacher, positions=4096) == (256, 128)
    assert planned(job(f"teacher={preset}", "teacher.window=256", "teacher.stride=200").teacher, 4096) == (256, 200)
    own = BEFORE[preset][0] or 512
    assert planned(job(f"teacher={preset}", f"teacher.window={own}").teacher, positions=own) == (own, BEFORE[preset][1])


def test_the_first_example_of_the_configuration_page_passes_the_checks(tmp_path):
    """``make score-teacher ARGS="teacher=deepseekmath-7b teacher.window=2048"``: offline, it stops
    where the 7B teacher cannot be had, not at the stride."""
    example = next(line for line in (REPO / "docs" / "configuration.md").read_text().splitlines()
                   if line.startswith("make score-teacher ARGS="))
    args = example.split('ARGS="', 1)[1].split('"', 1)[0].split()
    assert args == ["teacher=deepseekmath-7b", "teacher.window=2048"]
    res = subprocess.run([sys.executable, "-m", "stages.score_teacher", *args, f"output_root={tmp_path}/scored",
                          f"hydra.run.dir={tmp_path}/logs"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "VOCAGNO_TRACEBACK": ""})
    assert res.returncode == 2, res.stderr[-3000:]
    assert "stride" not in res.stderr and "deepseek-ai/deepseek-math-7b-base" in res.stderr, res.stderr
    assert not (tmp_path / "scored").exists()
