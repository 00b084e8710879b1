"""The warm study's report (repro/warm.py): ``report.md``, ``report.json`` and the warm-up curves
``warmup.png`` in the report folder.

Every comparison is a seed-paired t interval at 95% (:mod:`repro.stats`) on each endpoint of the
design, over the comparison's seeds at each arm's chosen rate. A report is never replaced by one
built from fewer finished runs (:func:`write_report_safely`): such a report is written to the
``partial/`` folder beside it, and the command says where.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict
from pathlib import Path

from hydra.utils import to_absolute_path

from repro.endpoints import endpoint_value
from repro.stats import paired_test, verdict

PARTIAL = "partial"
SELECTION_ROWS = (("byte_share_trained", "byte pieces, trained", "{:.1%}"), ("byte_share_left", "byte pieces, left", "{:.1%}"),
                  ("loss_kept", "student loss, trained", "{:.2f}"), ("student_loss_left", "student loss, left", "{:.2f}"),
                  ("teacher_loss_trained", "teacher loss, trained", "{:.2f}"),
                  ("teacher_loss_left", "teacher loss, left", "{:.2f}"), ("kept_fraction", "share trained", "{:.1%}"))


def compare(results: list[dict], a: str, b: str, claimed: int, endpoint: str, source: str | None = None) -> dict | None:
    """The seed-paired test of ``a - b`` on one endpoint (or one source of the overall one)."""
    by_seed = {arm: {r["seed"]: endpoint_value(r, endpoint, source) for r in results if r["arm"] == arm} for arm in (a, b)}
    seeds = sorted(set(by_seed[a]) & set(by_seed[b]))
    if not seeds:
        return None
    test = paired_test([by_seed[a][s] - by_seed[b][s] for s in seeds])
    return {**test, "seeds": seeds, "verdict": verdict(test, claimed),
            "mean_a": statistics.fmean(by_seed[a][s] for s in seeds), "mean_b": statistics.fmean(by_seed[b][s] for s in seeds)}


def _cell(test: dict | None) -> str:
    if test is None:
        return "not run"
    if test["ci"] is None:
        return f"{test['mean']:+.4f} (1 seed)"
    return f"{test['mean']:+.4f} [{test['ci'][0]:+.4f}, {test['ci'][1]:+.4f}]"


def student_report(study, name: str, record: dict, results: list[dict]) -> dict:
    """One student's claims (per endpoint, and per source for the overall one), arms and study sd."""
    compare_runs = [r for r in results if r["student"] == name and r["phase"] == "compare"]
    sources = sorted({s for r in compare_runs for s in r["per_source"]})
    claims = []
    for a, b, claimed in study.comparisons:
        claims.append({"a": a, "b": b, "claimed": claimed,
                       "endpoints": {e: compare(compare_runs, a, b, claimed, e) for e in study.endpoints},
                       "per_source": {s: compare(compare_runs, a, b, claimed, "overall", s) for s in sources}})
    arms = {}
    for arm in study.arms:
        rs = [r for r in compare_runs if r["arm"] == arm]
        if rs:
            arms[arm] = {"runs": len(rs), "learning_rate": rs[0]["learning_rate"],
                         **{e: statistics.fmean(endpoint_value(r, e) for r in rs) for e in study.endpoints},
                         "per_source": {s: statistics.fmean(r["per_source"][s]["bits_per_byte"] for r in rs)
                                        for s in sources},
                         "selection": {k: statistics.fmean(r["selection"][k]["mean"] for r in rs)
                                       for k, _, _ in SELECTION_ROWS if all(k in r["selection"] for r in rs)},
                         "seconds": statistics.fmean(r["seconds"] for r in rs)}
    sds = [c["endpoints"]["overall"]["sd"] for c in claims
           if c["endpoints"]["overall"] and c["endpoints"]["overall"]["n"] > 1]
    study_sd = math.sqrt(statistics.fmean(x * x for x in sds)) if sds else None
    return {"claims": claims, "arms": arms, "sources": sources, "study_pooled_sd": study_sd}


def recorded_student(spec: dict) -> dict:
    """A student as a report records it: for a pretrained folder its own shape (config.json), never
    the defaults of the fields that only a new model uses."""
    if not spec.get("model"):
        return spec
    shape = {"hidden_size": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
             "kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size"}
    try:
        config = json.loads((Path(to_absolute_path(spec["model"])) / "config.json").read_text())
    except (OSError, ValueError):
        return {k: v for k, v in spec.items() if k not in shape and k != "seed"}
    return {**{k: v for k, v in spec.items() if k != "seed"}, **{k: config.get(c) for k, c in shape.items()}}


