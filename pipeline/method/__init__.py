"""The method itself, as docs/METHOD.md states it: tokenization with character offsets
(:mod:`.tokenization`), the teacher's windows over long documents (:mod:`.windows`), the alignment
of student tokens to teacher tokens (:mod:`.alignment`), the top-k% teacher-guided loss
(:mod:`.guided_loss`; its settings, without torch: :mod:`.selection`), and the measures of a model and of scores (:mod:`.bits_per_byte`,
:mod:`.loss_histogram`).

It may import :mod:`pipeline.runtime` and the contract (``storage_schemas``), nothing else of the
project: the method reads no folder layout and knows no stage.
"""
