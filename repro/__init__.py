"""``make repro``: does the teacher's guidance beat plain continual pretraining at toy scale, and
when? On a CPU, through the real pipeline (docs/METHOD.md §4.2).

The experiment (:mod:`repro.build`, :mod:`repro.evaluate`, :mod:`repro.diagnose`,
:mod:`repro.report`; driven by ``repro/__main__.py``; its design in ``conf/repro.yaml``, typed and
checked by :mod:`repro.config`; results in ``repro-results/``, the claims table in ``summary.md``):

* corpora drawn from the sample-corpus generator: the *student corpus* (math pages mixed with
  noise pages: boilerplate, random strings, broken markup, shuffled words), in variants by noise
  share; the *teacher corpus* (clean math pages only); *held-out* clean pages nobody trains on;
* a tiny byte-level-BPE teacher trained on the teacher corpus (a weak one for the ablations);
* two student tokenizers unlike the teacher's (a SentencePiece-style BPE with byte fallback, as
  Llama's, and a smaller byte-level BPE), each with a base student pretrained on a general
  math-and-noise mixture, which every arm continues to train (as the paper's TinyLlama is
  pretrained); seeds vary the data order and the random arm's selection;
* stage 1 (``run_score_job``, Ray, Parquet) scores each student corpus once per teacher; stage 2
  (``run_training``) trains every arm (loss mode and kept ratio, alignment, aggregation, unmapped
  policy, teacher, student, corpus) for the same number of training tokens from the same base;
* students are compared on the held-out pages in bits per UTF-8 byte (fair across tokenizers) and
  on the answers of held-out worked problems; every comparison is a seed-paired t test
  (:mod:`repro.stats`) and the verdicts follow the rule in the report module.

Everything is cached by content (builds, scored folders, finished runs), so an interrupted
``make repro`` picks up where it stopped.
"""
