"""``python -m stages.convert_teacher teacher=<name>`` (``make convert-teacher``): write a
safetensors copy of a teacher whose checkpoint ships only pickle (``.bin``) weights, read once with
``torch.load(weights_only=True)``; then score with ``teacher.model=<that folder>``.
Configuration: ``conf/convert_teacher.yaml``.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import hydra
from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from pipeline.score_teacher.teacher_source import check_teacher_source, convert_to_safetensors
from stages.common import exit_on_user_error, plain, quiet_libraries


@hydra.main(version_base="1.3", config_path="../conf", config_name="convert_teacher")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    quiet_libraries()
    check_teacher_source(SimpleNamespace(**{**plain(cfg, "teacher"), "allow_bin": True}))
    out = convert_to_safetensors(cfg.teacher.model, to_absolute_path(cfg.out_dir), revision=cfg.teacher.revision,
                                 trust_remote_code=bool(cfg.teacher.trust_remote_code))
    print(f"safetensors copy of {cfg.teacher.model} written to {out}")
    print(f'score with: make score-teacher ARGS="teacher={cfg.teacher.name} teacher.model={out}"')


if __name__ == "__main__":
    sys.exit(main())
