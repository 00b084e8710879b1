"""Several evaluation results side by side: a markdown table, JSON and a grouped bar chart.

Results are comparable on a task when they share its data (sha256), problem count, shot count,
exemplars (sha256), prompt template, stop sequences and ``max_new_tokens``; on held-out bits per
byte when they measured the same text (its digest, documents and bytes). Runs that differ are
refused with every difference listed, or, with ``allow_mismatch``, shown with the cell marked ``*``
and the differences written under the table. Differences in settings that do not change the
problems or the text (backend, device, dtype, batch size, the bits-per-byte window) are listed as
notes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from pipeline.runtime.config import ConfigError, MissingPathError
from storage_schemas import iter_identity_differences, write_json_atomic

NOTE_KEYS = ("backend", "device", "dtype", "batch_size")
HELD_OUT = "bits_per_byte"  # the held-out measure's key in eval.json and in the mismatches


@dataclass
class Comparison:
    labels: list[str]
    runs: list[str]
    tasks: list[str]
    cells: dict[str, dict[str, dict | None]]  # task -> label -> {accuracy, correct, n} or None (not evaluated)
    mismatches: dict[str, list[str]] = field(default_factory=dict)  # task (or bits_per_byte) -> differences
    notes: list[str] = field(default_factory=list)
    held_out: dict[str, dict | None] = field(default_factory=dict)  # label -> bits-per-byte statistics or None

    def as_dict(self) -> dict:
        return {"labels": self.labels, "runs": self.runs, "tasks": self.tasks, "cells": self.cells,
                "held_out": self.held_out, "mismatches": self.mismatches, "notes": self.notes}


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
    held_out = {lab: _held_out_cell(r.get(HELD_OUT)) for lab, r in zip(labels, results)}
    if d := _held_out_differences(results, labels):
        mismatches[HELD_OUT] = d
    if mismatches and not allow_mismatch:
        listed = "; ".join(f"{t}: " + ", ".join(d) for t, d in mismatches.items())
        raise ConfigError(f"runs were evaluated on different problems, held-out text or settings ({listed}); "
                         "re-evaluate with the same data and settings, or allow_mismatch=true to show them flagged")
    return Comparison(labels=labels, runs=runs, tasks=tasks, cells=cells, mismatches=mismatches,
                      notes=_setting_notes(results, labels), held_out=held_out if any(held_out.values()) else {})


def _cell(result: dict | None) -> dict | None:
    if result is None:
        return None
    return {"accuracy": result["accuracy"], "correct": result["correct"], "n": result["n"]}


def _differences(task: str, results: list[dict], labels: list[str]) -> list[str]:
    having = [(lab, r["tasks"][task]["comparable"]) for lab, r in zip(labels, results) if task in r["tasks"]]
    first_label, first = having[0]
    return [f"{lab} vs {first_label}: {d}" for lab, s in having[1:] for d in iter_identity_differences(s, first)]


def _held_out_cell(result: dict | None) -> dict | None:
    if result is None:
        return None
    keys = ("bits_per_byte", "document_mean", "document_ci", "level", "nats_per_token", "documents", "bytes",
            "tokens", "window")
    return {k: result.get(k) for k in keys}


def _held_out_differences(results: list[dict], labels: list[str]) -> list[str]:
    having = [(lab, r[HELD_OUT]["comparable"]) for lab, r in zip(labels, results) if HELD_OUT in r]
    if len(having) < 2:
        return []
    first_label, first = having[0]
    return [f"{lab} vs {first_label}: {d}" for lab, s in having[1:] for d in iter_identity_differences(s, first)]


def _setting_notes(results: list[dict], labels: list[str]) -> list[str]:
    notes = []
    for key in NOTE_KEYS:
        values = {lab: r["settings"].get(key) for lab, r in zip(labels, results)}
        if len(set(map(str, values.values()))) > 1:
            notes.append(f"{key} differs: " + ", ".join(f"{lab} {v}" for lab, v in values.items()))
    windows = {lab: r[HELD_OUT]["window"] for lab, r in zip(labels, results) if HELD_OUT in r}
    if len(set(windows.values())) > 1:
        notes.append("bits-per-byte window (tokens of context) differs: "
                     + ", ".join(f"{lab} {v}" for lab, v in windows.items()))
    return notes


def markdown_table(c: Comparison) -> str:
    text = ""
    if c.tasks:
        lines = ["| task | " + " | ".join(c.labels) + " |", "|---|" + "---:|" * len(c.labels)]
        for t in c.tasks:
            flag = "*" if t in c.mismatches else ""
            lines.append(f"| {t} | " + " | ".join(_fmt(c.cells[t][lab], flag) for lab in c.labels) + " |")
        if len(c.tasks) > 1:
            lines.append("| mean | " + " | ".join(_fmt_mean(c, lab) for lab in c.labels) + " |")
        text += "\n".join(lines) + "\n"
        text += "\nAccuracy (correct / n), few-shot chain of thought, greedy.\n"
    if c.held_out:
        text += ("\n" if text else "") + held_out_table(c)
    text += "".join(f"\n`*` {t}: not comparable: {'; '.join(d)}\n" for t, d in c.mismatches.items())
    text += "".join(f"\nNote: {n}\n" for n in c.notes)
    text += "\nRuns:\n" + "".join(f"- {lab}: `{run}`\n" for lab, run in zip(c.labels, c.runs))
    return text


def held_out_table(c: Comparison) -> str:
    """Held-out bits per byte per run: overall, per-document mean with its interval, nats per token,
    and the counts."""
    flag = "*" if HELD_OUT in c.mismatches else ""
    rows = [
        ("bits/byte", lambda b: f"{b['bits_per_byte']:.4f}{flag}"),
        ("per-document mean [CI]", lambda b: f"{b['document_mean']:.4f}" + (
            f" [{b['document_ci'][0]:.4f}, {b['document_ci'][1]:.4f}]" if b["document_ci"] else "")),
        ("nats/token", lambda b: f"{b['nats_per_token']:.4f}"),
        ("tokens", lambda b: str(b["tokens"])),
        ("documents / bytes", lambda b: f"{b['documents']} / {b['bytes']}"),
    ]
    lines = ["| held out | " + " | ".join(c.labels) + " |", "|---|" + "---:|" * len(c.labels)]
    for name, show in rows:
        lines.append(f"| {name} | " + " | ".join("—" if c.held_out[lab] is None else show(c.held_out[lab])
                                                for lab in c.labels) + " |")
    levels = {round(100 * b["level"]) for b in c.held_out.values() if b is not None}
    return ("\n".join(lines) + "\n\nHeld-out bits per UTF-8 byte (total bits / total bytes; lower is better), "
            f"comparable across tokenizers; per document: mean and {'/'.join(map(str, sorted(levels)))}% t interval "
            "over documents.\n")


def _fmt(cell: dict | None, flag: str) -> str:
    return "—" if cell is None else f"{100 * cell['accuracy']:.1f}{flag} ({cell['correct']}/{cell['n']})"


def _fmt_mean(c: Comparison, label: str) -> str:
    values = [c.cells[t][label]["accuracy"] for t in c.tasks if c.cells[t][label] is not None]
    complete = len(values) == len(c.tasks)
    return f"{100 * sum(values) / len(values):.1f}" + ("" if complete else " (partial)") if values else "—"


def bar_chart(c: Comparison, path: Path) -> None:
    """Grouped bars: one group per task, one bar per run; held-out bits per byte in a panel of its
    own (one bar per run)."""

    matplotlib.use("Agg")

    panels = int(bool(c.tasks)) + int(bool(c.held_out))
    widths = [max(6.0, 1.2 * len(c.tasks) * len(c.labels) ** 0.5 + 2)] * bool(c.tasks) + [4.0] * bool(c.held_out)
    fig, axes = plt.subplots(1, panels, figsize=(sum(widths), 4), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    axes = list(axes[0])
    if c.tasks:
        ax = axes.pop(0)
        width = 0.8 / len(c.labels)
        for k, label in enumerate(c.labels):
            xs = [i + (k - (len(c.labels) - 1) / 2) * width for i in range(len(c.tasks))]
            ys = [100 * c.cells[t][label]["accuracy"] if c.cells[t][label] else 0.0 for t in c.tasks]
            ax.bar(xs, ys, width, label=label)
        ax.set_xticks(range(len(c.tasks)), [t + ("*" if t in c.mismatches else "") for t in c.tasks])
        ax.set_ylabel("accuracy (%)")
        ax.set_title("few-shot chain-of-thought accuracy")
        ax.legend()
    if c.held_out:
        ax = axes.pop(0)
        shown = [lab for lab in c.labels if c.held_out[lab] is not None]
        values = [c.held_out[lab]["bits_per_byte"] for lab in shown]
        ax.bar(range(len(shown)), values, 0.6, color=[f"C{c.labels.index(lab)}" for lab in shown])
        ax.set_xticks(range(len(shown)), shown)
        ax.set_ylabel("bits per byte")
        ax.set_title("held-out bits per byte" + ("*" if HELD_OUT in c.mismatches else ""))
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
