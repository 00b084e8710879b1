"""How many seeds each sized seed set gets: its pilot's paired sds, the power rule, the study's time.

``make repro ARGS="pilot=true"`` runs the arms of every sized seed set (``power.sized`` in
conf/repro.yaml) on the set's pilot seeds, which no seed set uses, and :func:`pilot_record` turns
the results into ``repro-results/pilot.json``: for each comparison its seed-paired differences and
their sd, and the seeds the power rule (:func:`repro.report.seeds_needed`) asks for at the set's
``delta``, stated before the pilot ran. A set gets the most its comparisons ask for. Where the
runs all sets ask for exceed ``power.max_runs`` (what the default study's time allows), the sets
being sized share what the other arms leave under one common cap (:func:`allot_seeds`); the report
then says how many seeds the rule asked for and how many ran.
"""

from __future__ import annotations

import math
import statistics

from repro.report import seeds_needed

SD_DIGITS = 4  # the sd is recorded in conf/repro.yaml with 4 decimals; the seed count is computed from that


def paired_sd(results: list[dict], a: str, b: str) -> dict | None:
    """The seed-paired differences ``a - b`` of held-out bits per byte over the seeds both ran,
    their mean and sd (None with fewer than two such seeds)."""
    va = {r["seed"]: r["bits_per_byte"] for r in results if r["arm"] == a}
    vb = {r["seed"]: r["bits_per_byte"] for r in results if r["arm"] == b}
    seeds = sorted(set(va) & set(vb))
    if len(seeds) < 2:
        return None
    diffs = [va[s] - vb[s] for s in seeds]
    return {"seeds": seeds, "diffs": diffs, "mean": statistics.fmean(diffs), "sd": statistics.stdev(diffs)}


def allot_seeds(needed: dict[str, int], arms: dict[str, int], budget: int, floor: int = 2) -> tuple[dict[str, int], int | None]:
    """Seeds per set: each set's ``needed`` when ``sum(arms[s] * needed[s])`` fits in ``budget``
    runs; otherwise ``min(needed[s], cap)`` with the largest common ``cap`` (at least ``floor``)
    that fits. Returns the seeds per set and the cap (None when nothing was capped)."""
    if sum(arms[s] * n for s, n in needed.items()) <= budget:
        return dict(needed), None
    cap = floor
    while cap < max(needed.values()) and sum(arms[s] * min(n, cap + 1) for s, n in needed.items()) <= budget:
        cap += 1
    return {s: max(floor, min(n, cap)) for s, n in needed.items()}, cap


def pilot_record(results: list[dict], study, runs_per_set: dict[str, int], other_runs: int,
                 limits: dict[str, int] | None = None) -> dict:
    """``pilot.json``'s content: the pilot's runs, each sized set's comparisons (differences, sd,
    seeds needed) and the seeds allotted to the sets not sized before (those with a null sd in
    conf/repro.yaml). ``runs_per_set``: arms per sized set; ``other_runs``: the default study's
    runs outside the sets being sized; ``limits``: the most seeds a set can pair (the size of the
    set its comparisons share an arm with)."""
    power = study.power
    sets, pending = {}, {}
    for name, sized in power.sized.items():
        comparisons = {}
        for a, b in sized.comparisons():
            p = paired_sd(results, a, b)
            if p is not None:
                sd = round(p["sd"], SD_DIGITS)
                p |= {"sd_recorded": sd, "seeds_needed": seeds_needed(sd, sized.delta, power.power) if sd > 0 else 2}
            comparisons[f"{a} - {b}"] = p
        found = [c["seeds_needed"] for c in comparisons.values() if c]
        sets[name] = {"claims": list(sized.claims), "delta": sized.delta, "pilot_seeds": list(sized.pilot_seeds),
                      "comparisons": comparisons, "seeds_needed": max(found) if found else None,
                      "sized_before": all(v is not None for v in sized.pilot_sd.values())}
        if not sets[name]["sized_before"] and found:
            limit = (limits or {}).get(name)
            pending[name] = max(found) if limit is None else min(max(found), limit)
            sets[name]["pairs_with_at_most"] = limit
    allotted, cap = {}, None
    if pending:
        budget = (power.max_runs if power.max_runs is not None else math.inf) - other_runs
        allotted, cap = allot_seeds(pending, {s: runs_per_set[s] for s in pending}, budget) if budget != math.inf \
            else (dict(pending), None)
    for name, n in allotted.items():
        sets[name]["seeds_allotted"] = n
    return {
        "what": "pilots for the power computation (make repro ARGS=\"pilot=true\"): every sized seed set's arms on "
                "its pilot seeds, which no seed set of the study uses; sd recorded with 4 decimals, seeds from that",
        "power": power.power, "max_runs": power.max_runs, "runs_outside_the_sets_sized_now": other_runs,
        "common_cap": cap, "sets": sets,
        "runs": [{k: r[k] for k in ("arm", "seed", "bits_per_byte", "steps", "tokens_trained")}
                 for r in sorted(results, key=lambda r: (r["arm"], r["seed"]))],
    }
