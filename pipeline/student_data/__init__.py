"""The student's data: scored text tokenized with the student's tokenizer, its tokens aligned to
one or several teachers' (:mod:`.student_side`, :mod:`.several_teachers`), packed into training
sequences, and the shards held out of training for evaluation (:mod:`.held_out_shards`). Shared by
stage 2 and the export.

It may import :mod:`pipeline.runtime`, :mod:`pipeline.method` and the contract; not the folders'
records (beside it, on the same floor) nor any stage.
"""
