"""The Polars one-liner stage 1's summary prints, run as a user pastes it into a shell: documents by
mean teacher loss, those without a loss (empty, whitespace-only) last."""

from __future__ import annotations

import json
import subprocess

from rich.console import Console

from pipeline.score_teacher.job import JobSummary
from stages import score_teacher


def test_the_printed_polars_line_lists_documents_without_a_loss_last(micro_scored):
    manifest = json.loads((micro_scored / "manifest.json").read_text())
    totals = manifest["totals"]
    assert totals["reasons"].get("empty_text") and totals["reasons"].get("whitespace_only"), "the data has some"
    summary = JobSummary(output_dir=str(micro_scored), shards_planned=4, shards_done_before=4, shards_scored=0,
                         shards_complete=4, documents=totals["documents"], tokens=totals["tokens"],
                         documents_this_run=0, tokens_this_run=0, seconds=1.0, reasons=totals["reasons"],
                         complete=True)
    console = Console(width=100, record=True, force_terminal=False)
    score_teacher.print_summary(summary, console)
    line = next(ln.strip() for ln in console.export_text().splitlines() if "import polars" in ln)
    shown = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [[cell.strip() for cell in ln.strip("│").split("┆")] for ln in shown.splitlines()
            if ln.startswith("│") and ":" in ln]  # data rows (doc ids are <file>:<row>), cells between ┆
    assert len(rows) == 10, shown  # Polars shows the first 5 and the last 5
    assert all(r[2] != "null" for r in rows[:5]), shown
    means = [float(r[2]) for r in rows[:5]]
    assert means == sorted(means), "lowest mean loss first"
    assert rows[-1][2] == "null" and rows[-1][1] == "0", shown
