"""Few-shot chain-of-thought math evaluation of any Hugging Face checkpoint (``make eval-student``)
and side-by-side comparison of results (``make compare``); docs/METHOD.md §4.1.

* :mod:`~pipeline.evaluation.answers`: extracting, normalising and comparing final answers;
* :mod:`~pipeline.evaluation.tasks`: the task registry, local JSONL records, exemplars, prompts;
* :mod:`~pipeline.evaluation.generation`: greedy generation (transformers, or vLLM where installed);
* :mod:`~pipeline.evaluation.run`: one evaluation, written as ``eval.json``, ``samples.jsonl``, ``eval.md``;
* :mod:`~pipeline.evaluation.compare`: several results as a table and a bar chart.
"""
