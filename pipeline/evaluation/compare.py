"""Several evaluation results side by side: a markdown table, JSON and a grouped bar chart.

Results are comparable on a task when they share its data (sha256), problem count, shot count,
exemplars (sha256), prompt template, stop sequences and ``max_new_tokens``. Runs that differ are
refused with every difference listed, or, with ``allow_mismatch``, shown with the cell marked ``*``
and the differences written under the table. Differences in generation settings that do not change
the problems (backend, device, dtype, batch size) are listed as notes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from pipeline.config import ConfigError, MissingPathError
from storage_schemas import iter_identity_differences, write_json_atomic

NOTE_KEYS = ("backend", "device", "dtype", "batch_size")


@dataclass
class Comparison:
    labels: list[str]
    runs: list[str]
    tasks: list[str]
    cells: dict[str, dict[str, dict | None]]  # task -> label -> {accuracy, correct, n} or None (not evaluated)
    mismatches: dict[str, list[str]] = field(default_factory=dict)  # task -> differences
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"labels": self.labels, "runs": self.runs, "tasks": self.tasks, "cells": self.cells,
                "mismatches": self.mismatches, "notes": self.notes}


def load_result(folder: str | Path) -> dict:
    path = Path(folder) / "eval.json"
    if not path.is_file():
        raise MissingPathError(f"{path}: not found; run make eval-student first (or give the folder it wrote)")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("tasks"), dict):
        raise ConfigError(f"{path}: not an evaluation result (no 'tasks')")
    return record


def compare(results: list[dict], labels: list[str], runs: list[str], allow_mismatch: bool = False) -> Comparison:
    if len(labels) != len(results):
        raise ConfigError(f"{len(labels)} labels for {len(results)} runs")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"labels must differ: {labels}")
    tasks = list(dict.fromkeys(t for r in results for t in r["tasks"]))
    cells = {t: {lab: _cell(r["tasks"].get(t)) for lab, r in zip(labels, results)} for t in tasks}
    mismatches = {t: d for t in tasks if (d := _differences(t, results, labels))}
    if mismatches and not allow_mismatch:
        listed = "; ".join(f"{t}: " + ", ".join(d) for t, d in mismatches.items())
        raise ConfigError(f"runs were evaluated on different problems or settings ({listed}); "
                         "re-evaluate with the same data and settings, or allow_mismatch=true to show them flagged")
    return Comparison(labels=labels, runs=runs, tasks=tasks, cells=cells, mismatches=mismatches,
                      notes=_setting_notes(results, labels))


def _cell(result: dict | None) -> dict | None:
    if result is None:
        return None
    return {"accuracy": result["accuracy"], "correct": result["correct"], "n": result["n"]}


def _differences(task: str, results: list[dict], labels: list[str]) -> list[str]:
    having = [(lab, r["tasks"][task]["comparable"]) for lab, r in zip(labels, results) if task in r["tasks"]]
    first_label, first = having[0]
    return [f"{lab} vs {first_label}: {d}" for lab, s in having[1:] for d in iter_identity_differences(s, first)]


def _setting_notes(results: list[dict], labels: list[str]) -> list[str]:
    notes = []
    for key in NOTE_KEYS:
        values = {lab: r["settings"].get(key) for lab, r in zip(labels, results)}
        if len(set(map(str, values.values()))) > 1:
            notes.append(f"{key} differs: " + ", ".join(f"{lab} {v}" for lab, v in values.items()))
    return notes


def markdown_table(c: Comparison) -> str:
    lines = ["| task | " + " | ".join(c.labels) + " |", "|---|" + "---:|" * len(c.labels)]
    for t in c.tasks:
        flag = "*" if t in c.mismatches else ""
        lines.append(f"| {t} | " + " | ".join(_fmt(c.cells[t][lab], flag) for lab in c.labels) + " |")
    if len(c.tasks) > 1:
        lines.append("| mean | " + " | ".join(_fmt_mean(c, lab) for lab in c.labels) + " |")
    text = "\n".join(lines) + "\n"
    text += "\nAccuracy (correct / n), few-shot chain of thought, greedy.\n"
    text += "".join(f"\n`*` {t}: not comparable: {'; '.join(d)}\n" for t, d in c.mismatches.items())
    text += "".join(f"\nNote: {n}\n" for n in c.notes)
    text += "\nRuns:\n" + "".join(f"- {lab}: `{run}`\n" for lab, run in zip(c.labels, c.runs))
    return text


def _fmt(cell: dict | None, flag: str) -> str:
    return "—" if cell is None else f"{100 * cell['accuracy']:.1f}{flag} ({cell['correct']}/{cell['n']})"


def _fmt_mean(c: Comparison, label: str) -> str:
    values = [c.cells[t][label]["accuracy"] for t in c.tasks if c.cells[t][label] is not None]
    complete = len(values) == len(c.tasks)
    return f"{100 * sum(values) / len(values):.1f}" + ("" if complete else " (partial)") if values else "—"


def bar_chart(c: Comparison, path: Path) -> None:
    """Grouped bars: one group per task, one bar per run."""

    matplotlib.use("Agg")

    width = 0.8 / len(c.labels)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(c.tasks) * len(c.labels) ** 0.5 + 2), 4))
    for k, label in enumerate(c.labels):
        xs = [i + (k - (len(c.labels) - 1) / 2) * width for i in range(len(c.tasks))]
        ys = [100 * c.cells[t][label]["accuracy"] if c.cells[t][label] else 0.0 for t in c.tasks]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(c.tasks)), [t + ("*" if t in c.mismatches else "") for t in c.tasks])
    ax.set_ylabel("accuracy (%)")
    ax.set_title("few-shot chain-of-thought accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_comparison(c: Comparison, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "compare.md", out / "compare.json", out / "compare.png"]
    paths[0].write_text(markdown_table(c), encoding="utf-8")
    write_json_atomic(paths[1], c.as_dict())
    bar_chart(c, paths[2])
    return paths
