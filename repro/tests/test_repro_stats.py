"""The statistics behind the repro verdicts, against published t tables and hand-worked numbers."""

from __future__ import annotations

import math
import random

import pytest
from scipy import stats

from repro.report import seeds_needed
from repro.stats import paired_test, t_central, t_quantile, t_two_sided_p, verdict, weakest

# t(0.975, df) from standard tables (e.g. NIST/SEMATECH e-Handbook, table 1.3.6.7.2)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 7: 2.365, 9: 2.262, 10: 2.228, 15: 2.131,
         20: 2.086, 30: 2.042, 100: 1.984}
T_95 = {1: 6.314, 2: 2.920, 5: 2.015, 10: 1.812, 30: 1.697}  # one-sided 95%: P(|T| <= t) = 0.90


@pytest.mark.parametrize("df, expected", sorted(T_975.items()))
def test_t_quantile_matches_the_table(df, expected):
    assert t_quantile(0.95, df) == pytest.approx(expected, abs=6e-4)


@pytest.mark.parametrize("df, expected", sorted(T_95.items()))
def test_t_quantile_other_levels(df, expected):
    assert t_quantile(0.90, df) == pytest.approx(expected, abs=6e-4)


def test_t_p_values_by_hand():
    assert t_two_sided_p(1.0, 1) == pytest.approx(0.5)  # Cauchy: P(|T| > 1) = 1/2
    assert t_two_sided_p(math.sqrt(2), 2) == pytest.approx(1 - math.sin(math.pi / 4))  # df 2: P(|T|<=t) = t/sqrt(2+t^2)
    assert t_two_sided_p(3.0, 2) == pytest.approx(1 - 3 / math.sqrt(11))
    assert t_two_sided_p(0.0, 7) == pytest.approx(1.0)
    assert t_two_sided_p(1.959964, 100000) == pytest.approx(0.05, abs=1e-4)  # the normal limit
    for df in (3, 4, 9, 30):  # consistent with the quantile
        assert t_central(t_quantile(0.95, df), df) == pytest.approx(0.95, abs=1e-9)
    with pytest.raises(ValueError, match="positive integer"):
        t_central(1.0, 0)


def test_paired_test_by_hand():
    # diffs -0.1, -0.2, -0.05: mean -0.11667, sd 0.076376, se 0.044096, t(0.975, 2) = 4.3027
    p = paired_test([-0.1, -0.2, -0.05])
    assert p["mean"] == pytest.approx(-0.116667, abs=1e-6)
    assert p["sd"] == pytest.approx(0.0763763, abs=1e-6)
    assert p["ci"] == pytest.approx([-0.116667 - 0.189733, -0.116667 + 0.189733], abs=1e-5)
    assert p["t"] == pytest.approx(-2.64575, abs=1e-4)
    assert p["p"] == pytest.approx(1 - 2.64575 / math.sqrt(2 + 2.64575 ** 2), abs=1e-5)  # df 2 closed form
    assert verdict(p) == "inconclusive"  # every seed agrees, yet three seeds cannot exclude zero
    one = paired_test([-0.3])
    assert one["ci"] is None and verdict(one) == "inconclusive"
    same = paired_test([-0.01] * 4)
    assert same["ci"] == pytest.approx([-0.01, -0.01]) and same["p"] == 0.0 and verdict(same) == "holds"
    assert paired_test([0.0, 0.0])["p"] == 1.0


