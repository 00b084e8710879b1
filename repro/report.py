"""The repro report: every comparison as a paired test over seeds, the claims judged by a stated
rule, the selection-ratio and noise sweeps plotted with 95% bands.

The rule (written into the report too): a comparison "A beats B" takes the seed-paired differences
of held-out bits per byte, ``A - B`` (the same seed means the same data order and the same random
draws), and their mean with a 95% t interval over seeds (``mean ± t(0.975, n-1) * sd / sqrt(n)``)
and the two-sided p value of the paired t test. It *holds* when the interval lies wholly on the
claimed side of zero, *does not hold* when it lies wholly on the other side, and is *inconclusive*
otherwise (and always with one seed). A claim made of several comparisons takes the weakest of
their verdicts: it is never upgraded. Nothing is tuned to make a claim pass: the settings are
fixed before the run and the verdicts are whatever the numbers give.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from scipy import stats

from repro.stats import LEVEL, NOT_RUN, paired_test, t_quantile, verdict, weakest

RULE = ("Each comparison A vs B uses the seed-paired differences A - B of held-out bits per byte (lower is "
        "better; the same seed means the same data order and random draws): their mean, a 95% t interval over "
        "seeds (mean ± t(0.975, n-1)·sd/√n) and the two-sided p of the paired t test. Verdict: **holds** when the "
        "interval lies wholly on the claimed side of zero, **does not hold** when it lies wholly on the other "
        "side, **inconclusive** otherwise (always with a single seed). A claim made of several comparisons "
        "takes the weakest verdict among them (does not hold < inconclusive < holds); it is never upgraded.")

DESCRIPTIONS = {
    "guided": "guided: top-40% excess loss, max, unmapped included, token-level",
    "cpt": "cpt: every token (= guided at 100%)",
    "random": "random 40% of tokens",
    "guided_weak_teacher": "guided, weak teacher",
    "chunk_32": "guided, chunk-level alignment, C=32",
    "chunk_4": "guided, chunk-level alignment, C=4",
    "unmapped_exclude": "guided, unmapped excluded",
    "aggregate_mean": "guided, mean aggregation",
    "aggregate_min": "guided, min aggregation",
    "bbpe_guided": "byte-level student: guided",
    "bbpe_cpt": "byte-level student: cpt",
    "teachers_min": "guided by strong + weak teachers, per token the lower loss",
    "teachers_mean": "guided by strong + weak teachers, per token their mean loss",
    "teachers_max": "guided by strong + weak teachers, per token the higher loss",
    "teachers_weighted": "guided by strong + weak teachers, their losses weighted (loss.teacher_weights)",
}
SWEEP_ARM = re.compile(r"^(guided|random)(?:_r(\d+))?$")  # guided, random (40%), guided_r10, random_r80, ...
NOISE_ARM = re.compile(r"^(guided|cpt)_noise(\d+)$")  # guided_noise0, cpt_noise25, ...
METRICS = {  # name: (label, how to read a result, claimed direction of "better")
    "bpb": ("held-out bits/byte", lambda r: r["bits_per_byte"], -1),
    "restate_bpb": ("restate answer bits/byte", lambda r: r["answers"]["restate"]["bits_per_byte"], -1),
    "restate_choice": ("restate 3-way choice", lambda r: r["answers"]["restate"]["choice_accuracy"], +1),
    "arithmetic_bpb": ("arithmetic answer bits/byte", lambda r: r["answers"]["arithmetic"]["bits_per_byte"], -1),
    "arithmetic_choice": ("arithmetic 3-way choice", lambda r: r["answers"]["arithmetic"]["choice_accuracy"], +1),
    "kept": ("kept share", lambda r: r.get("last_log", {}).get("kept_fraction", math.nan), 0),
}


def describe(arm: str) -> str:
    if arm in DESCRIPTIONS:
        return DESCRIPTIONS[arm]
    m = SWEEP_ARM.match(arm)
    if m and m.group(2):
        return f"{'guided: top' if m.group(1) == 'guided' else 'random'} {m.group(2)}% of tokens"
    m = NOISE_ARM.match(arm)
    if m:
        return f"{m.group(1)} on the student corpus with {m.group(2)}% noise pages"
    return arm


@dataclass
class ArmSummary:
    arm: str
    teacher: str
    student: str
    mode: str
    ratio: float
    noise_share: float
    values: dict[str, dict[int, float]] = field(default_factory=dict)  # metric -> seed -> value

    @property
    def seeds(self) -> list[int]:
        return sorted(self.values.get("bpb", {}))

    def series(self, metric: str = "bpb") -> list[float]:
        return [self.values[metric][s] for s in self.seeds]

    def interval(self, metric: str = "bpb") -> dict:
        """Mean, sd and 95% t interval of the arm's own values over seeds."""
        xs = [x for x in self.series(metric) if not math.isnan(x)]
        if not xs:
            return {"n": 0, "mean": math.nan, "sd": math.nan, "ci": None}
        mean = statistics.fmean(xs)
        if len(xs) < 2:
            return {"n": 1, "mean": mean, "sd": math.nan, "ci": None}
        sd = statistics.stdev(xs)
        half = t_quantile(LEVEL, len(xs) - 1) * sd / math.sqrt(len(xs))
        return {"n": len(xs), "mean": mean, "sd": sd, "ci": [mean - half, mean + half]}


def summarize(results: list[dict]) -> dict[str, ArmSummary]:
    arms: dict[str, ArmSummary] = {}
    for r in sorted(results, key=lambda r: (r["arm"], r["seed"])):
        a = arms.setdefault(r["arm"], ArmSummary(r["arm"], r["teacher"], r["student"], r.get("mode", "?"),
                                                 r.get("ratio", math.nan), r.get("noise_share", math.nan)))
        for name, (_, read, _) in METRICS.items():
            try:
                value = float(read(r))
            except (KeyError, TypeError):
                value = math.nan
            a.values.setdefault(name, {})[r["seed"]] = value
    return arms


