"""Export entry point: ``python -m stages.export_student [hydra overrides]`` (``make export-student``).

Reads as a list of steps: compose and check the config (every problem at once, files included),
build the embedded student if it is the one chosen, export (:mod:`pipeline.export_student.job`),
print the summary. The defaults are the typed configs'; ``conf/export_student.yaml`` only overrides them.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import TYPE_CHECKING

from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from pipeline.export_student.config import ExportJobConfig, config_defaults, export_job_config
from stages.common import entry_point, plain, quiet_libraries, store_row
from stages.train_student import build_embedded, check_folders, register_run_name_resolvers

register_run_name_resolvers()  # ${run_corpus:...} and ${run_teacher:...} in conf/export_student.yaml

if TYPE_CHECKING:  # the export's job imports torch: main imports it after the check
    from pipeline.export_student.job import ExportSummary

log = logging.getLogger("export_student")


def job_config(cfg: DictConfig, check_files: bool = False) -> ExportJobConfig:
    """The typed job; every problem in the config is reported at once, with ``check_files`` also
    missing scored folders and a missing local student."""
    return export_job_config(plain(cfg), check_files=check_files)


def print_summary(s: ExportSummary) -> None:
    tokens = max(s.tokens, 1)
    rows = [
        ("export", s.output_dir + ("" if s.complete else "  (partial: rerun the same command for the rest)")),
        ("teachers", ", ".join(s.teachers)),
        ("rows", f"{s.rows:,} ({s.layout}), {s.student_tokens:,} student tokens ({s.tokens:,} stream tokens in the "
                 f"rows, BOS/EOS included), {s.mapped_fraction:.1%} of these with a teacher loss"),
        ("shards", f"{s.shards_written} written now, {s.shards_done_before} found done, {s.shards_planned} planned"),
        ("formats", ", ".join(f"{name} {size:,} bytes ({size / tokens:.2f}/token)" for name, size in s.bytes.items())),
        ("throughput", f"{s.tokens_per_s:,.0f} stream tokens/s over {s.seconds:.1f}s (this run, set-up included)"),
        *store_row(s.store_calls),
    ]
    table = Table(title="export-student", show_header=False, title_justify="left")
    for k, v in rows:
        table.add_row(k, v)
    console = Console()
    console.print(table)
    console.print(f"Read it: datasets.load_dataset({json.dumps(s.output_dir)}); recipes in docs/export.md",
                  markup=False, highlight=False, soft_wrap=True)  # one line, whatever the terminal's width


@entry_point("export_student", config_defaults(), check=job_config)
def main(cfg: DictConfig) -> None:
    from pipeline.export_student.job import run_export  # heavy: torch; after the check

    quiet_libraries()
    job = job_config(cfg, check_files=True)
    check_folders(cfg, job.output_dir, job.data.cache_dir)  # one line before anything is built or read
    build_embedded(cfg)
    summary = run_export(job)
    print_summary(summary)


if __name__ == "__main__":
    sys.exit(main())
