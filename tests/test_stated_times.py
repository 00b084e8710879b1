"""The time the full toy reproduction takes, as ``make help``, the development page and the README
state it, against the wall time the latest report measured."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_stated_time_of_make_repro_is_the_measured_one():
    measured = json.loads((REPO / "repro-results" / "report.json").read_text())["setup"]["seconds"] / 60
    shown = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    stated = {
        "make help": re.search(r"make repro .*?~(\d+) min", shown),
        "docs/development.md": re.search(r"make repro +# the full study: \d+ runs, about (\d+) minutes",
                                         (REPO / "docs" / "development.md").read_text()),
        "README.md": re.search(r"`make repro`: \d+ runs, (\d+) min from nothing", (REPO / "README.md").read_text()),
    }
    assert all(stated.values()), {k: bool(v) for k, v in stated.items()}
    for where, match in stated.items():
        stated_min = int(match.group(1))
        assert abs(stated_min - measured) <= 0.1 * measured, f"{where}: {stated_min} min, measured {measured:.1f}"
