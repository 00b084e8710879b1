"""Compare evaluation results: ``python -m stages.compare_evals runs=[dir,...] labels=[name,...]``
(``make compare ARGS="..."``). Settings: :class:`CompareSettings`; ``conf/compare_evals.yaml``
overrides them.

Reads each run's ``eval.json`` (written by ``make eval-student``), refuses runs evaluated on
different problems or settings (every difference listed; ``allow_mismatch=true`` shows them flagged
instead), and writes ``compare.md``, ``compare.json`` and ``compare.png`` (grouped bars) to
``out_dir``. The table is printed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from pipeline.runtime.config import defaults
from pipeline.evaluation.compare import (
    compare,
    load_result,
    markdown_table,
    write_comparison,
)
from stages.common import build, entry_point, plain, raise_if


@dataclass(frozen=True)
class CompareSettings:
    runs: tuple[str, ...] = ()  # folders written by make eval-student (each holds eval.json)
    labels: tuple[str, ...] | None = None  # one per run (None: each run's label, else its folder name)
    allow_mismatch: bool = False  # true: show runs evaluated on different data/settings, flagged with *, instead of refusing
    out_dir: str = "outputs/eval/compare"

    def problems(self) -> list[str]:
        problems = []
        if not self.runs:
            problems.append("runs: give the evaluation folders to compare, runs=[dir1,dir2,...]")
        if self.labels is not None and len(self.labels) != len(self.runs):
            problems.append(f"labels: {len(self.labels)} labels for {len(self.runs)} runs")
        return problems


def settings(cfg: DictConfig) -> CompareSettings:
    problems: list[str] = []
    found = build(CompareSettings, numbers_as_text(plain(cfg)), "", problems, drop=("hydra",))
    raise_if(problems)
    return found


def numbers_as_text(values: dict) -> dict:
    """``labels=[1,2]``: the command line reads them as numbers; a label is text, so they are kept as
    written (``[1,2]`` -> ``["1", "2"]``); anything else is left for the check to name."""
    labels = values.get("labels")
    if isinstance(labels, list):
        values = {**values, "labels": [str(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x
                                       for x in labels]}
    return values


def default_label(record: dict, folder: str) -> str:
    return record.get("label") or Path(folder).name


@entry_point("compare_evals", defaults(CompareSettings), check=settings)
def main(cfg: DictConfig) -> None:
    s = settings(cfg)
    folders = [to_absolute_path(str(r)) for r in s.runs]
    results = [load_result(f) for f in folders]
    labels = [str(x) for x in s.labels] if s.labels is not None else [default_label(r, f) for r, f in zip(results, folders)]
    comparison = compare(results, labels, folders, allow_mismatch=s.allow_mismatch)
    paths = write_comparison(comparison, Path(to_absolute_path(s.out_dir)))
    print(markdown_table(comparison))
    print("Wrote " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    sys.exit(main())
