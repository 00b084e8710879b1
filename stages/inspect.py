"""Look into a scored dataset: ``python -m stages.inspect command=<command> [key=value ...]``
(``make inspect ARGS="..."``). Settings: :class:`pipeline.inspection.commands.InspectConfig`;
``conf/inspect/inspect.yaml`` overrides them.

The commands are :mod:`pipeline.inspection.commands`. The config lives in a folder of its own,
``conf/inspect/``, so that ``teacher=`` and ``student=`` are plain values rather than the config
groups ``conf/teacher/`` and ``conf/student/`` of the other stages. User errors (a folder that is
not a dataset, an unknown document, a bad config) end with one line and exit status 2;
validation problems with exit status 1.
"""

from __future__ import annotations

import sys

from hydra.utils import to_absolute_path
from omegaconf import DictConfig
from rich.console import Console

from pipeline.runtime.config import defaults
from pipeline.inspection import commands
from pipeline.inspection.commands import InspectConfig, inspect_config, tokenizer_slug  # noqa: F401  (the stage's interface)
from stages.common import CONF_DIR, entry_point, plain, quiet_libraries


def settings(cfg: DictConfig) -> InspectConfig:
    """The typed settings; every problem in the config is reported at once."""
    return inspect_config(plain(cfg))


def run(cfg: DictConfig, console: Console | None = None) -> int:
    """Check the config (every problem at once), run the command; returns the exit status."""
    return commands.run(settings(cfg), console, resolve=to_absolute_path)


@entry_point("inspect", defaults(InspectConfig), check=settings, config_dir=CONF_DIR / "inspect")
def main(cfg: DictConfig) -> None:
    quiet_libraries()
    status = run(cfg)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    sys.exit(main())
