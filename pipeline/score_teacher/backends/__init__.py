"""Teacher scoring backends behind one interface (:class:`pipeline.score_teacher.backends.base.WindowScorer`):
``hf`` (transformers), ``vllm``; :func:`pipeline.score_teacher.backends.factory.make_scorer` picks one."""
