"""Every config in conf/ composes, and the stage turns it into a valid typed job config."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[1] / "conf"


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
    assert job.scorer.backend in ("transformers", "vllm")


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


def test_all_config_problems_are_reported_at_once():
    from stages.common import ConfigError
    from stages.score_teacher import job_config

    cfg = _compose("score_teacher", ["+scorer.typo_key=1", "+pool.other_typo=2", "scorer.backend=onnx"])
    with pytest.raises(ConfigError) as err:
        job_config(cfg)
    message = str(err.value)
    assert "scorer.typo_key" in message and "pool.other_typo" in message


def test_every_primary_config_composes():
    """Primary configs of other stages compose with their defaults too."""
    for primary in sorted(p.stem for p in CONF.glob("*.yaml")):
        cfg = _compose(primary, [])
        assert OmegaConf.to_container(cfg, resolve=False)
