"""The scorer actor of stage 1: it holds the teacher once, and reads, scores and writes whole
shards, each complete on disk (file and marker) before the driver hears of it. It runs as a Ray actor
in the pool of :mod:`pipeline.score_teacher.pool`, and records in each shard's marker which node
scored it, on which try and with which engine.
"""

from __future__ import annotations

import os
import socket
import time

import pipeline
from pipeline.runtime.cpu_threads import threads_for
from pipeline.runtime.quiet import quiet_third_party
from pipeline.score_teacher.backends.factory import make_scorer
from pipeline.score_teacher.backends.server import ApiKey
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.corpus import ShardSpec
from pipeline.score_teacher.faults import inject_fault
from pipeline.score_teacher.prepare import Prepared
from pipeline.score_teacher.shards import read_shard
from pipeline.score_teacher.teacher import score_documents
from pipeline.score_teacher.writer import write_shard
from pipeline.method.tokenization import load_tokenizer
from storage_schemas import store_calls


class ShardScorer:
    """Holds the teacher once; scores and writes whole shards. Runs as a Ray actor, and records in
    each shard's marker which node scored it and on which try. Creating one is cheap, so that its
    first answer (``describe()``) says it was placed; ``load()`` then loads the teacher."""

    def __init__(self, prepared: Prepared, teacher: TeacherConfig, cfg: ScoreJobConfig, version: str,
                 key: ApiKey | None = None):
        self.prepared = prepared
        self.key = key  # the served teacher's API key (server backend), never written
        self.teacher = teacher
        self.cfg = cfg
        self.version = version
        self.node = _this_node()
        self.tokenizer = self.scorer = None
        self.engine: dict = {}  # what computes the losses: name, version, device (each shard's marker)

    def load(self) -> dict:
        """Load the tokenizer and the teacher; returns :meth:`describe`."""
        import torch  # lazy: seconds to import; a config error is refused first
        if self.scorer is None:
            quiet_third_party()
            torch.set_num_threads(threads_for(_granted_cpus(self.cfg.pool.num_cpus)))
            teacher = self.teacher
            self.tokenizer = load_tokenizer(teacher.tokenizer or teacher.model, revision=teacher.revision,
                                            trust_remote_code=teacher.trust_remote_code)
            self.scorer = make_scorer(self.prepared.scorer, self.key)
            self.engine = engine_of(self.scorer)
        return self.describe()

    def score_shard(self, spec: ShardSpec, attempt: int = 1) -> dict:
        self.load()
        t0 = time.perf_counter()
        try:
            inject_fault(spec.index)
            docs = read_shard(spec, self.cfg.corpus.text_column)
            result = score_documents(docs, self.tokenizer, self.scorer, self.prepared.settings)
        except Exception as exc:
            _release_cuda_memory(exc)
            raise
        entry = write_shard(
            self.cfg.output_dir, spec.index, result, self.prepared.identity,
            _shard_source(spec), self.version, storage=self.cfg.storage,
            scored_by={**self.node, "attempt": attempt, "engine": self.engine},
        )
        entry["seconds"] = time.perf_counter() - t0
        entry["store_calls"] = store_calls.take()  # this actor's object-store requests since its last shard
        return entry

    def describe(self) -> dict:
        """Where this actor runs, where its code was imported from (a copy shipped by Ray's
        runtime environment, or the installed package) and how many threads torch uses there."""
        import torch  # lazy: seconds to import; a config error is refused first
        return {**self.node, "pid": os.getpid(), "code": os.path.dirname(os.path.abspath(pipeline.__file__)),
                "torch_threads": torch.get_num_threads()}


def engine_of(scorer) -> dict:
    """The engine behind a scorer, for the markers and the card (never the identity: a patch
    release must not orphan a dataset): the vLLM backend says it; the transformers backend is
    transformers on torch."""
    import torch  # lazy: seconds to import; a config error is refused first
    import transformers  # lazy: seconds to import; a config error is refused first
    described = scorer.describe()
    if "engine" in described:
        return dict(described["engine"])
    if described.get("backend") == "transformers":
        return {"name": "transformers", "version": transformers.__version__, "torch": torch.__version__,
                "device": described.get("device")}
    return {"name": described.get("backend")}


def _granted_cpus(asked: float) -> float:
    """The CPUs Ray gave this actor (what it asked for, outside an actor)."""
    import ray  # lazy: seconds to import; a config error is refused first
    if not ray.is_initialized():
        return asked
    return ray.get_runtime_context().get_assigned_resources().get("CPU", asked)


def _this_node() -> dict:
    """The Ray node this process runs on: its id, IP address and host name."""
    import ray  # lazy: seconds to import; a config error is refused first

    if not ray.is_initialized():
        return {"node_id": None, "node_ip": None, "hostname": socket.gethostname()}
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname()}


def _release_cuda_memory(exc: BaseException) -> None:
    """After CUDA ran out of memory, give the cached blocks back so that the next try starts clean."""
    import torch  # lazy: seconds to import; a config error is refused first
    if type(exc).__name__ == "OutOfMemoryError":
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _shard_source(spec: ShardSpec) -> dict:
    return {"file": spec.label, "kind": spec.kind, "start": spec.start, "stop": spec.stop,
            "first_doc_id": f"{spec.label}:{spec.row_offset + spec.start}"}
