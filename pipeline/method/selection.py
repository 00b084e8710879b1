"""How the teacher-guided loss selects the tokens it trains on (docs/METHOD.md §2.2, §2.3): the
settings alone, without torch, so that a command checks them before it imports anything heavy.
The loss itself: :mod:`pipeline.method.guided_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.runtime.config import check_choice, refuse

MODES = ("guided", "cpt", "random")
RANK_OVER = ("batch", "sequence")
UNMAPPED = ("include", "exclude")


@dataclass(frozen=True)
class SelectionConfig:
    """How tokens are selected (docs/METHOD.md §2.2, §2.3); the defaults are the paper's best setting."""

    mode: str = "guided"  # guided | cpt (every token) | random (k% at random)
    ratio: float = 0.4  # top-k share of the mapped tokens
    rank_over: str = "batch"  # batch (as Rho-1) | sequence
    unmapped: str = "include"  # include (always trained) | exclude

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "mode", self.mode, MODES)
        check_choice(found, "rank_over", self.rank_over, RANK_OVER)
        check_choice(found, "unmapped", self.unmapped, UNMAPPED)
        if not 0.0 < self.ratio <= 1.0:
            found.append(f"ratio: {self.ratio} is not in (0, 1]")
        return found

    def __post_init__(self) -> None:
        refuse(self)