def finished_runs(report_json: Path) -> int:
    """How many finished runs a report holds (0 when there is none or it cannot be read)."""
    try:
        return len(json.loads(report_json.read_text()).get("results", []))
    except (OSError, ValueError):
        return 0


def write_report_safely(study, students: dict, results: list[dict], corpus: dict, folders: dict, meta: dict,
                        views: dict | None = None) -> dict:
    """Write the report to ``report_dir``, unless the report there holds more finished runs: then
    to ``report_dir/partial`` (module docstring), with a line saying so. ``views``: each student's
    study as it ran it (``repro.warm.for_student``; the study itself where not given)."""
    target = Path(to_absolute_path(study.report_dir))
    held = finished_runs(target / "report.json")
    if len(results) < held:
        target = target / PARTIAL
        print(f"the report in {study.report_dir} holds {held} finished runs, this one {len(results)}: "
              f"it stays as it is; this report goes to {target}", flush=True)
    return write_report(study, students, results, corpus, folders, meta, target, views)


def write_report(study, students: dict, results: list[dict], corpus: dict, folders: dict, meta: dict,
                 target: Path, views: dict | None = None) -> dict:
    from storage_schemas import write_json_atomic

    students, folders, corpus = (_relative(x) for x in (students, folders, corpus))
    views = {name: (views or {}).get(name, study) for name in students}  # each student's arms, rates and seeds
    per_student = {name: student_report(views[name], name, rec, results) for name, rec in students.items()}
    design = {k: v for k, v in asdict(study).items() if k not in ("realtext_dir", "work_dir", "report_dir", "artifacts_dir")}
    design["students"] = {k: recorded_student(v) for k, v in design["students"].items()}
    record = {**meta, "design": design,
              "corpus": corpus, "scored": folders, "students": students, "analysis": per_student,
              "results": results}
    target.mkdir(parents=True, exist_ok=True)
    write_json_atomic(target / "report.json", record)
    plotted = plot_warmups(students, target / "warmup.png")
    lines = [f"# Does guidance help a fluent student? The warm real-model study ({meta['finished']})", "",
             "Held-out bits per UTF-8 byte (lower is better) of real students, each first warmed up on real "
             "mathematics with plain continual pretraining, then continually pretrained on the training text by "
             "each arm from that one checkpoint, at the arm's own learning rate. Every comparison is a seed-paired "
             "t interval at 95% of a - b; `holds` when it excludes 0 on the claimed side, `does not hold` on the "
             "other, `inconclusive` otherwise. Design (committed before the runs): conf/repro_real.yaml; method and "
             "reading: docs/real-models.md.", "",
             f"Reproduce: `{meta['command']}` (finished runs are kept; `make repro-real ARGS=\"plan=true\"` lists them)."
             + (" Written from the finished runs; the command that trains them is the same without report_only."
                if "report_only=true" in meta["command"] else ""),
             ""]
    for name, rec in students.items():
        lines += _student_lines(views[name], name, rec, per_student[name], plotted, results)
    lines += ["## Corpus", "", "| split | source | documents | characters | licenses |", "|---|---|---|---|---|"]
    for split in ("warmup", "tune", "train", "held_out"):
        for source, s in sorted(corpus.get(split, {}).items()):
            licenses = "; ".join(f"{k} ({v})" for k, v in s["licenses"].items())
            lines.append(f"| {split} | {source} | {s['documents']} | {s['characters']:,} | {licenses} |")
    lines += ["", f"Scored once by the teacher: the training text ({folders['train']}), the held-out text "
              f"({folders['held_out']}); the held-out median teacher-token loss, which splits easy from hard: "
              f"{meta['teacher_median_loss']:.4f} nats." if meta.get("teacher_median_loss") is not None else "",
              f"Machine: {meta['machine']}; this invocation {meta['seconds'] / 60:.1f} min; {len(results)} runs in "
              "this report."]
    (target / "report.md").write_text("\n".join(lines) + "\n")
    return record