def compare(arms: dict[str, ArmSummary], a: str, b: str, metric: str = "bpb") -> dict | None:
    """Paired test of ``a - b`` over the seeds both arms ran (None when either is missing)."""
    if a not in arms or b not in arms:
        return None
    va, vb = arms[a].values.get(metric, {}), arms[b].values.get(metric, {})
    seeds = sorted(s for s in set(va) & set(vb) if not (math.isnan(va[s]) or math.isnan(vb[s])))
    if not seeds:
        return None
    return {"a": a, "b": b, "metric": metric, "seeds": seeds, **paired_test([va[s] - vb[s] for s in seeds])}


def compare_gains(arms: dict[str, ArmSummary], a1: str, b1: str, a2: str, b2: str) -> dict | None:
    """Paired test of ``(a1 - b1) - (a2 - b2)`` in bits per byte over the seeds all four ran."""
    if not all(x in arms for x in (a1, b1, a2, b2)):
        return None
    v = [arms[x].values["bpb"] for x in (a1, b1, a2, b2)]
    seeds = sorted(set(v[0]) & set(v[1]) & set(v[2]) & set(v[3]))
    if not seeds:
        return None
    diffs = [(v[0][s] - v[1][s]) - (v[2][s] - v[3][s]) for s in seeds]
    return {"a": f"({a1} - {b1})", "b": f"({a2} - {b2})", "metric": "bpb", "seeds": seeds, **paired_test(diffs)}


def fmt_test(p: dict | None, digits: int = 4) -> str:
    if p is None:
        return "not run"
    ci = "no interval (one seed)" if p["ci"] is None else f"95% CI [{p['ci'][0]:+.{digits}f}, {p['ci'][1]:+.{digits}f}]"
    pv = "" if math.isnan(p["p"]) else f", p = {p['p']:.2g}"
    return f"{p['mean']:+.{digits}f}, {ci}{pv}, n = {p['n']}"


def _part(p: dict | None, claimed: int = -1) -> dict:
    label = f"{p['a']} - {p['b']}" if p else "not run"
    return {"comparison": label, "test": p, "verdict": verdict(p, claimed), "text": f"{label}: {fmt_test(p)}" if p else ""}


def sweep_points(arms: dict[str, ArmSummary]) -> dict[str, list[tuple[int, str]]]:
    """``{"guided": [(10, "guided_r10"), ..., (100, "cpt")], "random": [...]}``: the arms of the
    selection-ratio sweep (main student corpus, strong teacher), by their recorded ratio."""
    out: dict[str, list[tuple[int, str]]] = {"guided": [], "random": []}
    for name, a in arms.items():
        m = SWEEP_ARM.match(name)
        if m and a.mode == m.group(1):
            out[m.group(1)].append((round(100 * a.ratio), name))
    if "cpt" in arms:
        for curve in out.values():
            if curve:
                curve.append((100, "cpt"))
    return {k: sorted(v) for k, v in out.items() if v}


def noise_points(arms: dict[str, ArmSummary]) -> list[tuple[int, str, str]]:
    """``[(noise %, guided arm, cpt arm)]``: guided and cpt on each student corpus variant (the main
    corpus's pair is ``guided``/``cpt``)."""
    pairs: dict[int, dict[str, str]] = {}
    for name, a in arms.items():
        m = NOISE_ARM.match(name)
        if m:
            pairs.setdefault(int(m.group(2)), {})[m.group(1)] = name
    if "guided" in arms and "cpt" in arms and not math.isnan(arms["guided"].noise_share):
        pairs.setdefault(round(100 * arms["guided"].noise_share), {}).update(guided="guided", cpt="cpt")
    return [(n, p["guided"], p["cpt"]) for n, p in sorted(pairs.items()) if "guided" in p and "cpt" in p]


def check_claims(arms: dict[str, ArmSummary], results: list[dict]) -> list[dict]:
    def claim(number, text, parts):
        return {"claim": number, "text": text, "verdict": weakest([p["verdict"] for p in parts]), "evidence": parts}

    claims = [
        claim(1, "guided (top-40%, max, include, token-level) beats cpt (every token)",
              [_part(compare(arms, "guided", "cpt"))]),
        claim(2, "guided beats training on a random 40% of tokens", [_part(compare(arms, "guided", "random"))]),
        claim(3, "a stronger teacher gives a better student", [_part(compare(arms, "guided", "guided_weak_teacher"))]),
        claim(4, "token-level alignment beats chunk-level, more so as chunks get coarser (C=32 -> C=4)",
              [_part(compare(arms, "guided", "chunk_32")), _part(compare(arms, "guided", "chunk_4")),
               _part(compare(arms, "chunk_32", "chunk_4"))]),
        claim(5, "unmapped include and max aggregation beat exclude, mean and min",
              [_part(compare(arms, "guided", x)) for x in ("unmapped_exclude", "aggregate_mean", "aggregate_min")]),
    ]
    folders = {(r["student"], r["scored_folder"]) for r in results if r["arm"] in ("guided", "bbpe_guided")}
    same = len({f for _, f in folders}) == 1 and len({s for s, _ in folders}) == 2
    served = {"comparison": "one scored folder", "test": None, "verdict": "holds" if same else "does not hold",
              "text": "both students trained from one scored folder: " + ", ".join(
                  sorted(f"{s}: {'/'.join(Path(f).parts[-2:])}" for s, f in folders))}
    if "bbpe_guided" not in arms:
        served["verdict"] = NOT_RUN
    claims.append(claim(6, "one scored corpus serves two students with different tokenizers, and guided beats cpt "
                           "for the byte-level student too", [_part(compare(arms, "bbpe_guided", "bbpe_cpt")), served]))
    sweep = sweep_points(arms)
    random_at = dict(sweep.get("random", []))
    parts = [_part(compare(arms, g, random_at[ratio])) for ratio, g in sweep.get("guided", [])
             if ratio < 100 and ratio in random_at]
    claims.append(claim(7, "guided beats random selection at every ratio of the sweep below 100%", parts or [_part(None)]))
    noise = noise_points(arms)
    if len(noise) >= 2:
        (lo, g_lo, c_lo), (hi, g_hi, c_hi) = noise[0], noise[-1]
        gains = compare_gains(arms, g_hi, c_hi, g_lo, c_lo)
        where = f" ({hi}% noise pages) than on the cleanest ({lo}%)"
    else:
        gains, where = None, " than on the cleanest"
    claims.append(claim(8, f"the gain of guided over cpt is larger on the noisiest student corpus{where}", [_part(gains)]))
    return claims


