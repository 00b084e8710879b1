"""The several-teacher arms of ``make repro`` (docs/METHOD.md §2.6): the strong and the weak
teacher's losses combined per student token by each ``loss.combine`` mode, against the strong
teacher alone (the ``guided`` arm), with the report's paired t rule; and the stated rule that picks
the default mode. Written to ``teachers.md`` / ``teachers.json`` next to the main report.

The rule for the default: a mode replaces the current default only when ``mode - default``
(seed-paired held-out bits per byte) has a 95% interval wholly below zero; when several do, the
lowest mean difference wins; otherwise the default stays, and the report says that it stays as a
prior, not as a result. Only modes that work without per-teacher weights can be a default
(``weighted`` needs weights in the order of ``data.folders``), so ``weighted`` is compared and
reported but never picked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from repro.report import (  # noqa: F401  (detectable_difference: part of this module's interface)
    RULE,
    ArmSummary,
    _ci_cell,
    _json_safe,
    compare,
    detectable_difference,
    fmt_test,
    portable,
    summarize,
)
from repro.stats import HOLDS, verdict

BASELINE = "guided"  # the strong teacher alone
DEFAULT = "min"  # AlignmentConfig.combine's default when these arms were fixed
MODES = ("min", "mean", "max", "weighted")
CANDIDATES = ("min", "mean", "max")  # modes that need no per-teacher weights, so can be a default
PROTOCOL = ("Fixed before any of these runs: the arms, the seeds (the sweep set, shared with `guided` so that pairs "
            "form), the weights (0.75, 0.25) and the rule below (mode - `min` below zero with 95% confidence; the "
            "lowest mean among several). Written later, when two of the three seeds had finished: that only modes "
            "that need no weights can be the default (`weighted` cannot be a default value, as it needs the weights).")
PRIOR = ("`min` takes, per student token, the most confident teacher's loss as the reference, so where one "
         "teacher is clearly better it follows that teacher and a weaker one can only lower the reference where "
         "it is itself confident; the excess loss stays a measure against the best available teacher.")


def teacher_arms(results: list[dict]) -> dict[str, dict]:
    """``{arm: {"combine", "teacher_weights", "teacher"}}`` for the arms trained on several scored
    folders (one run of each arm is enough: an arm's settings are the same for every seed)."""
    out = {}
    for r in results:
        if len(r.get("scored_folders") or []) > 1:
            out.setdefault(r["arm"], {"combine": r["combine"], "teacher_weights": r.get("teacher_weights"),
                                      "teacher": r["teacher"]})
    return out


def choose_default(arms: dict[str, ArmSummary], by_mode: dict[str, str], current: str = DEFAULT) -> dict:
    """Apply the rule above: the tests ``mode - current`` and the mode it picks."""
    tests = {}
    if current in by_mode:
        for mode, arm in by_mode.items():
            if mode != current:
                tests[mode] = compare(arms, arm, by_mode[current])
    better = {m: p for m, p in tests.items() if m in CANDIDATES and verdict(p) == HOLDS}
    if better:
        mode = min(better, key=lambda m: better[m]["mean"])
        reason = (f"`{mode}` beats `{current}` by the rule (mean {better[mode]['mean']:+.4f} bits/byte, 95% CI "
                  f"[{better[mode]['ci'][0]:+.4f}, {better[mode]['ci'][1]:+.4f}])")
    elif not tests or all(p is None for p in tests.values()):
        mode, reason = current, f"no mode was compared with `{current}`; it stays, as a prior: {PRIOR}"
    else:
        mode = current
        run = {m: p for m, p in tests.items() if m in CANDIDATES and p is not None}
        worse = [m for m, p in run.items() if p["ci"] and p["ci"][0] > 0]
        open_ = [f"`{m}`" for m in run if m not in worse]
        reason = (f"no mode that needs no weights beats `{current}` by the rule, so `{current}` stays"
                  + (f"; it beats {', '.join(f'`{m}`' for m in worse)}, a result" if worse else "")
                  + (f"; against {', '.join(open_)} the comparison is inconclusive, so there it stays as a prior, "
                     f"not a result: {PRIOR}" if open_ else ""))
    return {"current": current, "default": mode, "changed": mode != current, "reason": reason,
            "tests": {m: p for m, p in tests.items()}}


def _mean_log(a: dict[str, list[float]], key: str) -> str:
    xs = [x for x in a.get(key, []) if x is not None and not math.isnan(x)]
    return "n/a" if not xs else f"{sum(xs) / len(xs):.3f}"


def write_teachers_report(results: list[dict], setup: dict, out_dir: Path) -> dict | None:
    """``teachers.md`` and ``teachers.json`` in ``out_dir``; None (and nothing written) when no
    several-teacher arm has a finished run."""
    combos = teacher_arms(results)
    if not combos:
        return None
    names = [BASELINE] + sorted(combos, key=lambda n: (MODES.index(combos[n]["combine"])
                                                      if combos[n]["combine"] in MODES else len(MODES), n))
    results = [r for r in results if r["arm"] in names]
    arms = summarize(results)
    by_mode = {combos[n]["combine"]: n for n in names[1:]}
    logs: dict[str, dict[str, list[float]]] = {}
    for r in results:
        last = r.get("last_log") or {}
        for key in ("decided_t0", "decided_t1", "selection_jaccard_t0_t1", "mapped_fraction_t0", "mapped_fraction_t1"):
            if key in last:
                logs.setdefault(r["arm"], {}).setdefault(key, []).append(float(last[key]))
    vs_strong = {n: compare(arms, n, BASELINE) for n in names[1:]}
    choice = choose_default(arms, by_mode)
    power = setup.get("power") or {}
    seeds = sorted({s for n in names[1:] if n in arms for s in arms[n].seeds})
    pilot = None
    main = (power.get("sized") or {}).get("main") or {}
    sd = (main.get("pilot_sd") or {}).get(f"{BASELINE} - cpt")
    if sd:
        pilot = {"sd": sd, "n": len(seeds), "power": power["power"], "note": main.get("pilot_note", "not described"),
                 "detectable": detectable_difference(sd, len(seeds), power["power"])}

    table = ["| arm | combine | weights (strong, weak) | held-out bits/byte ↓ (mean [95% CI]) | sd | kept share | "
             "strong's share of selected tokens | selection Jaccard strong/weak | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        if n not in arms:
            continue
        a, iv = arms[n], arms[n].interval()
        c = combos.get(n, {"combine": "(strong alone)", "teacher_weights": None})
        w = "" if not c["teacher_weights"] else ", ".join(f"{x:g}" for x in c["teacher_weights"])
        table.append(f"| {n} | {c['combine']} | {w} | {_ci_cell(iv)} | {iv['sd']:.4f} | {a.interval('kept')['mean']:.3f} | "
                     f"{_mean_log(logs.get(n, {}), 'decided_t0')} | {_mean_log(logs.get(n, {}), 'selection_jaccard_t0_t1')} | "
                     f"{iv['n']} |")
    strong_lines = ["| comparison | A - B in bits/byte, mean, 95% CI, p, seeds | verdict for \"the combination beats the "
                    "strong teacher alone\" |", "|---|---|---|"]
    for n, p in vs_strong.items():
        strong_lines.append(f"| {n} - {BASELINE} | {fmt_test(p)} | **{verdict(p)}** |")
    mode_lines = [f"| comparison | A - B in bits/byte, mean, 95% CI, p, seeds | verdict for \"beats `{choice['current']}`\" |",
                  "|---|---|---|"]
    for m, p in choice["tests"].items():
        mode_lines.append(f"| {by_mode[m]} - {by_mode[choice['current']]} | {fmt_test(p)} | **{verdict(p)}** |")
    power_text = "(no pilot sd recorded)"
    if pilot:
        power_text = (f"With the pilot's sd of a paired difference, {pilot['sd']:.4f} bits/byte (guided - cpt; the "
                      f"pilot: {pilot['note']}), {pilot['n']} seeds detect with power {pilot['power']:.0%} "
                      f"only a true difference of about {pilot['detectable']:.4f} bits/byte "
                      f"((t(0.975, n-1) + t({pilot['power']}, n-1))·sd/√n); smaller differences mostly read as inconclusive.")
        achieved = [f"{n} - {BASELINE}: sd {p['sd']:.4f}" for n, p in vs_strong.items() if p and p["n"] > 1]
        if achieved:
            power_text += " Achieved sd of the paired differences: " + "; ".join(achieved) + "."
    train_s = sum(r.get("train_seconds", 0) for r in results if r["arm"] in combos)
    body = "\n".join([
        f"# Several teachers: combining the strong and the weak teacher ({setup.get('finished', '')})", "",
        f"`make repro` arms {', '.join(names[1:])}: the student (spm) trained against the strong and the weak "
        "teacher's scored folders at once, their aligned losses combined per student token by `loss.combine` "
        "(docs/METHOD.md §2.6), each against the strong teacher alone (`guided`), with every other setting of "
        f"`guided`. Seeds {seeds}; {sum(1 for r in results if r['arm'] in combos)} several-teacher runs "
        f"({train_s / 60:.1f} min of training summed over runs); machine {setup.get('machine', '?')}"
        + (f"; this launch {setup['seconds'] / 60:.1f} min with {setup.get('runs_read_from_cache', 0)} of "
           f"{setup.get('runs_planned', '?')} runs read from earlier launches" if "seconds" in setup else "") + ".", "",
        PROTOCOL, "",
        "## The rule", "", RULE, "",
        "## Arms", "",
        "Strong's share of the selected tokens and the Jaccard index of the two teachers' own top selections are "
        "the trainer's per-teacher metrics at its last log (the last logging interval), averaged over seeds.", "",
        "\n".join(table), "",
        "## Against the strong teacher alone", "", "\n".join(strong_lines), "",
        "## The default `loss.combine`", "",
        f"Rule: a mode replaces `{choice['current']}` only when mode - `{choice['current']}` has a 95% interval "
        "wholly below zero; when several do, the lowest mean wins; otherwise it stays. Only "
        f"{', '.join(f'`{m}`' for m in CANDIDATES)} can be a default: `weighted` needs weights in the order of "
        "`data.folders`, so it is compared here but never picked.", "",
        "\n".join(mode_lines), "",
        f"**Default: `{choice['default']}`**: {choice['reason'].rstrip('.')}.", "",
        "## Power", "", power_text, "",
    ])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "teachers.md").write_text(body)
    record = {"finished": setup.get("finished"), "machine": setup.get("machine"), "rule": RULE, "seeds": seeds,
              "arms": {n: {**combos.get(n, {"combine": None, "teacher_weights": None, "teacher": "strong"}),
                           "bpb": arms[n].interval(), "per_teacher_last_log": logs.get(n, {})} for n in names if n in arms},
              "vs_strong": vs_strong, "default_choice": choice, "power": pilot,
              "runs": [portable(r) for r in results]}
    (out_dir / "teachers.json").write_text(json.dumps(_json_safe(record), indent=1, default=str) + "\n")
    return record
