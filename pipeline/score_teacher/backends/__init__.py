"""Teacher scoring backends behind one interface (:class:`pipeline.score_teacher.backends.base.WindowScorer`):
``hf`` (transformers), ``vllm``, ``server`` and ``rehearsal`` (a stand-in whose forward costs nothing);
:func:`pipeline.score_teacher.backends.factory.make_scorer` picks one."""
