"""pipeline.runtime.config: defaults as a config file writes them, and build() reporting every problem."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.runtime.config import build, defaults, nearest


@dataclass(frozen=True)
class Shape:
    hidden: int = 64
    layers: int = 2


@dataclass(frozen=True)
class Case:
    name: str = "a"
    model: Shape = field(default_factory=lambda: Shape(hidden=256))  # an instance with its own values
    plain: Shape = field(default_factory=Shape)
    sizes: tuple[int, ...] = (1, 2)

    def problems(self) -> list[str]:
        return [] if self.model.hidden > 0 else [f"model: hidden {self.model.hidden} must be > 0"]


def test_defaults_of_a_nested_instance_are_its_own_values():
    assert defaults(Case) == {"name": "a", "model": {"hidden": 256, "layers": 2},
                              "plain": {"hidden": 64, "layers": 2}, "sizes": (1, 2)}


def test_build_reports_every_problem_with_the_nearest_key():
    problems: list[str] = []
    built = build(Case, {"nme": "b", "model": {"hiden": 3, "layers": "x"}, "sizes": [1, 2]}, "case", problems)
    assert built is None
    assert problems == [
        "case.nme: unknown key; did you mean name? (known: model, name, plain, sizes)",
        "case.model.hiden: unknown key; did you mean hidden? (known: hidden, layers)",
        "case.model.layers: 'x' is not an integer",
    ]


def test_nearest_says_nothing_for_a_word_unlike_any():
    assert nearest("windw", ["window", "stride"]) == "; did you mean window?"
    assert nearest("zzz", ["window", "stride"]) == ""
