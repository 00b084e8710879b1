"""Every config in conf/ composes, the stage turns it into a valid typed job config, and every
problem of a bad config is reported, each one, in one message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

import stages.score_teacher  # noqa: F401  (each registers the defaults its YAML overrides)
import stages.train_student  # noqa: F401
import stages.convert_teacher  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(primary: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=primary, overrides=overrides)


@pytest.mark.parametrize("teacher", _options("teacher"))
@pytest.mark.parametrize("data", _options("data"))
@pytest.mark.parametrize("ray", _options("ray"))
def test_score_teacher_configs_compose_and_validate(teacher, data, ray):
    from stages.score_teacher import job_config

    cfg = _compose("score_teacher", [f"teacher={teacher}", f"data={data}", f"ray={ray}"])
    OmegaConf.resolve(cfg)  # every interpolation resolves
    job = job_config(cfg)
    assert job.teacher.name == teacher and job.corpus.name == cfg.data.name
    assert job.output_dir.endswith(f"{cfg.data.name}/{teacher}/v1")
    assert job.scorer.backend in ("transformers", "vllm", "rehearsal")


def test_paper_teachers_are_the_papers_hub_models():
    models = {t: _compose("score_teacher", [f"teacher={t}"]).teacher.model for t in _options("teacher")}
    assert models["qwen2.5-math-7b-instruct"] == "Qwen/Qwen2.5-Math-7B-Instruct"
    assert models["deepseekmath-7b"] == "deepseek-ai/deepseek-math-7b-base"
    assert models["mistral-proxmath-7b"] == "gair-prox/Mistral-7B-ProXMath"
    assert models["llemma-7b"] == "EleutherAI/llemma_7b"


def test_unknown_group_option_is_an_error():
    with pytest.raises(MissingConfigException):
        _compose("score_teacher", ["teacher=no-such-teacher"])


def test_unknown_key_is_an_error():
    with pytest.raises(ConfigCompositionException):
        _compose("score_teacher", ["scorer.no_such_key=1"])


STAGE1_ERRORS = [
    "+scorer.typo_key=1",                      # an unknown key in a group...
    "scorer.backend=onnx",                     # ...does not hide that group's bad choice
    "scorer.max_batch_tokens=lots",            # a value of the wrong type
    "+pool.other_typo=2",                      # an unknown key in another group
    "storage.encodings=tiny",                  # a bad choice in a third group
    "teacher=qwen2.5-math-7b-instruct", "teacher.model=./no-such-teacher",  # a local teacher that is not there
    "data=open-web-math", "data.source=files", "data.files=[/no/such/corpus/*.parquet]",  # a glob matching nothing
]
STAGE1_EXPECTED = [
    "scorer.typo_key: unknown key",
    "scorer.backend: 'onnx' is not one of transformers, vllm",
    "scorer.max_batch_tokens: 'lots' is not an integer",
    "pool.other_typo: unknown key",
    "storage.encodings: 'tiny' is not one of default, compact",
    "teacher.model: no such local file or folder: ./no-such-teacher",
    "data.files: corpus 'open-web-math': no file matches '/no/such/corpus/*.parquet'",
]


def test_all_stage1_config_problems_are_reported_at_once():
    from stages.common import ConfigError
    from stages.score_teacher import job_config

    with pytest.raises(ConfigError) as err:
        job_config(_compose("score_teacher", STAGE1_ERRORS))
    lines = str(err.value).splitlines()
    for expected in STAGE1_EXPECTED:
        assert any(expected in line for line in lines), (expected, lines)
    assert len(lines) == 1 + len(STAGE1_EXPECTED), lines  # the heading, then one line per problem


STAGE2_ERRORS = [
    "+loss.typo=1",                            # an unknown key in the loss group...
    "loss.mode=rho",                           # ...does not hide its bad choices (selection)
    "loss.aggregate=median",                   # (alignment: the one place the aggregation is checked)
    "loss.alignment=dtw",
    "loss.ratio=1.5",                          # a value out of range
    "+train.other_typo=2",
    "train.precision=fp8",
    "train.learning_rate=fast",                # a value of the wrong type
    "data.verify=md5",
    "data.folders=[/no/such/scored/v1]",       # a scored folder that is not there
    "student=tinyllama-1.1b", "student.model=./no-such-student",  # a local student that is not there
]
STAGE2_EXPECTED = [
    "loss.typo: unknown key",
    "loss.mode: 'rho' is not one of guided, cpt, random",
    "loss.aggregate: 'median' is not one of max, mean, min",
    "loss.alignment: 'dtw' is not one of token, chunk, one_to_one",
    "loss.ratio: 1.5 is not in (0, 1]",
    "train.other_typo: unknown key",
    "train.precision: 'fp8' is not one of auto, bf16, fp16, fp32",
    "train.learning_rate: 'fast' is not a number",
    "data.verify: 'md5' is not one of size, sha256",
    "data.folders: scored dataset folder not found: /no/such/scored/v1",
    "student.model: no such local file or folder: ./no-such-student",
]


def test_all_stage2_config_problems_are_reported_at_once():
    from stages.common import ConfigError
    from stages.train_student import job_config

    cfg = _compose("train_student", STAGE2_ERRORS)
    with pytest.raises(ConfigError) as err:
        job_config(cfg, check_files=True)
    lines = str(err.value).splitlines()
    for expected in STAGE2_EXPECTED:
        assert any(expected in line for line in lines), (expected, lines)
    assert len(lines) == 1 + len(STAGE2_EXPECTED), lines


@pytest.mark.parametrize("stage, errors, expected", [
    ("score_teacher", STAGE1_ERRORS, STAGE1_EXPECTED), ("train_student", STAGE2_ERRORS, STAGE2_EXPECTED)])
def test_a_stage_with_several_config_errors_exits_2_listing_each(stage, errors, expected, tmp_path):
    """The entry point itself: exit code 2, every problem on stderr, no traceback, nothing written."""
    assert_refused_before_any_work(stage, errors, expected, tmp_path)


def assert_refused_before_any_work(stage: str, args: list[str], expected: list[str], tmp_path: Path) -> None:
    """``python -m stages.<stage> <args>`` exits 2 with each ``expected`` line on stderr, no
    traceback nor Hydra's own error text, and creates neither output nor artifacts."""
    env = {**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", f"stages.{stage}", *args, f"hydra.run.dir={tmp_path}/logs",
                             f"artifacts_dir={tmp_path}/artifacts", f"output_dir={tmp_path}/out"],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Set the environment variable HYDRA_FULL_ERROR" not in result.stderr
    for line in expected:
        assert line in result.stderr, (line, result.stderr)
    assert not (tmp_path / "out").exists() and not (tmp_path / "artifacts").exists()


