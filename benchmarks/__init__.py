"""``make bench``: the project's performance figures, each measured as a ratio inside one run.

Every figure compares two sides measured in the same process (or the same run), interleaved
(A B B A A B ...) and repeated, so that a machine shared with other work slows both sides alike;
the figure is the median over the repetitions of the per-repetition ratio, with its spread.
Single-threaded sides are compared by process CPU time (what the work costs, undisturbed by
time-slicing on a shared machine); multi-process and multi-threaded sides by wall time.

Cases (module ``benchmarks.<case>`` each, a pure function from its typed config to a result dict;
the settings and their defaults: :mod:`benchmarks.config`):

=================  ==========================================================================
case               what it measures
=================  ==========================================================================
``alignment``      time to align / time to tokenize with the student, real tokenizers, >= 1 MiB
                   of math text (:mod:`benchmarks.alignment`); and the same documents through
                   a FuseLLM-style minimum-edit-distance DTW alignment (:mod:`benchmarks.dtw`)
``stage1``         tokens/s of the whole ``score-teacher`` Ray job / tokens/s of a bare forward of
                   the same teacher over the same batches (:mod:`benchmarks.stage1`)
``storage``        bytes on disk per teacher token, default and compact settings
                   (:mod:`benchmarks.storage`)
``guided_loss``    one training step with the guided loss / with plain cross-entropy
                   (:mod:`benchmarks.guided_loss`)
``student_data``   tokens/s of read + tokenize + align + pack / tokens/s of tokenization alone
                   (:mod:`benchmarks.student_data`)
``memory``         peak RSS at 10x the corpus / at 1x, per stage and for inspection, each run in
                   its own process (:mod:`benchmarks.memory`)
``teachers``       CPU time of the student data pipeline with two teachers / with one, the same
                   samples (:mod:`benchmarks.teachers`)
``vllm_backend``   the vLLM backend against the transformers backend on the same windows: tokens/s
                   in steady state, start-up, peak memory; in ``.venv-vllm`` (skipped without it)
                   (:mod:`benchmarks.vllm_backend`)
``export``         student tokens per CPU-second of ``make export-student`` / of tokenization alone,
                   bytes per student token of each format, peak RSS at several shards / one
                   (:mod:`benchmarks.export`)
``export_data``    stage 2's samples per CPU-second read from an export (``data.export``) / aligned
                   from the scored folders, identical batches (:mod:`benchmarks.export_data`)
``served_teacher`` a teacher served by vLLM's OpenAI-compatible server against the in-process engine on
                   the same windows: tokens/s, the requests in flight that saturate the server; in
                   ``.venv-vllm`` (skipped without it) (:mod:`benchmarks.served_teacher`)
``held_out_eval``  held-out bits per byte / a bare forward of the same batches (tokens/s), and what
                   ``train.eval_every`` costs at the embedded recipe's settings
                   (:mod:`benchmarks.held_out_eval`)
``threads``        a training step of the tiny teacher's shape in every usable core's thread / in one
                   thread, on the machine as it is and beside a busy process (:mod:`benchmarks.threads`)
=================  ==========================================================================

:mod:`benchmarks.gpu` is the GPU part (``make gpu-bench``: 7B teacher scoring, 1.1B training
step, data pipeline per core), an entry point of its own (``conf/gpu_bench.yaml``) that needs only
torch, transformers, accelerate, pyarrow, Hydra and OmegaConf.

Nothing here is a test: ``benchmarks/tests/test_bench.py`` only runs tiny sizes and checks the report's shape.
"""

CASES = ("alignment", "stage1", "storage", "guided_loss", "student_data", "memory", "teachers", "export",
         "vllm_backend", "served_teacher",
         "export_data", "held_out_eval", "threads")
