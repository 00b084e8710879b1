"""``python -m stages.convert_teacher teacher=<name>`` (``make convert-teacher``): write a
safetensors copy of a teacher whose checkpoint ships only pickle (``.bin``) weights, read once with
``torch.load(weights_only=True)``, or of a GGUF checkpoint (``teacher.model=<file>.gguf``),
dequantized to float32 (:func:`pipeline.folders.model_source.convert_gguf`); then score with
``teacher.model=<that folder>``. Configuration: ``conf/convert_teacher.yaml``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from pipeline.runtime.config import ConfigError, defaults
from pipeline.folders.model_source import check_teacher_source, convert_gguf, convert_to_safetensors
from pipeline.folders.output_folder import check_writable
from pipeline.score_teacher.config import TEACHER_RECIPE_KEYS, TeacherConfig
from stages.common import build, entry_point, make_command, named_teacher, override, plain, quiet_libraries, raise_if


def teacher_config(cfg: DictConfig) -> TeacherConfig:
    problems: list[str] = []
    teacher = build(TeacherConfig, plain(cfg, "teacher"), "teacher", problems, drop=TEACHER_RECIPE_KEYS)
    raise_if(problems)
    return teacher


@entry_point("convert_teacher", {"teacher": defaults(TeacherConfig)}, check=teacher_config)
def main(cfg: DictConfig) -> None:
    quiet_libraries()
    preset, cfg = cfg.teacher.name, named_teacher(cfg, say=True)  # a GGUF of your own: named after its file
    teacher = teacher_config(cfg)
    check_writable({"out_dir": to_absolute_path(cfg.out_dir)})
    if teacher.model.endswith(".gguf"):
        if not os.path.isfile(os.path.expanduser(teacher.model)):
            raise ConfigError(f"teacher.model: no such GGUF file: {teacher.model}")
        out = convert_gguf(teacher.model, to_absolute_path(cfg.out_dir))
    else:
        check_teacher_source(replace(teacher, allow_bin=True))
        out = convert_to_safetensors(teacher.model, to_absolute_path(cfg.out_dir), revision=teacher.revision,
                                     trust_remote_code=teacher.trust_remote_code)
    print(f"safetensors copy of {teacher.model} written to {out}")
    named = [override("teacher.embedded", "false"), override("teacher.name", teacher.name)] if teacher.name != preset else []
    print("score with: " + make_command("score-teacher", override("teacher", preset), *named,
                                        override("teacher.model", out)))


if __name__ == "__main__":
    sys.exit(main())