def test_an_interval_over_eight_seeds_by_hand():
    # diffs 1..8: mean 4.5, squared deviations 42, sd sqrt(42 / 7) = sqrt(6), se sqrt(6 / 8) = 0.8660254;
    # t(0.975, df 7) = 2.364624 (printed tables), half-width 2.364624 * 0.8660254 = 2.047825;
    # t = 4.5 / 0.8660254 = 3 * sqrt(3) = 5.196152
    p = paired_test([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    assert t_quantile(0.95, 7) == pytest.approx(2.364624, abs=1e-6)
    assert (p["n"], p["df"], p["mean"], p["sd"]) == (8, 7, 4.5, pytest.approx(math.sqrt(6)))
    assert p["ci"] == pytest.approx([4.5 - 2.047825, 4.5 + 2.047825], abs=2e-6)
    assert p["t"] == pytest.approx(3 * math.sqrt(3))
    assert 0.001 < p["p"] < 0.002  # tables: t(0.999, 7) = 4.785 and t(0.9995, 7) = 5.408 bracket 5.196


def test_seeds_needed_against_the_textbook_figure():
    """G*Power's one-sample (paired) t test at effect size d = 0.5, two-sided alpha 0.05, power 0.80
    asks for n = 34 (actual power 0.8078, from the noncentral t); the rule, in units of the sd,
    gives the same, and the noncentral t (scipy) puts 33 seeds below 80%."""
    assert seeds_needed(1.0, 0.5) == 34

    def exact_power(d: float, n: int) -> float:
        crit, nc = stats.t.ppf(0.975, n - 1), d * math.sqrt(n)
        return stats.nct.sf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc)

    assert exact_power(0.5, 34) == pytest.approx(0.8078, abs=1e-4)
    assert exact_power(0.5, 33) < 0.8
    for sd in (0.0134, 0.0158, 0.0142, 0.0041, 0.0053):  # the pilots' sds: the rule's n has the power it promises
        n = seeds_needed(sd, 0.01)
        assert exact_power(0.01 / sd, n) >= 0.8 > exact_power(0.01 / sd, n - 1)


@pytest.mark.parametrize("ci, claimed, expected", [
    ([-0.3, -0.1], -1, "holds"), ([0.1, 0.3], -1, "does not hold"), ([-0.1, 0.1], -1, "inconclusive"),
    ([-0.1, 0.0], -1, "inconclusive"), ([0.1, 0.3], +1, "holds"), ([-0.3, -0.1], +1, "does not hold"),
])
def test_verdict_rule(ci, claimed, expected):
    assert verdict({"ci": ci}, claimed) == expected


def test_verdict_of_a_missing_comparison():
    assert verdict(None) == "not run"


@pytest.mark.parametrize("parts, expected", [
    (["holds", "holds"], "holds"), (["holds", "inconclusive"], "inconclusive"),
    (["holds", "does not hold"], "does not hold"), (["inconclusive", "does not hold"], "does not hold"),
    (["holds", "not run"], "inconclusive"), (["not run"], "not run"), ([], "not run"),
])
def test_a_claim_is_never_upgraded(parts, expected):
    assert weakest(parts) == expected


def test_seeds_needed_gives_the_power_it_promises():
    """Simulated paired differences (normal, mean delta): with the computed n the 95% interval
    excludes zero in about 80% of experiments, with far fewer seeds clearly less often."""
    sd, delta = 0.0134, 0.01
    n = seeds_needed(sd, delta, power=0.8)
    assert 14 <= n <= 18  # normal approximation: (1.96 + 0.84)^2 * 1.34^2 = 14.1, plus the t correction
    rng = random.Random(0)

    def power(k: int) -> float:
        hits = sum(verdict(paired_test([rng.gauss(delta, sd) for _ in range(k)]), claimed=+1) == "holds"
                   for _ in range(3000))
        return hits / 3000

    assert 0.75 <= power(n) <= 0.9
    assert power(max(3, n // 2)) < 0.6
    # by hand, n = 2 (df 1): (12.706 + t(0.80 one-sided, 1) = 1.376) * 0.001 / sqrt(2) = 0.00996 <= 0.01
    assert seeds_needed(0.001, 0.01) == 2
    assert seeds_needed(0.00101, 0.01) == 3  # 0.01006 > 0.01 at n = 2
    with pytest.raises(ValueError):
        seeds_needed(0.0, 0.01)