def seeds_needed(sd: float, delta: float, power: float = 0.8, level: float = LEVEL, max_n: int = 1000) -> int:
    """Smallest number of seeds whose paired t test (two-sided, ``level``) detects a true mean
    difference ``delta`` with probability about ``power``, given the sd of the paired differences:
    the smallest ``n`` with ``(t(level) + t(power)) * sd / sqrt(n) <= delta``, df = n - 1
    (:func:`detectable_difference` ``<= delta``).

    This is the rule the study stated before its pilots ran (conf/repro.yaml), kept rather than
    statsmodels' ``TTestPower.solve_power`` (exact noncentral-t power), which gives the same n for
    the pilots' sds where it converges but a wrong 2 at sd 0.0014 (power 0.57 there) and NaN below."""
    if sd <= 0 or delta <= 0:
        raise ValueError("sd and delta must be positive")
    for n in range(2, max_n + 1):
        if detectable_difference(sd, n, power, level) <= delta:
            return n
    return max_n


# --------------------------------------------------------------------------------------------
# Tables


def _ci_cell(iv: dict, digits: int = 4, pct: bool = False) -> str:
    if iv["n"] == 0:
        return "n/a"
    scale, unit = (100, "%") if pct else (1, "")
    if iv["ci"] is None:
        return f"{scale * iv['mean']:.{1 if pct else digits}f}{unit}"
    d = 1 if pct else digits
    return f"{scale * iv['mean']:.{d}f}{unit} [{scale * iv['ci'][0]:.{d}f}, {scale * iv['ci'][1]:.{d}f}]"


def _diff_cell(p: dict | None, claimed: int = -1) -> str:
    if p is None:
        return "n/a"
    ci = "" if p["ci"] is None else f" [{p['ci'][0]:+.4f}, {p['ci'][1]:+.4f}]"
    return f"{p['mean']:+.4f}{ci} ({verdict(p, claimed)})"


