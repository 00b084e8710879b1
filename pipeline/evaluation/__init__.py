"""Evaluation of any Hugging Face checkpoint (``make eval-student``): few-shot chain-of-thought math
accuracy (docs/METHOD.md §4.1) and held-out bits per byte; side-by-side comparison of results
(``make compare``).

* :mod:`~pipeline.evaluation.answers`: extracting, normalising and comparing final answers;
* :mod:`~pipeline.evaluation.tasks`: the task registry, local JSONL records, exemplars, prompts;
* :mod:`~pipeline.evaluation.generation`: greedy generation (transformers, or vLLM where installed);
* :mod:`~pipeline.evaluation.held_out`: which held-out text (text files, the shards a run held out) and reading it;
  the measure itself, per-text next-token loss, bytes and tokens and their statistics, is
  :mod:`pipeline.method.bits_per_byte`, which stage 2 also uses while training;
* :mod:`~pipeline.evaluation.run`: one evaluation, written as ``eval.json``, ``samples.jsonl``, ``eval.md``;
* :mod:`~pipeline.evaluation.compare`: several results as a table and a bar chart.
"""