def _relative(value):
    """``value`` with every path under the working directory written relative to it: a report names
    the project's folders, never the machine it ran on."""
    if isinstance(value, dict):
        return {k: _relative(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_relative(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        shown = os.path.relpath(os.path.normpath(value), os.getcwd())
        return value if shown.startswith("../..") else shown
    return value


def _sweep_means(results: list[dict], name: str, arm: str) -> dict[str, tuple[float, int]]:
    """Per rate an arm's sweep tried so far: the mean tuning bits per byte and the number of seeds."""
    by: dict[float, list[float]] = {}
    for r in results:
        if r["phase"] == "sweep" and r["student"] == name and r["arm"] == arm:
            by.setdefault(r["learning_rate"], []).append(r["tune_bits_per_byte"])
    return {f"{lr:g}": (statistics.fmean(v), len(v)) for lr, v in by.items()}


def _student_lines(study, name: str, rec: dict, analysis: dict, plotted: bool,
                   results: list[dict] = ()) -> list[str]:
    w = rec["warmup"]
    lines = [f"## {name}", ""]
    spec = study.students[name]
    amended = [f"{label}: {value}" for label, value in (
        ("arms", ", ".join(spec.arms)), ("learning rates", spec.learning_rates), ("rates below", spec.rates_below),
        ("rates above", spec.rates_above), ("branch settings", " ".join(spec.branch_overrides)),
        ("seeds", ", ".join(f"{k} {v}" for k, v in spec.sizing.items()))) if value]
    if amended:
        lines += ["The design's settings for this student alone (conf/repro_real.yaml): " + "; ".join(amended) + ".", ""]
    lines += ["### Warm-up", ""]
    if not w["stages"]:
        return lines + ["Not started.", ""]
    lines += [f"Plain cpt on the warm-up text, warm-up-stable-decay at peak rate {w['learning_rate']:g}; the "
              f"tuning text's bits per byte every {w['eval_every']} steps. Flattened (the design's rule): over the "
              "last quarter of a stage's stable phase the tuning bits per byte improved by less than "
              f"{study.flat_within:.0%}; a stage that did not flatten is continued from its stable phase to the "
              "next stage's steps.", ""]
    for st in w["stages"]:
        flat = {True: "flattened", False: "did not flatten", None: "not judged"}[st["flattened"]]
        lines.append(f"- to step {st['steps']}: {st['curve'][0]['bits_per_byte']:.4f} at step {st['curve'][0]['step']} "
                     f"-> {st['curve'][-1]['bits_per_byte']:.4f} at step {st['curve'][-1]['step']}"
                     + ("" if st["finished"] else " (still running)") + f"; {flat}"
                     + (f" (steps {st['from_step']}-{st['to_step']}: {st['relative_improvement']:.2%} better)"
                        if st.get("from_step") is not None else ""))
    unflat = " It did not flatten and the design has no further stage: the branch starts from it anyway." \
        if w["finished"] and w["flattened"] is False and len(w["stages"]) == 1 + len(spec.warmup.extensions) else ""
    lines += ["", f"Every arm branches from {w['final']} (tuning bits per byte {w['curve'][-1]['bits_per_byte']:.4f})."
              + unflat if w["finished"] else "The warm-up has not finished: no branch has started.", ""]
    if plotted:
        lines += ["![warm-up curves](warmup.png)", ""]
    lines += ["| step | " + " | ".join(str(c["step"]) for c in w["curve"]) + " |",
              "|---|" + "---|" * len(w["curve"]),
              "| tuning bits/byte | " + " | ".join(f"{c['bits_per_byte']:.4f}" for c in w["curve"]) + " |", ""]
    rates = rec.get("rates") or {}
    tried = sorted({r["learning_rate"] for r in results if r["phase"] == "sweep" and r["student"] == name}
                   | set(study.learning_rates))
    lines += ["### Learning rates (sweep seeds " + ", ".join(map(str, study.sweep_seeds)) + ")", "",
              "Mean tuning bits per byte of each arm at each rate it tried (the design's grid, and the rates below or "
              "above it an arm tries while its best is on an edge); the arm's rate is its lowest.", "",
              "| arm | " + " | ".join(f"{lr:g}" for lr in tried) + " | chosen |", "|---|" + "---|" * (len(tried) + 1)]
    for arm in study.arms:
        r = rates.get(arm)
        if r is None:  # what the sweep measured so far (n: the seeds finished at that rate)
            so_far = _sweep_means(results, name, arm)
            lines.append(f"| {arm} | " + " | ".join(
                f"{so_far[f'{lr:g}'][0]:.4f} (n={so_far[f'{lr:g}'][1]})" if f"{lr:g}" in so_far else "..."
                for lr in tried) + " | sweep not finished |")
            continue
        lines.append(f"| {arm} | " + " | ".join(f"{r['tune_means'][f'{lr:g}']:.4f}" if f"{lr:g}" in r["tune_means"]
                                                 else "-" for lr in tried)
                     + f" | {r['learning_rate']:g}" + (" (edge: no rate left to try)" if r["edge"] else "") + " |")
    p = rec.get("pilot")
    if p:
        sd = f"{p['pooled_sd']:.4f}" if p["pooled_sd"] is not None else "n/a"
        study_sd = analysis["study_pooled_sd"]
        lines += ["", f"Seeds: the sweep's paired differences at the chosen rates give a pooled sd of {sd} bits/byte "
                  f"({p['df']} degrees of freedom); the power rule at delta {p['delta']} and power {p['power']} asks for "
                  f"{p['seeds_the_rule_asks_for']} seeds; the comparison runs {len(p['seeds'])} (seeds {p['seeds']}, "
                  f"within [{study.sizing['min_seeds']}, {study.sizing['max_seeds']}])."
                  + (f" The comparison's own pooled sd: {study_sd:.4f}"
                     + (" (the pilot's was off by more than a factor of 2)." if p["pooled_sd"] and
                        not 0.5 <= study_sd / p["pooled_sd"] <= 2 else " (the pilot's was within a factor of 2).")
                     if study_sd is not None else "")]
    lines += ["", "### Comparisons", "", "a - b in bits per byte, 95% interval over seeds (negative: a better).", "",
              "| a | b | " + " | ".join(study.endpoints) + " |", "|---|---|" + "---|" * len(study.endpoints)]
    for c in analysis["claims"]:
        lines.append(f"| {c['a']} | {c['b']} | " + " | ".join(
            f"{_cell(c['endpoints'][e])} {c['endpoints'][e]['verdict'] if c['endpoints'][e] else ''}"
            for e in study.endpoints) + " |")
    if analysis["sources"]:
        lines += ["", "Overall, by source:", "", "| a | b | " + " | ".join(analysis["sources"]) + " |",
                  "|---|---|" + "---|" * len(analysis["sources"])]
        for c in analysis["claims"]:
            lines.append(f"| {c['a']} | {c['b']} | " + " | ".join(
                f"{_cell(c['per_source'][s])} {c['per_source'][s]['verdict'] if c['per_source'][s] else ''}"
                for s in analysis["sources"]) + " |")
    if analysis["arms"]:
        lines += ["", "### Arms (means over the comparison's seeds)", "",
                  "| arm | rate | runs | " + " | ".join(study.endpoints) + " | min per run |",
                  "|---|---|---|" + "---|" * (len(study.endpoints) + 1)]
        for arm, a in analysis["arms"].items():
            lines.append(f"| {arm} | {a['learning_rate']:g} | {a['runs']} | "
                         + " | ".join(f"{a[e]:.4f}" for e in study.endpoints) + f" | {a['seconds'] / 60:.1f} |")
        lines += ["", "### The runs' own selection", "",
                  "Means over the logged steps of each run (every 10 steps), then over seeds: the tokens each arm "
                  "trained on against the valid tokens it left (stage 2's metrics).", "",
                  "| arm | " + " | ".join(label for _, label, _ in SELECTION_ROWS) + " |",
                  "|---|" + "---|" * len(SELECTION_ROWS)]
        for arm, a in analysis["arms"].items():
            sel = a["selection"]
            lines.append(f"| {arm} | " + " | ".join(fmt.format(sel[k]) if k in sel else "-"
                                                     for k, _, fmt in SELECTION_ROWS) + " |")
    return lines + [""]


def plot_warmups(students: dict, path: Path) -> bool:
    """The warm-up curves, one line per student; False when there is nothing to draw."""
    curves = {n: r["warmup"]["curve"] for n, r in students.items() if r["warmup"]["curve"]}
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, curve in curves.items():
        ax.plot([c["step"] for c in curve], [c["bits_per_byte"] for c in curve], marker="o", ms=3, label=name)
    ax.set_xlabel("warm-up step")
    ax.set_ylabel("tuning bits per byte")
    ax.set_title("Warm-up: plain cpt on the warm-up text")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
