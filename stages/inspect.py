"""Look into a scored dataset: ``python -m stages.inspect command=<command> [key=value ...]``
(``make inspect ARGS="..."``). Configuration: ``conf/inspect/inspect.yaml``.

The commands are :mod:`pipeline.inspection.commands`. The config lives in a folder of its own,
``conf/inspect/``, so that ``teacher=`` and ``student=`` are plain values rather than the config
groups ``conf/teacher/`` and ``conf/student/`` of the other stages. User errors (a folder that is
not a dataset, an unknown document, a bad config) end with one line and exit status 2; validation
problems with exit status 1.
"""

from __future__ import annotations

import sys

import hydra
from hydra.utils import to_absolute_path
from omegaconf import DictConfig
from rich.console import Console

from pipeline.inspection import commands
from pipeline.inspection.commands import tokenizer_slug  # noqa: F401  (part of the stage's interface)
from stages.common import exit_on_user_error, quiet_libraries, raise_if


def run(cfg: DictConfig, console: Console | None = None) -> int:
    """Check the config (every problem at once), run the command; returns the exit status."""
    raise_if(commands.config_problems(cfg))
    return commands.run(cfg, console, resolve=to_absolute_path)


@hydra.main(version_base="1.3", config_path="../conf/inspect", config_name="inspect")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    quiet_libraries()
    status = run(cfg)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    sys.exit(main())
