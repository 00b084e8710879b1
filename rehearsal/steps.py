"""The rehearsal's own steps, each run as a child process so that it is measured alone
(``python -m rehearsal.steps <step> <json arguments>``; the result is the last line, ``RESULT <json>``):

* ``corpus``: :func:`rehearsal.corpus.build_corpus` of a fraction;
* ``count``: stage 2's first count of student tokens (:func:`pipeline.student_data.lengths.measure_documents`,
  the pass rank 0 runs before training) with ``data.length_workers`` processes, into the length
  cache the training run then finds.
"""

from __future__ import annotations

import json
import sys
import time


def corpus(args: dict) -> dict:
    from pipeline.method.tokenization import load_tokenizer
    from rehearsal.corpus import build_corpus

    return build_corpus(args["out"], args["fraction"], load_tokenizer(args["teacher_tokenizer"]), seed=args["seed"],
                        pool_pages=args["pool_pages"])


def count(args: dict) -> dict:
    from pipeline.student_data.lengths import measure_documents
    from pipeline.method.tokenization import load_tokenizer
    from storage_schemas.reader import open_scored_dataset

    tokenizer = load_tokenizer(args["student_tokenizer"])
    dataset = open_scored_dataset([args["scored"]])
    t0 = time.perf_counter()
    _, lengths = measure_documents(dataset, tokenizer, args["cache_dir"], num_proc=args["workers"])
    seconds = time.perf_counter() - t0
    tokens = int(sum(int(x.sum()) for x in lengths))
    return {"student_tokens": tokens, "documents": int(sum(x.size for x in lengths)), "count_seconds": seconds,
            "workers": args["workers"], "tokens_per_s": tokens / seconds}


STEPS = {"corpus": corpus, "count": count}


def main(argv: list[str]) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    result = STEPS[argv[0]](json.loads(argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
