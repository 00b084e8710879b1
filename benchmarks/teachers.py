"""Two teachers against one: the cost of the student data pipeline (docs/METHOD.md §2.6).

The first ``max_shards`` shards of a real scored dataset are written again, through the stage-1
writer, as two teachers' folders over the same documents: ``bench-a`` (the losses as stored) and
``bench-b`` (each document's losses reversed, so the teachers disagree). With the real student
tokenizer, single-threaded and compared by process CPU time, interleaved:

* ``one``: every packed sample of the one-teacher :class:`pipeline.student_data.dataset.PackedDataset`
  (``bench-a`` alone) read through a ``DataLoader`` in batches of ``batch_size`` samples, the plan
  built beforehand (the steady state of training);
* ``two``: the same with both teachers: each document is read and aligned once per teacher and
  the losses combined (``combine``), tokenized once;
* ``one_cold``/``two_cold``: a first run, everything included: opening the folders,
  ``build_student_data`` with an empty length cache (for two teachers also the matching pass
  over both teachers' documents) and then every sample.

Figure: CPU time of ``two`` / CPU time of ``one`` (the same samples delivered); the cold ratio is in
the note and the JSON.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.measure import interleaved, ratio
from benchmarks.results import figure
from benchmarks.student_data import StudentDataBenchConfig, read_packed
from pipeline.runtime.config import check_choice
from pipeline.student_data.several_teachers import COMBINATIONS


@dataclass(frozen=True)
class TeachersBenchConfig(StudentDataBenchConfig):
    """The student-data case's settings, with the combination and this case's target."""

    combine: str = "min"
    target: float = 1.3

    def problems(self) -> list[str]:
        problems = super().problems()
        check_choice(problems, "combine", self.combine, COMBINATIONS)
        return problems


def write_teacher(source, shards, folder: Path, name: str, reverse: bool) -> Path:
    """``shards`` of ``source`` written again under teacher ``name`` (losses reversed per document
    if ``reverse``) with the stage-1 writer; returns the folder."""
    import pyarrow.parquet as pq

    from pipeline.score_teacher.teacher import ShardResult
    from pipeline.score_teacher.writer import write_manifest, write_shard
    from storage_schemas.reader import ScoredDocument

    identity = copy.deepcopy(source.folders[0].identity)
    identity.setdefault("teacher", {})["name"] = name
    folder.mkdir(parents=True, exist_ok=True)
    done = {}
    for index, shard in enumerate(shards):
        t = pq.read_table(shard.path).to_pydict()
        docs = []
        for r in range(len(t["doc_id"])):
            losses = np.asarray(t["losses"][r], np.float32)
            docs.append(ScoredDocument(t["doc_id"][r], t["text"][r], np.asarray(t["token_ids"][r], np.int32),
                                       np.asarray(t["starts"][r], np.int32), np.asarray(t["ends"][r], np.int32),
                                       losses[::-1].copy() if reverse else losses))
        done[index] = write_shard(folder, index, ShardResult(documents=docs), identity, {"index": index}, "bench")
    write_manifest(folder, identity, done, len(shards), "bench")
    return folder


def run(cfg: TeachersBenchConfig, work_dir: str | os.PathLike, tokenizer, dataset: str | os.PathLike) -> dict:
    """``dataset``: a complete stage-1 output folder, whose first ``max_shards`` shards become the two teachers."""
    from pipeline.student_data.several_teachers import open_teachers
    from pipeline.student_data.build import build_student_data
    from pipeline.student_data.dataset import PackedDataset
    from pipeline.student_data.settings import AlignmentConfig, PackingConfig
    from storage_schemas.reader import open_scored_dataset

    source = open_scored_dataset([str(dataset)])
    shards = source.shards[: cfg.max_shards]
    work = Path(work_dir) / "teachers"
    shutil.rmtree(work, ignore_errors=True)
    folders = [write_teacher(source, shards, work / "bench-a", "bench-a", reverse=False),
               write_teacher(source, shards, work / "bench-b", "bench-b", reverse=True)]
    packing, alignment = PackingConfig(seq_len=cfg.seq_len), AlignmentConfig(combine=cfg.combine)
    warm = work / "length-cache"
    planned = {n: build_student_data(open_teachers([str(f) for f in folders[:n]]), tokenizer, packing, alignment,
                                     cache_dir=warm) for n in (1, 2)}
    delivered: dict[str, int] = {}

    def read_all(dataset, key: str) -> None:
        delivered[key] = read_packed(dataset, cfg.batch_size)

    def steady(n: int):
        data = planned[n]
        return lambda: read_all(PackedDataset(data.scored.shards, data.plan, tokenizer, data.alignment,
                                              teachers=data.dataset.teachers), f"{n}")

    def cold(n: int):
        def side():
            cache = tempfile.mkdtemp(dir=work)
            try:
                data = build_student_data(open_teachers([str(f) for f in folders[:n]]), tokenizer, packing, alignment,
                                          cache_dir=cache)
                read_all(data.dataset, f"{n}_cold")
            finally:
                shutil.rmtree(cache, ignore_errors=True)
        return side

    sides = {"one": steady(1), "two": steady(2)}
    if cfg.cold:
        sides.update(one_cold=cold(1), two_cold=cold(2))
    samples = interleaved(sides, cfg.repeats, cfg.warmup)
    shutil.rmtree(work, ignore_errors=True)
    if delivered["1"] != delivered["2"]:
        raise RuntimeError(f"one teacher delivered {delivered['1']} tokens, two {delivered['2']}: not the same samples")
    ratios = {"steady": ratio(samples["two"].cpu, samples["one"].cpu),
              "steady_wall": ratio(samples["two"].wall, samples["one"].wall)}
    if cfg.cold:
        ratios["cold"] = ratio(samples["two_cold"].cpu, samples["one_cold"].cpu)
    main = ratios["steady"]
    note = (f"CPU time, {sum(s.rows for s in shards)} docs of {Path(str(dataset)).name}, "
            f"{delivered['1']:,} packed {cfg.student} tokens of {cfg.seq_len}, combine={cfg.combine}, batches of "
            f"{cfg.batch_size} samples, plan built beforehand (spread {main['min']:.2f}-{main['max']:.2f}, ratio of "
            f"minima {main['of_minima']:.2f}, wall {ratios['steady_wall']['median']:.2f})")
    if cfg.cold:
        note += f"; first run including matching and the length pass: {ratios['cold']['median']:.2f}"
    return {
        "dataset": str(dataset), "shards": len(shards), "documents": sum(s.rows for s in shards),
        "delivered_tokens": delivered, "student": cfg.student, "seq_len": cfg.seq_len, "combine": cfg.combine,
        "samples": {k: v.to_dict() for k, v in samples.items()}, "ratios": ratios,
        "figures": [figure("two_teachers", "two-teacher data pipeline (two teachers / one, CPU time)",
                           main["median"], cfg.target, "<=", note=note)],
    }
