"""How the teacher-guided loss selects the tokens it trains on (docs/METHOD.md §2.2, §2.3): the
settings alone, without torch, so that a command checks them before it imports anything heavy.
The loss itself: :mod:`pipeline.method.guided_loss`.

Besides the method (``guided``: the excess loss ``l_s - L_t``) and its controls (``cpt``, ``random``),
the two halves of its score can be ranked alone, to tell which half helps: ``student_loss`` takes the
mapped tokens the student finds hardest (its own loss ``l_s``, highest first) and ``teacher_loss`` those
the teacher finds easiest (``L_t``, lowest first). ``byte_fallback=exclude`` keeps a student
tokenizer's byte-fallback pieces (``<0x41>``) out of the ranking: they are then treated as unmapped
tokens (trained always with ``unmapped=include``, never with ``exclude``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.runtime.config import check_choice, refuse

MODES = ("guided", "cpt", "random", "student_loss", "teacher_loss")
RANK_OVER = ("batch", "sequence")
UNMAPPED = ("include", "exclude")
BYTE_FALLBACK = ("rank", "exclude")


@dataclass(frozen=True)
class SelectionConfig:
    """How tokens are selected (docs/METHOD.md §2.2, §2.3); the defaults are the paper's best setting."""

    mode: str = "guided"  # guided | cpt (every token) | random (k% at random) | student_loss | teacher_loss
    ratio: float = 0.4  # top-k share of the mapped tokens
    rank_over: str = "batch"  # batch (as Rho-1) | sequence
    unmapped: str = "include"  # include (always trained) | exclude
    byte_fallback: str = "rank"  # rank (byte-fallback pieces ranked as any token) | exclude (treated as unmapped)

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "mode", self.mode, MODES)
        check_choice(found, "rank_over", self.rank_over, RANK_OVER)
        check_choice(found, "unmapped", self.unmapped, UNMAPPED)
        check_choice(found, "byte_fallback", self.byte_fallback, BYTE_FALLBACK)
        if not 0.0 < self.ratio <= 1.0:
            found.append(f"ratio: {self.ratio} is not in (0, 1]")
        return found

    def __post_init__(self) -> None:
        refuse(self)
