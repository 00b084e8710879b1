"""Teacher scoring backends behind one interface (:class:`pipeline.scoring.base.WindowScorer`)."""

from pipeline.scoring.base import ScorerConfig, WindowScorer, make_scorer  # noqa: F401
