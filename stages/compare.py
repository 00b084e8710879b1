"""Compare evaluation results: ``python -m stages.compare runs=[dir,...] labels=[name,...]``
(``make compare ARGS="..."``). Configuration: ``conf/compare.yaml``.

Reads each run's ``eval.json`` (written by ``make eval-student``), refuses runs evaluated on
different problems or settings (every difference listed; ``allow_mismatch=true`` shows them flagged
instead), and writes ``compare.md``, ``compare.json`` and ``compare.png`` (grouped bars) to
``out_dir``. The table is printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from pipeline.evaluation.compare import compare, load_result, markdown_table, write_comparison
from stages.common import exit_on_user_error, raise_if


def check_config(cfg: DictConfig) -> None:
    problems = []
    if not cfg.runs:
        problems.append("runs: give the evaluation folders to compare, runs=[dir1,dir2,...]")
    if cfg.labels is not None and len(cfg.labels) != len(cfg.runs or []):
        problems.append(f"labels: {len(cfg.labels)} labels for {len(cfg.runs or [])} runs")
    raise_if(problems)


def default_label(record: dict, folder: str) -> str:
    return record.get("label") or Path(folder).name


@hydra.main(version_base="1.3", config_path="../conf", config_name="compare")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    check_config(cfg)
    folders = [to_absolute_path(str(r)) for r in cfg.runs]
    results = [load_result(f) for f in folders]
    labels = [str(x) for x in cfg.labels] if cfg.labels is not None else [default_label(r, f) for r, f in zip(results, folders)]
    comparison = compare(results, labels, folders, allow_mismatch=bool(cfg.allow_mismatch))
    paths = write_comparison(comparison, Path(to_absolute_path(cfg.out_dir)))
    print(markdown_table(comparison))
    print("Wrote " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    sys.exit(main())