# Every primary config and the entry point that registers its defaults (one pattern for all).
ENTRY_POINTS = {"score_teacher": "stages.score_teacher", "train_student": "stages.train_student",
                "export_student": "stages.export_student",
                "convert_teacher": "stages.convert_teacher", "eval_student": "stages.eval_student",
                "compare_evals": "stages.compare_evals", "bench": "benchmarks.__main__", "gpu_bench": "benchmarks.gpu",
                "repro": "repro.__main__", "repro_real": "repro.warm", "repro_real_cold": "repro.real", "mutation": "mutation.__main__", "rehearse": "rehearsal.__main__"}


@pytest.mark.parametrize("primary", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_every_primary_config_composes_over_its_entry_points_defaults(primary):
    import importlib

    assert primary in ENTRY_POINTS, f"conf/{primary}.yaml has no entry point"
    module = importlib.import_module(ENTRY_POINTS[primary])
    assert hasattr(module.main, "check"), f"{ENTRY_POINTS[primary]}.main is not an entry_point"
    cfg = _compose(primary, [])
    assert OmegaConf.to_container(cfg, resolve=False)


# The first hour's mistakes, through the real command line: each ends before any work with the
# project's own message listing every problem, exit 2, no traceback, nothing written.
FIRST_HOUR = [
    ("score_teacher", ["teacher.windw=256"],
     ["teacher.windw: unknown key; did you mean teacher.window?"]),
    ("score_teacher", ["+teacher.windw=256"],
     ["teacher.windw: unknown key; did you mean window? (known: allow_bin, backend,"]),
    ("score_teacher", ["teacher=llama2-7b", "teachr.window=3"],
     ["teacher: 'llama2-7b' is not a preset; did you mean llemma-7b? (presets: deepseekmath-7b, llemma-7b,",
      "teachr.window: unknown key"]),
    ("score_teacher", ["teacher.stride=0", "scorer.max_batch_tokens=-1", "storage.encodings=tiny"],
     ["teacher.stride: 0 must be >= 1", "scorer.max_batch_tokens: -1 must be >= 1",
      "storage.encodings: 'tiny' is not one of default, compact"]),
    ("train_student", ["loss.ratio=1.5", "train.max_steps=-3"],
     ["loss.ratio: 1.5 is not in (0, 1]", "train.max_steps: -3 must be >= 1"]),
    ("train_student", ["+loss.ratoi=0.2"],
     ["loss.ratoi: unknown key; did you mean ratio? (known: aggregate, alignment, byte_fallback, combine, mode, "
      "n_chunks, "
      "rank_over, ratio, teacher_weights, unmapped)"]),
    ("train_student", ["student=tinyllama", "train.lerning_rate=1"],
     ["student: 'tinyllama' is not a preset; did you mean tinyllama-1.1b?", "train.lerning_rate: unknown key; "
      "did you mean train.learning_rate?"]),
]


@pytest.mark.parametrize("stage, args, expected", FIRST_HOUR)
def test_first_hour_mistakes_are_caught_before_any_work(stage, args, expected, tmp_path):
    assert_refused_before_any_work(stage, args, expected, tmp_path)


def test_a_window_the_teacher_has_no_positions_for_is_refused_before_scoring(micro_teacher, micro_corpus, tmp_path):
    """The micro teacher has 64 positions: window 100 is refused with the numbers, before any shard."""
    files = ",".join(str(f) for f in micro_corpus)
    env = {**os.environ, "VOCAGNO_TRACEBACK": "", "HF_HUB_OFFLINE": "1"}
    common = ["teacher.embedded=false", "teacher.name=micro", f"teacher.model={micro_teacher}", "data.embedded=false",
              "data.name=micro", f"data.files=[{files}]", f"output_dir={tmp_path}/out", f"hydra.run.dir={tmp_path}/logs"]
    for extra, want in ((["teacher.window=100", "teacher.stride=null"],
                         "teacher.window: 100 does not fit the 64 positions of"),
                        (["teacher.window=64", "teacher.stride=64"],
                         "teacher.stride: 64 must be < window (64)"),
                        (["teacher.window=null", "teacher.stride=100"],
                         "teacher.stride: 100 must be in [1, window - 1] = [1, 63]")):
        result = subprocess.run([sys.executable, "-m", "stages.score_teacher", *common, *extra], cwd=REPO,
                                capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 2 and want in result.stderr, (extra, result.stderr[-2000:])
        assert not list((tmp_path / "out").glob("shard-*")), "nothing scored"