def table_markdown(arms: dict[str, ArmSummary], order: list[str]) -> str:
    lines = ["| arm | what | teacher | student | noise | held-out bits/byte ↓ (mean [95% CI]) | sd | kept share | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in order:
        if name not in arms:
            continue
        a = arms[name]
        iv, kept = a.interval("bpb"), a.interval("kept")
        lines.append(f"| {name} | {describe(name)} | {a.teacher} | {a.student} | {100 * a.noise_share:.0f}% | "
                     f"{_ci_cell(iv)} | {iv['sd']:.4f} | {kept['mean']:.3f} | {iv['n']} |")
    return "\n".join(lines)


def claims_markdown(claims: list[dict]) -> str:
    lines = ["| # | claim | verdict | evidence: A - B in bits/byte, mean, 95% CI, p, seeds |", "|---|---|---|---|"]
    for c in claims:
        evidence = "<br>".join(f"{e['text']}: {e['verdict']}" if e["text"] else e["verdict"] for e in c["evidence"])
        lines.append(f"| {c['claim']} | {c['text']} | **{c['verdict']}** | {evidence} |")
    return "\n".join(lines)


def summary_markdown(claims: list[dict]) -> str:
    """The short results table: one row per claim, with the paper's finding, our verdict and, per
    comparison it rests on, the seed-paired difference's 95% interval, p and number of seeds."""
    lines = ["| # | the paper's finding | our verdict | A - B in bits/byte: mean [95% CI] | p | seeds |",
             "|---|---|---|---|---|---|"]
    for c in claims:
        parts = [e for e in c["evidence"] if e["test"] is not None or e["comparison"] != "not run"] or c["evidence"][:1]
        named = len(parts) > 1
        cells = [[], [], []]
        for e in parts:
            p, label = e["test"], f"{e['comparison']}: " if named else ""
            if p is None:
                cells[0].append(f"{label}{e['verdict']}" if e["comparison"] != "not run" else "not run")
                cells[1].append("—")
                cells[2].append("—")
                continue
            ci = f"{p['mean']:+.4f}" + (" (one seed)" if p["ci"] is None else f" [{p['ci'][0]:+.4f}, {p['ci'][1]:+.4f}]")
            cells[0].append(f"{label}{ci}")
            cells[1].append("—" if p["p"] is None or math.isnan(p["p"]) else f"{p['p']:.2g}")
            cells[2].append(str(p["n"]))
        lines.append(f"| {c['claim']} | {c['text']} | **{c['verdict']}** | " + " | ".join("<br>".join(x) for x in cells) + " |")
    return "\n".join(lines)


def sweep_markdown(arms: dict[str, ArmSummary]) -> str:
    sweep = sweep_points(arms)
    if not sweep:
        return "(no sweep arms were run)"
    guided, random_ = dict(sweep.get("guided", [])), dict(sweep.get("random", []))
    lines = ["| kept ratio | guided bits/byte [95% CI] | random bits/byte [95% CI] | guided - cpt | random - cpt | "
             "guided - random | seeds: guided, random, guided - random |", "|---|---|---|---|---|---|---|"]
    for ratio in sorted(set(guided) | set(random_)):
        g, r = guided.get(ratio), random_.get(ratio)
        gi = _ci_cell(arms[g].interval()) if g else "n/a"
        ri = _ci_cell(arms[r].interval()) if r else "n/a"
        if ratio == 100:
            n = arms["cpt"].interval()["n"]
            lines.append(f"| 100% (cpt) | {gi} | {ri} | 0 | 0 | 0 | {n}, {n}, - |")
            continue
        gc = compare(arms, g, "cpt") if g else None
        rc = compare(arms, r, "cpt") if r else None
        gr = compare(arms, g, r) if g and r else None
        ns = ", ".join(str(x) for x in (arms[g].interval()["n"] if g else 0, arms[r].interval()["n"] if r else 0,
                                        gr["n"] if gr else 0))
        lines.append(f"| {ratio}% | {gi} | {ri} | {_diff_cell(gc)} | {_diff_cell(rc)} | {_diff_cell(gr)} | {ns} |")
    return "\n".join(lines)


def noise_markdown(arms: dict[str, ArmSummary], setup: dict) -> str:
    points = noise_points(arms)
    if not points:
        return "(no noise arms were run)"
    shares = {round(100 * v["noise_share"]): v.get("noise_char_share") for v in (setup.get("student_corpora") or {}).values()}
    lines = ["| noise pages | noise share of characters | guided bits/byte [95% CI] | cpt bits/byte [95% CI] | "
             "guided - cpt (verdict) | p | seeds |", "|---|---|---|---|---|---|---|"]
    for n, g, c in points:
        p = compare(arms, g, c)
        share = "n/a" if shares.get(n) is None else f"{100 * shares[n]:.1f}%"
        pv = "n/a" if p is None or math.isnan(p["p"]) else f"{p['p']:.2g}"
        lines.append(f"| {n}% | {share} | {_ci_cell(arms[g].interval())} | {_ci_cell(arms[c].interval())} | "
                     f"{_diff_cell(p)} | {pv} | {p['n'] if p else 0} |")
    return "\n".join(lines)


def answers_markdown(arms: dict[str, ArmSummary], order: list[str], base: dict) -> str:
    names = ("restate_bpb", "restate_choice", "arithmetic_bpb", "arithmetic_choice")
    lines = ["| arm | " + " | ".join(METRICS[m][0] + (" ↑" if METRICS[m][2] > 0 else " ↓") for m in names) + " |",
             "|---|" + "---|" * len(names)]
    for student, b in sorted(base.items()):
        ans = b.get("answers") or {}
        cells = []
        for m in names:
            kind, what = m.split("_")
            v = ans.get(kind, {}).get("bits_per_byte" if what == "bpb" else "choice_accuracy", math.nan)
            cells.append(f"{100 * v:.1f}%" if what == "choice" else f"{v:.4f}")
        lines.append(f"| base {student} (before training) | " + " | ".join(cells) + " |")
    for name in order:
        if name in arms:
            cells = [_ci_cell(arms[name].interval(m), pct=m.endswith("choice")) for m in names]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    pairs = [("guided", "cpt"), ("guided", "random"), ("bbpe_guided", "bbpe_cpt")]
    tests = []
    for a, b in pairs:
        for m in names:
            p = compare(arms, a, b, m)
            if p is not None:
                tests.append(f"| {a} - {b} | {METRICS[m][0]} | {fmt_test(p)} | {verdict(p, METRICS[m][2])} |")
    if tests:
        lines += ["", "| comparison | measure | A - B, 95% CI, p, seeds | verdict (better: lower bits/byte, higher accuracy) |",
                  "|---|---|---|---|", *tests]
    return "\n".join(lines)


def diagnosis_markdown(diagnosis: dict) -> str:
    if not diagnosis:
        return "(not measured)"
    lines = ["| student | page kind | token share | share of kept tokens | kept rate | mean student loss | "
             "mean teacher loss | excess loss: mean (q10, q50, q90) | mapped | mean IoS |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for student, d in sorted(diagnosis.items()):
        for kind, k in d["by_kind"].items():
            if k["tokens"] < 100:
                continue
            q = k["excess_quantiles"]
            ex = f"{k['excess_mean']:+.2f} ({q['q10']:+.2f}, {q['q50']:+.2f}, {q['q90']:+.2f})" if q else "n/a"
            lines.append(f"| {student} | {kind} | {100 * k['token_share']:.1f}% | {100 * k['kept_share_of_all_kept']:.1f}% | "
                         f"{100 * k['kept_rate']:.1f}% | {k['student_loss_mean']:.2f} | {k['teacher_loss_mean']:.2f} | {ex} | "
                         f"{100 * k['mapped_rate']:.1f}% | {k['ios_mean']:.3f} |")
    lines.append("")
    lines += [f"- {s}: {d['n_tokens']:,} tokens, {100 * d['mapped_share']:.2f}% mapped, mean IoS {d['ios_mean']:.3f}, "
              f"mean document IoU {d['doc_iou_mean']:.3f}, top {100 * d['ratio']:.0f}% kept" for s, d in sorted(diagnosis.items())]
    return "\n".join(lines)


def detectable_difference(sd: float, n: int, power: float = 0.8, level: float = LEVEL) -> float:
    """The true mean difference a two-sided ``level`` paired t interval over ``n`` seeds finds with
    probability about ``power``, given the sd of the paired differences:
    ``(t(level, n-1) + t(power, n-1)) * sd / sqrt(n)`` (the one-sided power quantile)."""
    if n < 2:
        return math.inf
    t_alpha = t_quantile(level, n - 1)  # the two-sided critical value
    t_beta = float(stats.t.ppf(power, n - 1))  # the one-sided power quantile
    return (t_alpha + t_beta) * sd / math.sqrt(n)


def sizing(setup: dict, arms: dict[str, ArmSummary]) -> list[dict]:
    """Per sized seed set (``power.sized``): each comparison's pilot sd, the seeds the rule asks
    for at the set's delta, the seeds the set has, and the sd and interval half-width achieved."""
    power = setup.get("power") or {}
    seed_sets = setup.get("seed_sets") or {}
    out = []
    for name, sized in (power.get("sized") or {}).items():
        rows = []
        for key, sd in sized["pilot_sd"].items():
            a, b = key.split(" - ", 1)
            p = compare(arms, a, b)
            half = None if p is None or p["ci"] is None else (p["ci"][1] - p["ci"][0]) / 2
            rows.append({"comparison": key, "pilot_sd": sd,
                         "seeds_needed": None if not sd else seeds_needed(sd, sized["delta"], power["power"]),
                         "achieved_sd": None if p is None else p["sd"], "achieved_n": 0 if p is None else p["n"],
                         "half_width": half})
        needed = [r["seeds_needed"] for r in rows if r["seeds_needed"]]
        n = len(seed_sets.get(name, []))
        worst = max((r["pilot_sd"] for r in rows if r["pilot_sd"]), default=None)
        out.append({"set": name, "claims": sized["claims"], "delta": sized["delta"], "pilot_seeds": sized["pilot_seeds"],
                    "pilot_note": sized.get("pilot_note", ""), "rows": rows, "seeds_needed": max(needed) if needed else None,
                    "fits": sized.get("fits"),
                    "seeds": n, "detectable_at_worst_sd": None if worst is None or n < 2 else
                    detectable_difference(worst, n, power["power"])})
    return out


SEQ_ARM = re.compile(r"^guided_r(\d+)_seq$")  # guided ranked per sequence, by ratio


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _num(x, digits: int = 2, sign: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _row_label(row: dict) -> tuple[str, str, str]:
    if row["ratio"] is None:
        return "all", "(random: in expectation)", "-"
    ranking = "per sequence" if row["rank_over"] == "sequence" else "micro-batch"
    who = "base student (start)" if row["when"] == "start" else f"{row['arm']}'s final student (end)"
    return f"{100 * row['ratio']:.0f}%", ranking, who


def seq_tests(arms: dict[str, ArmSummary]) -> list[dict]:
    """Per ratio with a per-sequence arm: guided (batch) - random, guided (sequence) - random and
    guided (sequence) - guided (batch), seed-paired."""
    out = []
    for name in sorted(arms, key=lambda n: int(SEQ_ARM.match(n).group(1)) if SEQ_ARM.match(n) else -1):
        m = SEQ_ARM.match(name)
        if not m:
            continue
        r = int(m.group(1))
        g, rnd = ("guided", "random") if r == 40 else (f"guided_r{r}", f"random_r{r}")
        out.append({"ratio": r, "batch_vs_random": compare(arms, g, rnd), "sequence_vs_random": compare(arms, name, rnd),
                    "sequence_vs_batch": compare(arms, name, g)})
    return out


def claim7_markdown(arms: dict[str, ArmSummary], sweep: dict) -> str:
    """Claim 7's explanation: what each guided selection takes at each ratio, what each student
    learned on unseen batches, and what per-sequence ranking changes."""
    if not sweep or not sweep.get("selection"):
        return "(not measured)"
    where = next(iter(sweep["per_seed"].values()))["where"]
    lines = [f"Measured on the {sweep['n_batches']} micro-batches (8 × 256 tokens) that follow each run's last trained "
             f"sample in the data order of sweep seed{'s' if len(sweep['seeds']) > 1 else ''} "
             f"{', '.join(str(s) for s in sweep['seeds'])} ({'unseen by every run' if where['unseen'] else 'the last batches of the stream: some were trained on'}), "
             "with the trainer's own selection function (pipeline/method/guided_loss.py `select_tokens`), ranked by the base student "
             "(the selection at the start) and by the arm's own final student (at the end); means over those seeds. "
             "*From math pages*: the share of the selected tokens on math pages (the rest are noise pages); *teacher / "
             "excess / student loss*: means over the selected tokens, in nats; *unmapped*: the share of the trained "
             "tokens that are unmapped (always trained under `include`); *documents*: the effective number of documents "
             "a micro-batch's selection comes from, exp(entropy); *top sequence*: the largest share of a micro-batch's "
             "selection in one of its 8 sequences; *top ids*: the share taken by the selection's 10 most frequent token ids.", "",
             "| ratio | ranking | ranked by | from math pages | selected rate: math / noise | teacher loss | excess loss | "
             "student loss | unmapped among trained | documents per batch | top sequence | top ids |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = sorted(sweep["selection"], key=lambda r: (-1 if r["ratio"] is None else r["ratio"], r["rank_over"] or "",
                                                     r["when"] == "end"))
    for r in rows:
        st = r["stats"]
        ratio, ranking, who = _row_label(r)
        lines.append(f"| {ratio} | {ranking} | {who} | {_pct(st['selected_share']['clean'])} | "
                     f"{_pct(st['selected_rate']['clean'])} / {_pct(st['selected_rate']['noise'])} | "
                     f"{_num(st['teacher_loss'])} | {_num(st['excess'], sign=True)} | {_num(st['student_loss'])} | "
                     f"{_pct(st['unmapped_share_of_trained'])} | {_num(st['docs_effective'], 1)} | "
                     f"{_pct(st['top_sequence_share'])} | {_pct(st['top_ids_share'])} |")
    learned = sweep.get("learned") or {}
    if learned:
        groups = list(learned["base"])
        sizes = sweep.get("group_tokens") or {}
        lines += ["", "What each student learned, on the same unseen batches: mean loss (nats per token) of the base student, "
                  "and each final student's change from it, by token group: math-page tokens in the base student's "
                  "guided top 10% (micro-batch ranking), in its top 10-40%, the other math-page tokens, and noise-page "
                  "tokens. Group sizes (tokens per seed): " + ", ".join(f"{g}: {sizes.get(g, 0):,.0f}" for g in groups) + ".", "",
                  "| student | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups),
                  "| base (before training) | " + " | ".join(_num(learned["base"][g], 3) for g in groups) + " |"]

        def order(name: str) -> tuple:
            a = arms.get(name)
            return (a.mode if a else name, a.ratio if a else 0, name)

        for name in sorted((n for n in learned if n != "base"), key=order):
            lines.append(f"| {name} | " + " | ".join(_num(learned[name][g] - learned["base"][g], 3, sign=True)
                                                    for g in groups) + " |")
    tests = seq_tests(arms)
    if tests:
        lines += ["", "Per-sequence ranking (`loss.rank_over=sequence`: k per sequence instead of k over the micro-batch), "
                  "held-out bits/byte, seed-paired (negative: the first arm better):", "",
                  "| ratio | guided (micro-batch) - random | guided (per sequence) - random | guided (per sequence) - guided (micro-batch) |",
                  "|---|---|---|---|"]
        for t in tests:
            lines.append(f"| {t['ratio']}% | {_diff_cell(t['batch_vs_random'])} | {_diff_cell(t['sequence_vs_random'])} | "
                         f"{_diff_cell(t['sequence_vs_batch'])} |")
    summary = claim7_summary(sweep, tests)
    if summary:
        lines += ["", summary]
    return "\n".join(lines)


def _find(sweep: dict, ratio: float | None, rank_over: str | None = "batch", when: str = "start") -> dict | None:
    for r in sweep["selection"]:
        if r["ratio"] is None and ratio is None:
            return r["stats"]
        if r["ratio"] is not None and ratio is not None and abs(r["ratio"] - ratio) < 1e-9 \
                and r["rank_over"] == rank_over and r["when"] == when:
            return r["stats"]
    return None


def claim7_summary(sweep: dict, tests: list[dict]) -> str:
    """The figures that answer "why does guidance lose at small ratios", in words (no verdict: the
    verdicts are claim 7's and the tables')."""
    lo, mid, every = _find(sweep, 0.1), _find(sweep, 0.4), _find(sweep, None)
    if not (lo and mid and every):
        return ""
    per_batch = next(iter(sweep["per_seed"].values()))["where"].get("sequences_per_batch", 8)
    text = [f"**In short.** At 10% the guided selection (micro-batch ranking, base student) takes "
            f"{_pct(lo['selected_share']['clean'])} of its tokens from math pages (40%: {_pct(mid['selected_share']['clean'])}; "
            f"all mapped tokens: {_pct(every['selected_share']['clean'])}); their mean teacher loss is "
            f"{_num(lo['teacher_loss'])} nats (40%: {_num(mid['teacher_loss'])}; all: {_num(every['teacher_loss'])}), their "
            f"student loss {_num(lo['student_loss'])} (40%: {_num(mid['student_loss'])}; all: {_num(every['student_loss'])}), "
            f"their excess loss {_num(lo['excess'], sign=True)} (40%: {_num(mid['excess'], sign=True)}). "
            f"It comes from {_num(lo['docs_effective'], 1)} effective documents per micro-batch (40%: "
            f"{_num(mid['docs_effective'], 1)}; all tokens: {_num(every['docs_effective'], 1)}), one sequence holding "
            f"{_pct(lo['top_sequence_share'])} of it (an even spread: {_pct(1 / per_batch)}), and its 10 most frequent token "
            f"ids make {_pct(lo['top_ids_share'])} of it (40%: {_pct(mid['top_ids_share'])}; all: {_pct(every['top_ids_share'])}). "
            f"Unmapped tokens are {_pct(lo['unmapped_share_of_trained'])} of what is trained at 10% "
            f"({_pct(mid['unmapped_share_of_trained'])} at 40%)."]
    learned = sweep.get("learned") or {}
    if "guided_r10" in learned and "random_r10" in learned:
        groups = list(learned["base"])
        g, r = learned["guided_r10"], learned["random_r10"]
        text.append("After training, relative to the base student, guided_r10 changed its loss by "
                    + ", ".join(f"{_num(g[k] - learned['base'][k], 3, sign=True)} ({k})" for k in groups)
                    + "; random_r10 by " + ", ".join(f"{_num(r[k] - learned['base'][k], 3, sign=True)} ({k})" for k in groups) + ".")
    t10 = next((t for t in tests if t["ratio"] == 10), None)
    if t10 and t10["sequence_vs_batch"] is not None:
        text.append(f"Ranking per sequence at 10%: guided (per sequence) - guided (micro-batch) = "
                    f"{_diff_cell(t10['sequence_vs_batch'])}; guided (per sequence) - random = {_diff_cell(t10['sequence_vs_random'])}.")
    return " ".join(text)


def power_markdown(setup: dict, arms: dict[str, ArmSummary]) -> str:
    power = setup.get("power") or {}
    if not power.get("sized"):
        return "(no power computation recorded)"
    pw = power["power"]
    lines = [f"Each sized seed set was fixed before its seeds ran: a pilot on seeds no set uses measured the sd of each "
             f"comparison's seed-paired differences, and the set gets the smallest n with (t(0.975, n-1) + t({pw}, n-1))·sd/√n "
             f"≤ δ for every comparison of its claims (power {pw:.0%} for a true difference δ, stated before the pilot ran). "
             + (f"The default study is budgeted at {power['max_runs']} student runs; where the sets being sized asked for "
                "more than the other arms leave, they shared what was left under one common cap (repro/power.py)."
                if power.get("max_runs") else ""), ""]
    for s in sizing(setup, arms):
        claims = ", ".join(str(c) for c in s["claims"])
        lines += [f"**Claim{'s' if len(s['claims']) > 1 else ''} {claims}** (seed set `{s['set']}`): δ = {s['delta']} bits/byte; "
                  f"pilot: {s['pilot_note'] or 'seeds ' + str(s['pilot_seeds'])}.", "",
                  "| comparison | pilot sd | seeds for power at δ | achieved sd (seeds) | 95% CI half-width |", "|---|---|---|---|---|"]
        for r in s["rows"]:
            lines.append(f"| {r['comparison']} | {'not run' if r['pilot_sd'] is None else format(r['pilot_sd'], '.4f')} | "
                         f"{r['seeds_needed'] or '-'} | "
                         + ("-" if r["achieved_sd"] is None or math.isnan(r["achieved_sd"]) else f"{r['achieved_sd']:.4f}")
                         + f" ({r['achieved_n']}) | " + ("-" if r["half_width"] is None else f"{r['half_width']:.4f}") + " |")
        need, n = s["seeds_needed"], s["seeds"]
        seeds = f"{n} seed{'s' if n != 1 else ''}"
        if need is None:
            lines += ["", f"No pilot sd recorded: the set has {seeds}, not sized by the rule."]
        elif n >= need:
            lines += ["", f"The rule asks for {need} seeds; the set has {n}."]
        else:
            why = (f"**only {n} fit in the study's time (power.max_runs) and ran**" if s["fits"] == n
                   else f"the set has {seeds} (fewer than the rule asks: set on the command line)")
            found = s["detectable_at_worst_sd"]
            lines += ["", f"The rule asks for {need} seeds; {why}: " + (
                "with fewer than two seeds there is no interval, so the set decides nothing." if found is None else
                f"with {seeds} and the largest pilot sd, the difference found with power {pw:.0%} is about "
                f"{found:.4f} bits/byte rather than {s['delta']}; smaller true differences mostly read as inconclusive.")]
        lines.append("")
    if power.get("settings_note"):
        lines.append(power["settings_note"])
    return "\n".join(lines).rstrip()


# --------------------------------------------------------------------------------------------
# Plots


def _band(ax, xs, ivs, color, label):
    means = [iv["mean"] for iv in ivs]
    lo = [iv["ci"][0] if iv["ci"] else iv["mean"] for iv in ivs]
    hi = [iv["ci"][1] if iv["ci"] else iv["mean"] for iv in ivs]
    ax.plot(xs, means, "o-", color=color, label=label)
    ax.fill_between(xs, lo, hi, color=color, alpha=0.2)


def plot_sweep(arms: dict[str, ArmSummary], path: Path) -> bool:
    """Held-out bits/byte against the kept ratio (guided, random; 100% is cpt) with 95% bands;
    the same as paired differences from cpt; guided - cpt against the noise share. False when
    there is nothing to plot."""
    sweep, noise = sweep_points(arms), noise_points(arms)
    if not sweep and not noise:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = {"guided": "tab:green", "random": "tab:orange"}
    for curve, points in sweep.items():
        _band(axes[0], [r for r, _ in points], [arms[n].interval() for _, n in points], colors[curve], curve)
        diffs = [(r, compare(arms, n, "cpt")) for r, n in points if n != "cpt"]
        diffs = [(r, {"mean": p["mean"], "ci": p["ci"]}) for r, p in diffs if p] + [(100, {"mean": 0.0, "ci": None})]
        _band(axes[1], [r for r, _ in diffs], [d for _, d in diffs], colors[curve], f"{curve} - cpt")
    axes[0].set_xlabel("tokens trained per batch (%); 100% = cpt")
    axes[0].set_ylabel("held-out bits per byte (lower is better)")
    axes[0].set_title("mean over seeds, 95% t band")
    axes[1].axhline(0, color="k", linewidth=0.8)
    axes[1].set_xlabel("tokens trained per batch (%)")
    axes[1].set_ylabel("arm - cpt, same seed (bits/byte)")
    axes[1].set_title("seed-paired difference from cpt, 95% band")
    if noise:
        ps = [(n, compare(arms, g, c)) for n, g, c in noise]
        ps = [(n, p) for n, p in ps if p]
        _band(axes[2], [n for n, _ in ps], [{"mean": p["mean"], "ci": p["ci"]} for _, p in ps], "tab:green", "guided - cpt")
        axes[2].axhline(0, color="k", linewidth=0.8)
    axes[2].set_xlabel("noise pages in the student corpus (%)")
    axes[2].set_ylabel("guided - cpt, same seed (bits/byte)")
    axes[2].set_title("gain from guidance vs corpus noise, 95% band")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_arms(arms: dict[str, ArmSummary], order: list[str], path: Path) -> None:
    """Each arm's bits per byte (mean and 95% interval, dots for seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in order if n in arms]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(names) + 1.5))
    for y, name in enumerate(names):
        iv = arms[name].interval()
        err = None if iv["ci"] is None else [[iv["mean"] - iv["ci"][0]], [iv["ci"][1] - iv["mean"]]]
        ax.barh(y, iv["mean"], xerr=err, color="tab:green" if "guided" in name else "tab:blue", alpha=0.6, capsize=3)
        ax.plot(arms[name].series(), [y] * iv["n"], "k.", markersize=3)
    values = [x for n in names for x in arms[n].series()]
    lo, hi = min(values), max(values)
    ax.set_xlim(lo - 0.1 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("held-out bits per byte (lower is better); bar: mean, 95% t interval; dots: seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Files


def portable(result: dict) -> dict:
    """A run's record without this machine's paths: the scored folder relative to the work folder."""
    out = {**result, "scored_folder": "/".join(Path(result["scored_folder"]).parts[-3:])}
    if "scored_folders" in result:
        out["scored_folders"] = ["/".join(Path(f).parts[-3:]) for f in result["scored_folders"]]
    return out


def _json_safe(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_report(results: list[dict], order: list[str], setup: dict, out_dir: Path,
                 diagnosis: dict | None = None, sweep_diagnosis: dict | None = None) -> dict:
    """``report.md`` (everything), ``report.json`` (every run and test), ``summary.md`` (the claims
    table alone) and the plots, in ``out_dir``; returns the JSON record."""
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = summarize(results)
    claims = check_claims(arms, results)
    has_sweep = plot_sweep(arms, out_dir / "sweep.png")
    plot_arms(arms, order, out_dir / "report.png")
    table, claim_table = table_markdown(arms, order), claims_markdown(claims)
    seed_sets = setup.get("seed_sets") or {}
    body = "\n".join([
        f"# Toy-scale reproduction ({setup['finished']})", "",
        f"`make repro`: {setup['n_runs']} student runs ({len(arms)} arms; seed sets "
        + ", ".join(f"{k}: {len(v)}" for k, v in seed_sets.items())
        + f"), {setup['train_tokens_per_run']:,} training tokens each; wall time {setup['seconds'] / 60:.1f} min on "
        f"{setup['machine']}, load average {setup.get('load_average_at_start')} at the start"
        + (f", {setup['load_average_during']['mean_1min']} on average over the run (1-minute load, sampled every "
           f"{setup['load_average_during']['every_s']:.0f} s; max {setup['load_average_during']['max_1min']})"
           if setup.get("load_average_during") else "")
        + (f" ({setup['runs_read_from_cache']} runs read from an earlier launch)" if setup.get("runs_read_from_cache") else "")
        + ".", "",
        *([f"**Partial report: {setup['n_runs']} of the {setup['runs_planned']} planned runs had finished.** "
           "Comparisons use the seeds both arms finished.", ""]
          if setup.get("runs_planned", setup["n_runs"]) > setup["n_runs"] else []),
        "## The rule", "", RULE, "",
        "## Claims", "", claim_table, "",
        "## Power", "", power_markdown(setup, arms), "",
        "## Selection-ratio sweep and corpus noise", "",
        *(["![sweep](sweep.png)", ""] if has_sweep else []),
        "Kept ratio: the share of mapped tokens trained per batch (guided: the top by excess loss; random: drawn "
        "uniformly). Differences are seed-paired, with their verdict for \"beats\" (negative is better).", "",
        sweep_markdown(arms), "",
        noise_markdown(arms, setup), "",
        "## Claim 7: what the guided selection takes at each ratio", "",
        claim7_markdown(arms, sweep_diagnosis or {}), "",
        "## Held-out answers", "",
        "Teacher-forced measures on held-out worked problems (one fixed set of 150 problems per kind for every run): "
        "the answer's bits per byte given the problem, and a three-way choice between the true answer and the same "
        "text with the operands a or b in place of the result (chance 33%). Mean [95% CI] over seeds.", "",
        answers_markdown(arms, order, setup.get("base_students") or {}), "",
        "## What the guided selection keeps, per student (base students, strong teacher, main corpus)", "",
        diagnosis_markdown(diagnosis or {}), "",
        "## Arms", "", table, "",
        "![arms](report.png)", "",
        "## Set-up", "", "```json", json.dumps(_json_safe(setup), indent=1), "```", "",
    ])
    (out_dir / "report.md").write_text(body)
    record = {"setup": setup, "rule": RULE, "claims": claims, "power_sizing": sizing(setup, arms), "diagnosis": diagnosis or {},
              "sweep_diagnosis": {k: v for k, v in (sweep_diagnosis or {}).items()}, "per_sequence": seq_tests(arms),
              "arms": {n: {"teacher": arms[n].teacher, "student": arms[n].student, "mode": arms[n].mode,
                           "ratio": arms[n].ratio, "noise_share": arms[n].noise_share,
                           **{m: arms[n].interval(m) for m in METRICS}} for n in order if n in arms},
              "runs": [portable(r) for r in results]}
    (out_dir / "report.json").write_text(json.dumps(_json_safe(record), indent=1, default=str) + "\n")
    write_summary(claims, setup, out_dir)
    return record


def write_summary(claims: list[dict], setup: dict, out_dir: Path) -> Path:
    """``summary.md``: what the run was, and :func:`summary_markdown`'s table."""
    partial = setup.get("runs_planned", setup["n_runs"]) > setup["n_runs"]
    during = setup.get("load_average_during")
    load = f", load average {during['mean_1min']} on average" if during else ""
    runs = (f"partial: {setup['n_runs']} of {setup['runs_planned']} planned runs" if partial
            else f"{setup['n_runs']} runs, {setup['seconds'] / 60:.1f} min{load}")
    path = out_dir / "summary.md"
    path.write_text("\n".join([
        f"# Toy-scale reproduction: the paper's findings ({setup['finished'][:10]})", "",
        f"{setup['machine']} ({runs}). A claim holds when the 95% interval of the seed-paired difference lies "
        "wholly on the claimed side of zero (negative: A better); the rule and every table: `report.md`.", "",
        summary_markdown(claims), ""]))
    return path
