"""``make help`` lists every target the Makefile declares, each with its line of explanation."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_make_help_lists_every_phony_target_with_a_line():
    makefile = (REPO / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    shown = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    listed = dict(re.findall(r"^  make (\S+)\s+(.+)$", shown, re.M))
    assert sorted(listed) == sorted(phony), "every .PHONY target, and only those, in make help"
    assert all(len(text) > 10 for text in listed.values())
    plain = subprocess.run(["make", "-s"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert plain == shown, "make alone shows the help"
