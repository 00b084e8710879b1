"""The repro report: per-arm mean and spread over seeds, the paper's claims checked, a plot.

A claim "A beats B" is judged on seed-paired differences of held-out bits per byte (lower is
better; the same seed means the same initialisation and data order): it *holds* when the mean
difference favours A and every seed agrees, *holds on average* when the mean favours A but some
seed does not, and *does not hold* otherwise. "A is at least as good as B" also holds *within
noise* when A is worse by less than two standard errors of the paired differences. A claim with
several comparisons holds when all of them hold, holds on average when all hold at least on
average, and partly holds when some do. Nothing is
tuned to make a claim pass: the verdicts are whatever the numbers give.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

README_START = "<!-- repro-table:start -->"
README_END = "<!-- repro-table:end -->"

DESCRIPTIONS = {
    "guided": "guided: top-40% excess loss, max, unmapped included, token-level",
    "cpt": "cpt: every token",
    "random": "random 40% of tokens",
    "guided_weak_teacher": "guided, weak teacher",
    "chunk_32": "guided, chunk-level alignment, C=32",
    "chunk_4": "guided, chunk-level alignment, C=4",
    "unmapped_exclude": "guided, unmapped excluded",
    "aggregate_mean": "guided, mean aggregation",
    "aggregate_min": "guided, min aggregation",
    "bbpe_guided": "second student tokenizer: guided",
    "bbpe_cpt": "second student tokenizer: cpt",
}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass
class ArmSummary:
    arm: str
    teacher: str
    student: str
    seeds: list[int]
    bpb: list[float]
    restate: list[float]
    arithmetic: list[float]
    kept: list[float]

    def row(self) -> dict:
        out = {"arm": self.arm, "teacher": self.teacher, "student": self.student, "seeds": self.seeds}
        for name in ("bpb", "restate", "arithmetic", "kept"):
            m, s = _mean_sd(getattr(self, name))
            out[name] = {"mean": m, "sd": s, "values": getattr(self, name)}
        return out


def summarize(results: list[dict]) -> dict[str, ArmSummary]:
    arms: dict[str, ArmSummary] = {}
    for r in sorted(results, key=lambda r: (r["arm"], r["seed"])):
        a = arms.setdefault(r["arm"], ArmSummary(r["arm"], r["teacher"], r["student"], [], [], [], [], []))
        a.seeds.append(r["seed"])
        a.bpb.append(r["bits_per_byte"])
        em = r.get("exact_match", {})
        a.restate.append(em.get("restate", {}).get("accuracy", math.nan))
        a.arithmetic.append(em.get("arithmetic", {}).get("accuracy", math.nan))
        a.kept.append(r.get("last_log", {}).get("kept_fraction", math.nan))
    return arms


def paired(arms: dict[str, ArmSummary], a: str, b: str) -> dict | None:
    """Seed-paired differences of bits per byte, ``a - b`` (negative: ``a`` is better)."""
    if a not in arms or b not in arms:
        return None
    by_seed = dict(zip(arms[b].seeds, arms[b].bpb))
    diffs = [x - by_seed[s] for s, x in zip(arms[a].seeds, arms[a].bpb) if s in by_seed]
    if not diffs:
        return None
    mean, sd = _mean_sd(diffs)
    return {"a": a, "b": b, "diffs": diffs, "mean": mean, "sd": sd,
            "se": sd / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan,
            "a_better": sum(d < 0 for d in diffs), "n": len(diffs)}


def beats(p: dict | None) -> str:
    if p is None:
        return "not run"
    if p["mean"] < 0 and p["a_better"] == p["n"]:
        return "holds"
    if p["mean"] < 0:
        return f"holds on average ({p['a_better']}/{p['n']} seeds)"
    return "does not hold"


def at_least_as_good(p: dict | None) -> str:
    if p is None:
        return "not run"
    verdict = beats(p)
    if verdict != "does not hold":
        return verdict
    if not math.isnan(p["se"]) and p["mean"] <= 2 * p["se"]:
        return "holds within noise"
    return "does not hold"


def _fmt_diff(p: dict | None) -> str:
    if p is None:
        return "n/a"
    if "diffs" not in p:
        return f"{p['a']} / {p['b']}"
    return f"{p['a']} - {p['b']} = {p['mean']:+.4f} ± {p['sd']:.4f} bits/byte ({p['a_better']}/{p['n']} seeds better)"


def check_claims(arms: dict[str, ArmSummary], results: list[dict]) -> list[dict]:
    def claim(number, text, parts):
        verdicts = [v for _, v in parts]
        overall = ("holds" if all(v in ("holds", "holds within noise") for v in verdicts)
                   else "holds on average" if all(v.startswith("holds") for v in verdicts)
                   else "partly holds" if any(v.startswith("holds") for v in verdicts) else "does not hold")
        if any(v == "not run" for v in verdicts):
            overall = "not run" if all(v == "not run" for v in verdicts) else overall
        return {"claim": number, "text": text, "verdict": overall,
                "evidence": [{"comparison": _fmt_diff(p), "verdict": v} for p, v in parts]}

    c1 = [(p, beats(p)) for p in (paired(arms, "guided", "cpt"), paired(arms, "guided", "random"))]
    c2 = [(p, beats(p)) for p in (paired(arms, "guided", "guided_weak_teacher"),)]
    fine, coarse = paired(arms, "guided", "chunk_32"), paired(arms, "guided", "chunk_4")
    c3 = [(fine, beats(fine)), (coarse, beats(coarse)),
          (paired(arms, "chunk_32", "chunk_4"), beats(paired(arms, "chunk_32", "chunk_4")))]
    c4 = [(p, at_least_as_good(p)) for p in (paired(arms, "guided", "unmapped_exclude"),
                                              paired(arms, "guided", "aggregate_mean"),
                                              paired(arms, "guided", "aggregate_min"))]
    c5 = [(p, beats(p)) for p in (paired(arms, "bbpe_guided", "bbpe_cpt"),)]
    folders = {(r["student"], r["scored_folder"]) for r in results if r["arm"] in ("guided", "bbpe_guided")}
    same = len({f for _, f in folders}) == 1 and len({s for s, _ in folders}) == 2
    served = ({"a": "both students", "b": "one scored folder"}, "holds" if same else "does not hold")
    claims = [
        claim(1, "guided (top-40%, max, include) beats cpt and beats random 40%", c1),
        claim(2, "a stronger teacher gives a better student", c2),
        claim(3, "token-level alignment beats chunk-level, more so as chunks get coarser (C=32 -> C=4)", c3),
        claim(4, "unmapped include and max aggregation are at least as good as exclude, mean, min", c4),
        claim(5, "one scored corpus serves two students with different tokenizers (and guided beats cpt "
                 "for the second one too)", [*c5, served]),
    ]
    claims[4]["evidence"][-1]["comparison"] = "both students trained from one scored folder: " + ", ".join(
        sorted(f"{s}: {Path(f).parent.name}/{Path(f).name}" for s, f in folders))
    return claims


def _cell(mean: float, sd: float, digits: int = 4, pct: bool = False) -> str:
    if math.isnan(mean):
        return "n/a"
    if pct:
        return f"{100 * mean:.1f}% ± {100 * sd:.1f}"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def table_markdown(arms: dict[str, ArmSummary], order: list[str]) -> str:
    lines = ["| arm | what | teacher | student | held-out bits/byte ↓ | restate EM ↑ | arithmetic EM ↑ | kept share | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in order:
        if name not in arms:
            continue
        r = arms[name].row()
        lines.append(f"| {name} | {DESCRIPTIONS.get(name, name)} | {r['teacher']} | {r['student']} | "
                     f"{_cell(r['bpb']['mean'], r['bpb']['sd'])} | {_cell(r['restate']['mean'], r['restate']['sd'], pct=True)} | "
                     f"{_cell(r['arithmetic']['mean'], r['arithmetic']['sd'], pct=True)} | "
                     f"{_cell(r['kept']['mean'], r['kept']['sd'], 3)} | {len(r['seeds'])} |")
    return "\n".join(lines)


def claims_markdown(claims: list[dict]) -> str:
    lines = ["| # | claim | verdict | evidence (seed-paired differences, mean ± sd) |", "|---|---|---|---|"]
    for c in claims:
        evidence = "<br>".join(f"{e['comparison']}: {e['verdict']}" for e in c["evidence"])
        lines.append(f"| {c['claim']} | {c['text']} | **{c['verdict']}** | {evidence} |")
    return "\n".join(lines)


def _reference(name: str) -> str:
    """The guided arm of the same student, which the right-hand panel compares each arm with."""
    student_prefix = name.split("_")[0] + "_" if name.startswith("bbpe_") else ""
    return f"{student_prefix}guided"


def plot(arms: dict[str, ArmSummary], order: list[str], path: Path) -> None:
    """Left: bits per byte per arm (mean ± sd, dots for seeds). Right: each arm minus the guided arm
    of the same student, seed by seed (the differences the verdicts use; > 0: guided is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in order if n in arms]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(names) + 1.8), sharey=True)
    ax = axes[0]
    for y, name in enumerate(names):
        m, s = _mean_sd(arms[name].bpb)
        ax.barh(y, m, xerr=s, color="tab:green" if name.endswith("guided") else "tab:blue", alpha=0.6, capsize=3)
        ax.plot(arms[name].bpb, [y] * len(arms[name].bpb), "k.", markersize=4)
    lo = min(min(arms[n].bpb) for n in names)
    hi = max(max(arms[n].bpb) for n in names)
    ax.set_xlim(lo - 0.1 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))
    ax.set_xlabel("held-out bits per byte (lower is better)")
    ax = axes[1]
    for y, name in enumerate(names):
        p = paired(arms, name, _reference(name)) if name != _reference(name) else None
        if p is None:
            continue
        ax.barh(y, p["mean"], xerr=p["sd"], color="tab:red" if p["mean"] > 0 else "tab:gray", alpha=0.6, capsize=3)
        ax.plot(p["diffs"], [y] * len(p["diffs"]), "k.", markersize=4)
    ax.axvline(0, color="k", linewidth=0.8)
    ax.set_xlabel("arm - guided (same student), bits/byte per seed; > 0: guided better")
    axes[0].set_yticks(range(len(names)), names)
    axes[0].invert_yaxis()
    fig.suptitle("Toy-scale reproduction: mean ± sd over seeds (dots: single seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _base_lines(bases: dict) -> list[str]:
    """The base students' scores before continual pretraining (every arm starts from them)."""
    if not bases:
        return []
    lines = ["Base students (the starting point of every arm, before continual pretraining):", "",
             "| student | held-out bits/byte | restate EM | arithmetic EM |", "|---|---|---|---|"]
    for name, b in bases.items():
        em = b.get("exact_match", {})
        lines.append(f"| {name} | {b['bits_per_byte']:.4f} | {100 * em.get('restate', {}).get('accuracy', math.nan):.1f}% | "
                     f"{100 * em.get('arithmetic', {}).get('accuracy', math.nan):.1f}% |")
    return [*lines, ""]


def portable(result: dict) -> dict:
    """A run's record without this machine's paths: the scored folder relative to the work folder."""
    return {**result, "scored_folder": "/".join(Path(result["scored_folder"]).parts[-3:])}


def write_report(results: list[dict], order: list[str], setup: dict, out_dir: Path, readme: Path | None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = summarize(results)
    claims = check_claims(arms, results)
    table, claim_table = table_markdown(arms, order), claims_markdown(claims)
    date = setup["finished"][:10]
    body = "\n".join([
        f"# Toy-scale reproduction ({setup['finished']})", "",
        f"`make repro`: {setup['n_runs']} student runs ({len(arms)} arms x {len(setup['seeds'])} seeds), "
        f"{setup['train_tokens_per_run']:,} training tokens each; wall time {setup['seconds'] / 60:.1f} min on "
        f"{setup['machine']}" + (f" ({setup['runs_read_from_cache']} runs read from an earlier launch)"
                                 if setup.get("runs_read_from_cache") else "") + ".", "",
        "## Claims", "", claim_table, "",
        "## Arms", "", table, "",
        *_base_lines(setup.get("base_students") or {}),
        "Bits per byte: summed next-token loss on held-out clean math pages / their UTF-8 bytes (fair across "
        "tokenizers). Restate EM: greedy completion of the answer restated after a worked equation; arithmetic "
        "EM: the equation's result itself. Kept share: the share of tokens trained in the last logged steps.", "",
        "## Set-up", "", "```json", json.dumps(setup, indent=1), "```", "",
        "![plot](report.png)", "",
    ])
    (out_dir / "report.md").write_text(body)
    record = {"setup": setup, "claims": claims, "arms": {n: arms[n].row() for n in order if n in arms},
              "runs": [portable(r) for r in results]}
    (out_dir / "report.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    plot(arms, order, out_dir / "report.png")
    if readme is not None and readme.is_file():
        update_readme(readme, f"Latest run: {date}, {setup['machine']}, {setup['seconds'] / 60:.1f} min "
                              f"({setup['n_runs']} runs, {len(setup['seeds'])} seeds). Full report: "
                              f"`{out_dir.name}/report.md`.\n\n{claim_table}\n\n{table}")
    return record


def update_readme(readme: Path, section: str) -> bool:
    """Replace the text between the repro markers; False (and no change) when they are absent."""
    text = readme.read_text()
    pattern = re.compile(re.escape(README_START) + r".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        return False
    readme.write_text(pattern.sub(lambda _: f"{README_START}\n{section}\n{README_END}", text))
    return True
