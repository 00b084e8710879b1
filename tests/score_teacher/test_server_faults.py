"""The served-teacher backend (``scorer.backend=server``) against faults, and its checks before work.

The real vLLM server is in test_server_backend.py (the vLLM environment). Here a **stand-in** HTTP
server (the standard library's ``http.server`` on 127.0.0.1) speaks the part of the OpenAI-compatible
API stage 1 uses: ``GET /v1/models``, ``POST /v1/completions`` with a token-id prompt,
``prompt_logprobs`` and ``return_token_ids`` (the log-probabilities computed by the micro teacher
itself, with transformers, one window per request), and a text prompt tokenized by its tokenizer.
It is the one place a stand-in is used, for faults the real server cannot be made to produce on
demand: 503 for a while, 429 with ``Retry-After``, an answer computed and the connection then dropped,
an answer slower than the client's time-out, a refused key, another tokenizer, a template put in
front of the text, other token ids echoed. The client, the Ray job, the writer and the reference (the
transformers backend on the same window plan) are the real code.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from pipeline.runtime.config import ConfigError, UserError
from pipeline.inspection.parity import compare_folders
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.server import ServerScorer
from pipeline.score_teacher.corpus import CorpusConfig
from pipeline.score_teacher.pool import PoolConfig
from pipeline.score_teacher.config import ScoreJobConfig, TeacherConfig
from pipeline.score_teacher.prepare import prepare
from pipeline.score_teacher.job import run_score_job
from pipeline.score_teacher.pool import ShardFailedError
from pipeline.score_teacher.writer import StorageConfig
from storage_schemas import read_manifest
from storage_schemas.reader import open_scored_dataset

WINDOW, STRIDE = 64, 48  # the micro teacher's 64 positions; the stand-in says max_model_len 65
TOLERANCE = 1e-5  # one window per forward here, padded batches in the reference (measured: 4.8e-7)
KEY = "sekrit-key-for-tests-0123456789"


class StandIn:
    """A scripted OpenAI-compatible server of the micro teacher (module docstring).

    ``fault(n)`` is asked for the n-th token-id completion request (from 0) and returns None (answer),
    ``"503"``, ``"429"``, ``"drop"`` (compute the answer, then close the connection without a
    response) or ``"slow"`` (answer after ``slow_s``). It records how many requests were in flight
    at once and how many answers were delivered per window."""

    def __init__(self, teacher: Path, *, max_model_len: int = WINDOW + 1, key: str | None = None,
                 name: str | None = None, fault=None, latency_s: float = 0.0, slow_s: float = 1.5,
                 tokenizer=None, template_ids: list[int] | None = None, echo_other_ids: bool = False):
        self.model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(teacher)
        self.name, self.key, self.max_model_len = name or str(teacher), key, max_model_len
        self.fault = fault or (lambda n: None)
        self.latency_s, self.slow_s = latency_s, slow_s
        self.template_ids, self.echo_other_ids = template_ids or [], echo_other_ids
        self.lock = threading.Lock()
        self.requests = 0
        self.in_flight = self.max_in_flight = 0
        self.faults = Counter()
        self.delivered = Counter()  # window (tuple of ids) -> answers sent in full
        self.auth_seen: set[str] = set()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def logprobs(self, ids: list[int]) -> list:
        with self.lock, torch.inference_mode():
            logp = self.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (T, V)
        own = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
        return [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": None}} for t, lp in zip(ids[1:], own)]

    def _handler(self):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def reply(self, status: int, body: dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def authorized(self) -> bool:
                stand_in.auth_seen.add(self.headers.get("Authorization", ""))
                if stand_in.key and self.headers.get("Authorization") != f"Bearer {stand_in.key}":
                    self.reply(401, {"error": "Unauthorized"})
                    return False
                return True

            def do_GET(self):
                if not self.authorized():
                    return
                if self.path == "/v1/models":
                    self.reply(200, {"object": "list", "data": [{"id": stand_in.name, "object": "model", "root": stand_in.name,
                                                                 "max_model_len": stand_in.max_model_len}]})
                else:
                    self.reply(404, {"error": {"message": f"no route {self.path}", "code": 404}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self.authorized():
                    return
                if body.get("model") != stand_in.name:
                    self.reply(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}})
                    return
                if isinstance(body["prompt"], str):  # the tokenizer probe
                    ids = stand_in.template_ids + stand_in.tokenizer(body["prompt"])["input_ids"]
                    self.reply(200, {"choices": [{"index": 0, "prompt_token_ids": ids, "prompt_logprobs": None}]})
                    return
                self.completion(body["prompt"])

            def completion(self, ids: list[int]) -> None:
                with stand_in.lock:
                    n = stand_in.requests
                    stand_in.requests += 1
                    stand_in.in_flight += 1
                    stand_in.max_in_flight = max(stand_in.max_in_flight, stand_in.in_flight)
                fault = stand_in.fault(n)
                try:
                    time.sleep(stand_in.latency_s)
                    if fault:
                        stand_in.faults[fault] += 1
                    if fault == "503":
                        self.reply(503, {"error": {"message": "Service Unavailable", "code": 503}})
                        return
                    if fault == "429":
                        self.reply(429, {"error": {"message": "Too Many Requests", "code": 429}}, {"Retry-After": "0.2"})
                        return
                    if len(ids) + 1 > stand_in.max_model_len:
                        self.reply(400, {"error": {"message": "This model's maximum context length ...", "code": 400}})
                        return
                    logprobs = stand_in.logprobs(ids)
                    if fault == "drop":  # the answer was computed; the client never gets it
                        self.close_connection = True
                        return
                    if fault == "slow":
                        time.sleep(stand_in.slow_s)
                    echoed = [ids[0] + 1, *ids[1:]] if stand_in.echo_other_ids else ids
                    self.reply(200, {"choices": [{"index": 0, "prompt_logprobs": logprobs, "prompt_token_ids": echoed}]})
                    with stand_in.lock:
                        stand_in.delivered[tuple(ids)] += 1
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on a slow answer
                    self.close_connection = True
                finally:
                    with stand_in.lock:
                        stand_in.in_flight -= 1

        return Handler


def served_job(teacher: Path, corpus: list[Path], out: Path, url: str, limit_docs: int = 12, actors: int = 1,
               window: int | None = None, stride: int | None = STRIDE, **scorer) -> ScoreJobConfig:
    return ScoreJobConfig(
        teacher=TeacherConfig(name="micro", model=str(teacher), window=window, stride=stride),
        corpus=CorpusConfig(name="micro", files=[str(f) for f in corpus], rows_per_shard=4, limit_docs=limit_docs),
        scorer=ScorerConfig(backend="server", url=url, **scorer),
        storage=StorageConfig(loss_precision="float32"),
        output_dir=str(out), pool=PoolConfig(num_actors=actors, num_cpus=1), progress=False,
    )


@pytest.fixture(scope="module")
def reference(micro_teacher, micro_corpus, ray_local, tmp_path_factory) -> Path:
    """The same documents scored in process by the transformers backend, on the same window plan."""
    out = tmp_path_factory.mktemp("server-reference") / "ds"
    run_score_job(ScoreJobConfig(
        teacher=TeacherConfig(name="micro", model=str(micro_teacher), window=WINDOW, stride=STRIDE),
        corpus=CorpusConfig(name="micro", files=[str(f) for f in micro_corpus], rows_per_shard=4, limit_docs=12),
        scorer=ScorerConfig(max_batch_tokens=2048), storage=StorageConfig(loss_precision="float32"),
        output_dir=str(out), pool=PoolConfig(num_actors=1, num_cpus=1), progress=False,
    ))
    return out


def assert_same_as_reference(folder: Path, reference: Path) -> dict:
    parity = compare_folders(open_scored_dataset([str(folder)]), open_scored_dataset([str(reference)]))
    assert parity.n_mismatched == 0, parity.mismatches  # documents, ids and offsets equal
    same = parity.same_context.to_dict()
    assert parity.documents == 12 and same["nan_mismatch"] == 0 and same["compared"] > 1000
    assert same["max_abs"] <= TOLERANCE, same
    return same


@pytest.mark.long
def test_faults_on_the_way_change_nothing(micro_teacher, micro_corpus, reference, tmp_path, monkeypatch):
    """503 for the first 1.5 s (the probe window waits) and again for 8 requests mid-job, 429s,
    answers dropped after they were computed and answers slower than the time-out, behind a key: the
    dataset equals the in-process one, each window stored once; the key reaches the server and
    appears in no file of the dataset."""
    script = {**{n: "503" for n in range(60, 68)}, 20: "429", 21: "429", 33: "slow", 90: "slow"}
    started = []

    def fault(n):
        started.append(time.monotonic())
        if time.monotonic() - started[0] < 1.5:
            return "503"
        return script.get(n) or ("drop" if n % 7 == 3 else None)

    monkeypatch.setenv("TEST_SERVED_KEY", KEY)
    with StandIn(micro_teacher, key=KEY, fault=fault) as server:
        cfg = served_job(micro_teacher, micro_corpus, tmp_path / "ds", server.url, api_key_env="TEST_SERVED_KEY",
                         request_timeout_s=0.5, in_flight_per_actor=4)
        summary = run_score_job(cfg)
    assert summary.complete and summary.shards_scored == 3
    print(f"{server.requests} requests, faults {dict(server.faults)}, {len(server.delivered)} windows")
    assert {k: server.faults[k] > 0 for k in ("503", "429", "drop", "slow")} == dict.fromkeys(("503", "429", "drop", "slow"), True)
    same = assert_same_as_reference(tmp_path / "ds", reference)
    print("served stand-in vs transformers:", same["max_abs"])
    assert f"Bearer {KEY}" in server.auth_seen
    for path in (tmp_path / "ds").rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
    location = read_manifest(tmp_path / "ds")["location"]
    assert location["server_host"] == server.url.removeprefix("http://")


@pytest.mark.long
def test_a_server_gone_longer_than_the_budget_stops_the_job_and_a_rerun_completes(
        micro_teacher, micro_corpus, reference, tmp_path):
    """From the 40th request on the server answers 503 for 30 s; with scorer.retry_for_s=2 the job
    stops after about 2 s of retries, in a message naming the budget and the last answer, with the
    shards finished before kept; the same command once the server is back scores only the rest."""
    outage = {}

    def fault(n):
        if n >= 40:
            outage.setdefault("since", time.monotonic())
            if time.monotonic() - outage["since"] < 30:
                return "503"
        return None

    with StandIn(micro_teacher, fault=fault) as server:
        cfg = served_job(micro_teacher, micro_corpus, tmp_path / "ds", server.url, retry_for_s=2.0,
                         in_flight_per_actor=2)
        with pytest.raises(ShardFailedError) as failed:
            run_score_job(cfg)
        message = str(failed.value).splitlines()[0]
        assert "scorer.retry_for_s=2" in message and "503" in message, message
        assert time.monotonic() - outage["since"] < 25  # stopped well before the server came back
        done_before = read_manifest(tmp_path / "ds")["totals"]["shards"]
        server.fault = lambda n: None
        summary = run_score_job(cfg)
    assert summary.complete and summary.shards_done_before == done_before
    assert_same_as_reference(tmp_path / "ds", reference)


@pytest.mark.long
def test_requests_in_flight_are_bounded_in_total(micro_teacher, micro_corpus, tmp_path):
    """Two actors of up to 8 requests each, scorer.max_in_flight=4: the server never sees more than 4
    at once (each actor's share is 4 // 2)."""
    with StandIn(micro_teacher, latency_s=0.02) as server:
        cfg = served_job(micro_teacher, micro_corpus, tmp_path / "ds", server.url, limit_docs=8, actors=2,
                         in_flight_per_actor=8, max_in_flight=4)
        assert run_score_job(cfg).complete
    assert 1 < server.max_in_flight <= 4, server.max_in_flight


def test_windows_come_back_in_their_own_slots_whatever_order_they_are_answered_in(micro_teacher):
    """Windows answered out of order (random latency), some dropped after the answer and sent again:
    each result is its own window's, equal to a plain forward of that window."""
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 300, size=int(n)).astype(np.int32) for n in rng.integers(2, WINDOW, size=24)]
    delays = rng.uniform(0, 0.05, size=200)
    with StandIn(micro_teacher, fault=lambda n: "drop" if n % 5 == 1 else None) as server:
        server.latency_s = 0.0
        original = server.logprobs

        def late(ids):
            time.sleep(delays[len(ids)])
            return original(ids)

        server.logprobs = late
        scorer = ServerScorer(ScorerConfig(backend="server", url=server.url, served_model=server.name, window=WINDOW,
                                           in_flight_per_actor=6))
        got = scorer.score(windows)
    model = AutoModelForCausalLM.from_pretrained(micro_teacher, dtype=torch.float32).eval()
    for w, losses in zip(windows, got):
        with torch.inference_mode():
            logp = model(torch.tensor([w.tolist()])).logits[0].log_softmax(-1)
        expected = -logp[torch.arange(len(w) - 1), torch.tensor(w[1:].tolist())].numpy()
        assert np.isnan(losses[0]) and len(losses) == len(w)
        np.testing.assert_allclose(losses[1:], expected, atol=1e-5)
    assert server.faults["drop"] > 0


