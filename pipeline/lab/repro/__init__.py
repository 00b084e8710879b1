"""``make repro``: the paper's qualitative claims at toy scale, on a CPU, through the real pipeline
(docs/METHOD.md §4.2).

The experiment (:mod:`pipeline.lab.repro.build`, :mod:`pipeline.lab.repro.evaluate`,
:mod:`pipeline.lab.repro.report`; driven by ``stages/repro.py`` with ``conf/repro.yaml``):

* three corpora drawn from the sample-corpus generator with different seeds: the *student corpus*
  (math pages mixed with a large share of noise pages: boilerplate, random strings, broken
  markup, shuffled words), the *teacher corpus* (clean math pages only) and a *held-out* set of
  clean math pages that nobody trains on;
* two teachers with a byte-level BPE vocabulary, trained on the teacher corpus for few (weak) or
  many (strong) steps;
* two student tokenizers unlike the teacher's (a SentencePiece-style BPE with byte fallback, as
  Llama's, and a smaller byte-level BPE), each with a base student pretrained on a general
  math-and-noise mixture, which every arm continues to train (as the paper's TinyLlama is
  pretrained); seeds vary the data order and the random arm's selection;
* stage 1 (``run_score_job``, Ray, Parquet) scores the student corpus once per teacher; stage 2
  (``run_training``) trains every arm (loss mode, alignment, aggregation, unmapped policy,
  teacher, student) for the same number of training tokens from the same base
  (docs/METHOD.md §2.2, §2.3);
* students are compared on the held-out clean pages in bits per UTF-8 byte (fair across
  tokenizers) and on exact-match completions of worked arithmetic problems.

Everything is cached by content (builds, scored folders, finished runs), so an interrupted
``make repro`` picks up where it stopped.
"""
