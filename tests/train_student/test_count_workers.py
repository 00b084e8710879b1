"""Stage 2's first count of student tokens with several processes (``data.length_workers``): each
worker gets the tokenizer once, and the counts equal a brute-force count of every document."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from pipeline.student_data.lengths import measure_documents
from pipeline.method.tokenization import load_tokenizer
from storage_schemas.reader import open_scored_dataset


def test_counts_with_two_workers_equal_a_brute_force_count(micro_scored, tiny_student, tmp_path):
    tokenizer = load_tokenizer(str(tiny_student))
    dataset = open_scored_dataset([micro_scored])
    _, counted = measure_documents(dataset, tokenizer, tmp_path / "lengths", num_proc=2)
    for shard, counts in zip(dataset.shards, counted):
        texts = pq.read_table(shard.path, columns=["text"]).column("text").to_pylist()
        expected = [len(tokenizer(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]) for t in texts]
        np.testing.assert_array_equal(counts, np.asarray(expected, dtype=np.int32))
    assert len(list((tmp_path / "lengths").rglob("*.npy"))) == len(dataset.shards)