# ---------------------------------------------------------------------------------------------
# The checks before any work: one line each, nothing scored, Ray not started


def check(micro_teacher, micro_corpus, tmp_path, url, **kw) -> str:
    cfg = served_job(micro_teacher, micro_corpus, tmp_path / "ds", url, **kw)
    with pytest.raises(UserError) as refused:
        prepare(cfg)
    message = str(refused.value)
    assert "\n" not in message, message
    return message


def test_a_wrong_served_model_name_is_refused_naming_what_is_served(micro_teacher, micro_corpus, tmp_path):
    with StandIn(micro_teacher, name="teacher-x") as server:
        message = check(micro_teacher, micro_corpus, tmp_path, server.url, served_model="nope")
        assert "scorer.served_model" in message and "'nope'" in message and "teacher-x" in message
        message = check(micro_teacher, micro_corpus, tmp_path, server.url)  # teacher.model is not served by name
        assert "serves teacher-x, not teacher.model" in message and "scorer.served_model=" in message
        assert prepare(served_job(micro_teacher, micro_corpus, tmp_path / "ds", server.url,
                                  served_model="teacher-x")).scorer.served_model == "teacher-x"


def test_a_refused_key_is_one_line_naming_the_variable(micro_teacher, micro_corpus, tmp_path, monkeypatch):
    monkeypatch.delenv("VOCAGNO_SERVER_KEY", raising=False)
    with StandIn(micro_teacher, key=KEY) as server:
        message = check(micro_teacher, micro_corpus, tmp_path, server.url)
        assert "$VOCAGNO_SERVER_KEY is not set" in message and "401" in message
        monkeypatch.setenv("VOCAGNO_SERVER_KEY", "wrong")
        message = check(micro_teacher, micro_corpus, tmp_path, server.url)
        assert "refused the key in $VOCAGNO_SERVER_KEY" in message and "wrong" not in message
        monkeypatch.setenv("VOCAGNO_SERVER_KEY", KEY)
        prepared = prepare(served_job(micro_teacher, micro_corpus, tmp_path / "ds", server.url))
    assert KEY not in json.dumps(prepared.identity) + json.dumps(prepared.location) + repr(prepared)


