"""Figures against targets, and the two files a bench run leaves: ``latest.json`` and ``latest.md``.

A *figure* is one line of the bench table: a measured value, its target (``<=`` or ``>=``), a
status (``pass``, ``miss``, ``info`` for figures without a target, ``error`` when the case failed)
and a note that says how it was measured and, for a miss, by how much.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from storage_schemas import strict_json

OPS = ("<=", ">=")


def figure(key: str, measure: str, value: float | None, target: float | None = None, op: str | None = None,
           unit: str = "", note: str = "", details: dict | None = None) -> dict:
    """One figure; ``status`` and ``miss_by`` follow from ``value``, ``target`` and ``op``."""
    if op is not None and op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    status, miss_by = "info", None
    if value is None or (isinstance(value, float) and math.isnan(value)):
        status = "error" if target is not None else "info"
    elif target is not None:
        ok = value <= target if op == "<=" else value >= target
        status = "pass" if ok else "miss"
        if not ok:
            miss_by = value / target if op == "<=" else target / value  # how many times off
    return {"key": key, "measure": measure, "value": value, "unit": unit, "target": target, "op": op,
            "status": status, "miss_factor": miss_by, "note": note, "details": details or {}}


def error_figure(key: str, measure: str, target: float | None, op: str | None, exc: BaseException) -> dict:
    return figure(key, measure, None, target, op, note=f"case failed: {type(exc).__name__}: {exc}"[:500])


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 10_000:
            text = f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
        else:
            text = f"{value:,.0f}" if abs(value) >= 10_000 else f"{value:.2e}"
    else:
        text = str(value)
    return f"{text} {unit}".strip()


def status_text(f: dict) -> str:
    if f["status"] == "miss" and f.get("miss_factor"):
        return f"MISS ({f['miss_factor']:.2f}x off)"
    return {"pass": "pass", "info": "—", "error": "ERROR"}.get(f["status"], f["status"])


def markdown_table(figures: list[dict]) -> str:
    lines = ["| measure | value | target | status | how / note |", "|---|---|---|---|---|"]
    for f in figures:
        target = f"{f['op']} {_fmt(f['target'])}" if f["target"] is not None else "—"
        note = str(f.get("note", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {f['measure']} | {_fmt(f['value'], f['unit'])} | {target} | {status_text(f)} | {note} |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    m = report["machine"]
    head = [
        f"# Bench results ({report['mode']} run, {m['date']})",
        "",
        f"Machine: {m['cpu_model']}, {m['cpu_count']} cores ({m.get('cpu_affinity')} usable), "
        f"{m.get('memory_gib')} GiB; load average at start {m.get('load_average_1_5_15')}; "
        f"torch {m['torch']}, transformers {m['transformers']}, tokenizers {m.get('tokenizers')}, "
        f"ray {m.get('ray')}, pyarrow {m['pyarrow']}. GPU: {m.get('cuda') or 'none'}.",
        f"Total bench time: {report['seconds']:.0f} s.",
        "",
        "Each ratio is the median over interleaved repetitions of the per-repetition ratio; "
        "`latest.json` holds every raw timing, the spread (min/max of the paired ratios) and the set-up.",
        "",
        markdown_table(report["figures"]),
    ]
    notes = [f for f in report["figures"] if f["status"] in ("miss", "error")]
    if notes:
        head += ["", "## Misses", ""]
        for f in notes:
            head.append(f"- **{f['measure']}**: {f['note']}")
    return "\n".join(head) + "\n"


def write_report(report: dict, out_dir: str | os.PathLike, name: str = "latest") -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` atomically; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for suffix, text in ((".json", json.dumps(strict_json(report), indent=1, allow_nan=False)), (".md", markdown(report))):
        path = out / f"{name}{suffix}"
        tmp = out / f".{name}{suffix}.tmp{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1]
