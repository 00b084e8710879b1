"""Teacher scoring backends behind one interface (:class:`pipeline.score_teacher.backends.base.WindowScorer`)."""

from pipeline.score_teacher.backends.base import ScorerConfig, WindowScorer, make_scorer  # noqa: F401