def test_another_tokenizer_or_a_template_is_refused(micro_teacher, micro_corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(["another vocabulary of the same sample text: x = 5, 1 + 2 = 3"] * 20,
                              trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    with StandIn(micro_teacher, tokenizer=PreTrainedTokenizerFast(tokenizer_object=other)) as server:
        message = check(micro_teacher, micro_corpus, tmp_path, server.url)
        assert "tokenizes text differently" in message and "first difference at token" in message
    with StandIn(micro_teacher, template_ids=[5, 6, 7]) as server:  # e.g. a chat template in front of the text
        message = check(micro_teacher, micro_corpus, tmp_path, server.url)
        assert "tokenizes text differently" in message and "first difference at token 0" in message


def test_a_server_scoring_other_ids_than_sent_is_refused(micro_teacher, micro_corpus, tmp_path):
    with StandIn(micro_teacher, echo_other_ids=True) as server:
        message = check(micro_teacher, micro_corpus, tmp_path, server.url)
    assert "probe window" in message and "other token ids" in message


def test_the_window_plan_is_checked_against_the_servers_max_model_len(micro_teacher, micro_corpus, tmp_path):
    with StandIn(micro_teacher, max_model_len=40) as server:
        with pytest.raises(ConfigError, match=r"teacher.window: 64 \+ 1 .* max_model_len 40 .* teacher.window <= 39"):
            prepare(served_job(micro_teacher, micro_corpus, tmp_path / "ds", server.url, window=64))
        prepared = prepare(served_job(micro_teacher, micro_corpus, tmp_path / "ds", server.url, stride=None))
    assert prepared.settings.window == 39 and prepared.identity["windows"]["window"] == 39
    assert prepared.location["server_max_model_len"] == 40


def test_an_unreachable_server_is_one_line(micro_teacher, micro_corpus, tmp_path):
    with StandIn(micro_teacher) as server:
        url = server.url  # a port nothing listens on once the stand-in is closed
    message = check(micro_teacher, micro_corpus, tmp_path, url)
    assert message.startswith("scorer.url: cannot reach") and url in message


def test_server_settings_are_validated_with_the_others():
    from pipeline.runtime.config import build

    problems: list[str] = []
    build(ScorerConfig, {"backend": "server", "in_flight_per_actor": 0, "retry_for_s": 0}, "scorer", problems)
    build(ScorerConfig, {"backend": "server", "url": "127.0.0.1:8000"}, "scorer", problems)
    assert problems == ["scorer.url: required with backend=server: http://host:port of the server",
                        "scorer.in_flight_per_actor: 0 must be >= 1", "scorer.retry_for_s: 0 must be > 0",
                        "scorer.url: '127.0.0.1:8000' must start with http:// or https://"]
