"""``make export-student``: the student side of scored data, written for any trainer.

One or several scored folders (stage-1 output) are tokenized with a student tokenizer, aligned to
the teachers' tokens and combined (:mod:`pipeline.student_data.build`, the code stage 2 trains from), and
written as rows of ``input_ids`` beside the teacher's loss of every student token, packed to a
sequence length or one row per document: Parquet (any trainer, ``datasets``, Polars) and, on
request, Megatron-core's indexed dataset and litdata's chunks (:mod:`~pipeline.export_student.formats`).
The folder is written exactly once (:mod:`pipeline.folders.shard_folder`): a rerun skips the finished
shards and refuses a changed setting. docs/export.md says how each trainer reads it and how to call
the guided loss (:mod:`pipeline.method.guided_loss`) from its training step.
"""
