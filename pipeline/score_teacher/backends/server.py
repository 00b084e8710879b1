"""The served-teacher backend: windows scored by a teacher someone already serves, through an
OpenAI-compatible ``/v1/completions`` endpoint (vLLM's server; docs/served-teacher.md).

Each actor tokenizes locally with the teacher's tokenizer (the offsets need it) and sends every
window as token ids, one request per window::

    {"model": <served name>, "prompt": [ids...], "max_tokens": 1, "temperature": 0,
     "prompt_logprobs": 0, "return_token_ids": true}

The answer's ``choices[0].prompt_logprobs`` holds, at every position but the first, a mapping keyed
by the token id (as a string) that includes the prompt's own token; the loss is looked up by that id
(:func:`pipeline.score_teacher.backends.vllm.prompt_logprobs_to_losses`), and the ids the server
echoes (``prompt_token_ids``) must be the ids sent.

* **Bounded in flight.** At most ``in_flight_per_actor`` requests per actor; the driver sizes it so
  that all actors together keep at most ``max_in_flight`` (:func:`share_in_flight`).
* **Retries.** Time-outs, connection errors, 429 and 5xx are tried again with exponential back-off
  (``Retry-After`` honoured); a window still failing ``retry_for_s`` after its first failure stops
  the shard (:class:`ServerUnavailableError`). Other answers (400, 401, 404, a malformed body) are
  not retried (:class:`ServerRefusedError`).
* **Idempotent by window.** Window ``i``'s answer goes into slot ``i`` and nowhere else; a slot
  filled twice is an error, and the shard's result exists only when every slot holds exactly one
  answer.

Before any work the driver checks the server (:func:`check_server`): the model list names the
teacher (or ``scorer.served_model``), a probe text tokenized by the server gives the local
tokenizer's ids (another tokenizer, or a chat template applied, is refused), a probe window of
token ids comes back scored at its own ids, and the window plan fits the server's
``max_model_len`` (:meth:`ServedTeacher.fit_window`). The API key is read from the environment
variable ``scorer.api_key_env`` and never written anywhere; the manifest records the URL's host.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

import numpy as np
import requests
from requests.adapters import HTTPAdapter

from pipeline.runtime.config import ConfigError, UserError
from pipeline.score_teacher.backends.base import ScorerConfig
from pipeline.score_teacher.backends.vllm import PromptLogprobError, prompt_logprobs_to_losses

log = logging.getLogger(__name__)

RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # and every other 5xx
CONNECT_TIMEOUT_S = 10.0
CHECK_TIMEOUT_S = 30.0  # each request of the checks before work
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 10.0
LOG_EVERY_S = 15.0
# Tokenized by the server and locally before any work: digits, operators, a line break, accents.
PROBE_TEXT = "Probe: if 3x + 5 = 20, then x = 5.\nSo the sum 1 + 2 + 3 + ... + 10 = 55, café."


class ServerCheckError(UserError, RuntimeError):
    """The server cannot score for this job (unreachable, the key refused, another model or
    tokenizer, a context too short), found before any work; the message says what to change."""


class ServerUnavailableError(RuntimeError):
    """A window got no answer within ``scorer.retry_for_s`` of its first failure: the shard stops."""


class ServerRefusedError(RuntimeError):
    """The server answered a window with an error that another try will not change (4xx)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ApiKey(str):
    """The API key: a string that never shows itself in a repr, a log line or a traceback."""

    def __repr__(self) -> str:
        return "ApiKey('***')"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def header(self) -> dict[str, str]:
        return {"Authorization": "Bearer " + str.__str__(self)}


def api_key(cfg: ScorerConfig) -> ApiKey | None:
    """The key in the environment variable ``cfg.api_key_env`` (None when unset or empty)."""
    value = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
    return ApiKey(value) if value else None


def base_url(url: str) -> str:
    """``http://host:port[/prefix]`` without a trailing ``/`` or ``/v1``."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def host_of(url: str) -> str:
    """The URL's host and port, without any user name or password in it."""
    parts = urlsplit(url)
    return parts.hostname + (f":{parts.port}" if parts.port else "") if parts.hostname else url


def share_in_flight(cfg: ScorerConfig, n_actors: int) -> ScorerConfig:
    """``cfg`` with ``in_flight_per_actor`` lowered so that ``n_actors`` actors keep at most
    ``max_in_flight`` requests in flight together (the caller starts at most ``max_in_flight`` actors)."""
    share = max(1, cfg.max_in_flight // max(1, n_actors))
    return replace(cfg, in_flight_per_actor=min(cfg.in_flight_per_actor, share))


# ---------------------------------------------------------------------------------------------
# The checks before any work (driver)


@dataclass(frozen=True)
class ServedTeacher:
    """What the server reports about the teacher it serves."""

    url: str
    name: str  # the served model name requests carry
    root: str | None  # what the server loaded (vLLM: the hub id or path given to --model)
    max_model_len: int | None
    version: str | None  # GET /version (vLLM); None where the server has none

    def identity(self) -> dict:
        """Compared on every rerun: the loaded model when the server names it by hub id (a path on
        the server is a location, not content)."""
        root = self.root if self.root and not _looks_like_path(self.root) else None
        return {"root": root}

    def location(self) -> dict:
        """For people, never compared: where the teacher was served (host only, never the key)."""
        return {"server_host": host_of(self.url), "served_model": self.name, "served_root": self.root,
                "server_version": self.version, "server_max_model_len": self.max_model_len}

    def fit_window(self, window: int, chosen: bool) -> int:
        """The window against the server's ``max_model_len``: a prompt of ``w`` tokens needs
        ``w + 1 <= max_model_len`` (the one output token a completion asks for). An unset window
        becomes ``max_model_len - 1``; a chosen one that does not fit is refused."""
        if self.max_model_len is None or window + 1 <= self.max_model_len:
            return window
        room = self.max_model_len - 1
        if not chosen:
            log.info("the server's max_model_len is %d: windows of %d tokens (one position is left for the "
                     "output token)", self.max_model_len, room)
            return room
        raise ConfigError(f"teacher.window: {window} + 1 (the output token a completion asks for) does not fit "
                          f"the max_model_len {self.max_model_len} of {self.name} at {host_of(self.url)}: set "
                          f"teacher.window <= {room}, or serve it with --max-model-len >= {window + 1}")


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "~", ".")) or os.path.exists(name)


def check_server(cfg: ScorerConfig, teacher_model: str, tokenizer, bos_id: int | None,
                 key: ApiKey | None = None) -> ServedTeacher:
    """Everything about the server that can fail, before any work (module docstring): one
    :class:`ServerCheckError` line on the first problem."""
    url = base_url(cfg.url or "")
    session = requests.Session()
    models = _get_json(session, url, "/v1/models", cfg, key)
    entry = _served_entry(models, cfg, teacher_model, url)
    version = _version(session, url, key)
    served = ServedTeacher(url=url, name=str(entry["id"]), root=entry.get("root"),
                           max_model_len=_int_or_none(entry.get("max_model_len")), version=version)
    _check_tokenizer(session, served, cfg, tokenizer, key)
    probe = np.asarray(([bos_id] if bos_id is not None else []) + _text_ids(tokenizer, add_special=False), np.int64)
    probe = probe[: max(2, min(len(probe), (served.max_model_len or len(probe) + 1) - 1))]
    scorer = ServerScorer(replace(cfg, url=url, served_model=served.name, window=len(probe), in_flight_per_actor=1), key)
    try:
        losses = scorer.score([probe])[0]
    except ServerRefusedError as exc:
        if exc.status in (401, 403):
            raise ServerCheckError(_refused_key(exc, cfg, key, host_of(url))) from exc
        raise ServerCheckError(f"scorer.url: a probe window of {len(probe)} token ids sent to {served.name} at "
                               f"{host_of(url)} was refused: {exc}") from exc
    except (ServerUnavailableError, PromptLogprobError) as exc:
        raise ServerCheckError(f"scorer.url: a probe window of {len(probe)} token ids sent to {served.name} at "
                               f"{host_of(url)} was not scored: {exc}") from exc
    if not np.isfinite(losses[1:]).all():
        raise ServerCheckError(f"scorer.url: {served.name} at {host_of(url)} gave non-finite log-probabilities "
                               "for the probe window")
    return served


def _request(session: requests.Session, method: str, url: str, key: ApiKey | None, **kwargs) -> requests.Response:
    try:
        return session.request(method, url, headers=key.header() if key else {},
                               timeout=(CONNECT_TIMEOUT_S, CHECK_TIMEOUT_S), **kwargs)
    except requests.RequestException as exc:
        raise ServerCheckError(f"scorer.url: cannot reach {url} ({_short(exc)}); start the server, or correct "
                               "scorer.url") from exc


def _get_json(session, url: str, path: str, cfg: ScorerConfig, key: ApiKey | None) -> dict:
    resp = _request(session, "GET", url + path, key)
    if resp.status_code in (401, 403):
        raise ServerCheckError(_refused_key(resp, cfg, key, host_of(url)))
    if resp.status_code != 200:
        raise ServerCheckError(f"scorer.url: GET {url}{path} answered {resp.status_code} ({_message(resp)}); "
                               "is it an OpenAI-compatible server?")
    try:
        return resp.json()
    except ValueError as exc:
        raise ServerCheckError(f"scorer.url: GET {url}{path} did not answer JSON; is it an OpenAI-compatible "
                               "server?") from exc


def _refused_key(answer, cfg: ScorerConfig, key: ApiKey | None, host: str) -> str:
    """``answer``: the refusing response, or a :class:`ServerRefusedError`."""
    status = getattr(answer, "status_code", None) or getattr(answer, "status", "")
    reason = getattr(answer, "reason", None) or ("Unauthorized" if status == 401 else "Forbidden")
    given = (f"the key in ${cfg.api_key_env}" if key else
             f"a request without a key (${cfg.api_key_env} is not set)" if cfg.api_key_env
             else "a request without a key (scorer.api_key_env is empty)")
    return (f"scorer.api_key_env: the server at {host} refused {given} ({status} {reason}); "
            f"export {cfg.api_key_env or 'VOCAGNO_SERVER_KEY'}=<the server's key>")


def _served_entry(models: dict, cfg: ScorerConfig, teacher_model: str, url: str) -> dict:
    """The model list's entry for the teacher: ``scorer.served_model`` by name, or else the entry
    whose name or root is ``teacher.model`` (as written, or the same local folder)."""
    entries = [m for m in models.get("data") or [] if isinstance(m, dict) and m.get("id")]
    names = [str(m["id"]) for m in entries]
    if cfg.served_model:
        for m in entries:
            if m["id"] == cfg.served_model:
                return m
        raise ServerCheckError(f"scorer.served_model: {host_of(url)} serves no model named {cfg.served_model!r} "
                               f"(it serves: {', '.join(names) or 'nothing'})")

    def same(name) -> bool:
        if not name:
            return False
        if name == teacher_model:
            return True
        return (os.path.exists(name) and os.path.exists(teacher_model)
                and os.path.realpath(name) == os.path.realpath(teacher_model))

    for m in entries:
        if same(m.get("id")) or same(m.get("root")):
            return m
    raise ServerCheckError(f"scorer.served_model: {host_of(url)} serves {', '.join(names) or 'nothing'}, not "
                           f"teacher.model {teacher_model}; if one of them is this teacher, set "
                           "scorer.served_model=<its name>")


def _version(session, url: str, key: ApiKey | None) -> str | None:
    """vLLM's ``GET /version``; None where the server has no such route."""
    try:
        resp = session.get(url + "/version", headers=key.header() if key else {},
                           timeout=(CONNECT_TIMEOUT_S, CHECK_TIMEOUT_S))
        return str(resp.json().get("version")) if resp.status_code == 200 else None
    except (requests.RequestException, ValueError, AttributeError):
        return None


def _text_ids(tokenizer, add_special: bool) -> list[int]:
    return [int(i) for i in tokenizer(PROBE_TEXT, add_special_tokens=add_special)["input_ids"]]


def _check_tokenizer(session, served: ServedTeacher, cfg: ScorerConfig, tokenizer, key: ApiKey | None) -> None:
    """The server tokenizes :data:`PROBE_TEXT` to the local tokenizer's ids (its special tokens
    included), or it is another tokenizer or applies a template: refused. A server that cannot
    tokenize text (vLLM's ``--skip-tokenizer-init``) or does not echo ids is let through with a warning."""
    body = {"model": served.name, "prompt": PROBE_TEXT, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    echoed, why = None, "no prompt_token_ids in the answer"
    try:
        resp = post(session, served.url + "/v1/completions", body, key.header() if key else {}, cfg)
        echoed = resp.json()["choices"][0].get("prompt_token_ids")
    except ServerRefusedError as exc:
        if exc.status in (401, 403):
            raise ServerCheckError(_refused_key(exc, cfg, key, host_of(served.url))) from exc
        why = str(exc)
    except ServerUnavailableError as exc:
        raise ServerCheckError(f"scorer.url: {exc}") from exc
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        pass
    if echoed is None:
        log.warning("%s at %s did not tokenize the probe text for comparison (%s): its tokenizer cannot be compared "
                    "with the local one; token ids are still checked on a probe window", served.name,
                    host_of(served.url), why)
        return
    local = _text_ids(tokenizer, add_special=True)
    if [int(i) for i in echoed] != local:
        at = next((j for j, (a, b) in enumerate(zip(echoed, local)) if int(a) != b), min(len(echoed), len(local)))
        raise ServerCheckError(
            f"scorer.url: {served.name} at {host_of(served.url)} tokenizes text differently from this job's teacher "
            f"tokenizer (a probe text of {len(local)} tokens here, {len(echoed)} there, first difference at token {at}: "
            f"{echoed[at:at + 3]} there, {local[at:at + 3]} here): another tokenizer or a chat template; serve "
            "this teacher's own tokenizer, or set teacher.tokenizer to the served one")


def _int_or_none(value) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _message(resp: requests.Response) -> str:
    """The server's error message (OpenAI's ``{"error": {"message": ...}}``), one line, bounded."""
    try:
        body = resp.json()
        error = body.get("error", body) if isinstance(body, dict) else body
        text = error.get("message", error) if isinstance(error, dict) else error
    except ValueError:
        text = resp.text or resp.reason
    return " ".join(str(text).split())[:300]


def _short(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


# ---------------------------------------------------------------------------------------------
# The scorer (actors)


def post(session: requests.Session, url: str, body: dict, headers: dict, cfg: ScorerConfig,
         stop: threading.Event | None = None, on_retry=None) -> requests.Response:
    """POST ``body`` until a 200 answer: time-outs, connection errors, 429 and 5xx are tried again
    with exponential back-off (``Retry-After`` honoured) for up to ``cfg.retry_for_s`` after the
    first failure (then :class:`ServerUnavailableError`); any other answer raises
    :class:`ServerRefusedError` at once. ``stop`` set: no further try."""
    first_failure: float | None = None
    tries = 0
    while True:
        tries += 1
        retry_after = None
        try:
            resp = session.post(url, json=body, headers=headers, timeout=(CONNECT_TIMEOUT_S, cfg.request_timeout_s))
        except requests.RequestException as exc:  # connection refused or dropped, a time-out
            error = _short(exc)
        else:
            if resp.status_code == 200:
                return resp
            if resp.status_code not in RETRIED_STATUS and resp.status_code < 500:
                raise ServerRefusedError(f"{url} answered {resp.status_code} {resp.reason}: {_message(resp)}",
                                         resp.status_code)
            error = f"{resp.status_code} {resp.reason}: {_message(resp)}"
            retry_after = _retry_after(resp)
        now = time.monotonic()
        first_failure = now if first_failure is None else first_failure
        left = cfg.retry_for_s - (now - first_failure)
        if left <= 0 or (stop is not None and stop.is_set()):
            raise ServerUnavailableError(
                f"{url}: no answer after {tries} tr{'y' if tries == 1 else 'ies'} over {now - first_failure:.0f} s "
                f"(scorer.retry_for_s={cfg.retry_for_s:g}); last: {error}")
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (tries - 1)) * random.uniform(0.5, 1.0)
        if retry_after is not None:
            delay = max(delay, retry_after)
        if on_retry is not None:
            on_retry(error, left)
        if stop is not None:
            stop.wait(min(delay, left))
        else:
            time.sleep(min(delay, left))



class ServerScorer:
    """Scores windows through the server; see the module docstring. ``key`` is the API key
    (:func:`api_key`), passed by the driver to each actor."""

    def __init__(self, cfg: ScorerConfig, key: ApiKey | None = None):
        if not cfg.url:
            raise ConfigError("scorer.url: required with scorer.backend=server")
        self.cfg = cfg
        self.endpoint = base_url(cfg.url) + "/v1/completions"
        self.headers = key.header() if key else {}
        self._local = threading.local()
        # in_flight_per_actor threads, kept across calls with one connection each (kept alive)
        self._pool = ThreadPoolExecutor(max_workers=cfg.in_flight_per_actor, thread_name_prefix="served-teacher")
        self._log_lock = threading.Lock()
        self._last_log = -float("inf")

    def describe(self) -> dict:
        """The markers' ``scored_by.engine``: the server's host (the served model and version are in
        the manifest's ``location``)."""
        host = host_of(self.endpoint)
        return {"backend": "server", "dtype": self.cfg.dtype, "device": host,
                "engine": {"name": "server", "device": host}}

    def score(self, windows: Sequence[np.ndarray]) -> list[np.ndarray]:
        too_long = [len(w) for w in windows if self.cfg.window and len(w) > self.cfg.window]
        if too_long:
            raise PromptLogprobError(f"a window of {too_long[0]} tokens exceeds the planned window {self.cfg.window}")
        results: list[np.ndarray | None] = [None] * len(windows)
        stop = threading.Event()  # set: this call's other windows stop retrying
        futures = {self._pool.submit(self._score_window, np.asarray(w, dtype=np.int64), stop): i
                   for i, w in enumerate(windows)}
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f.exception() for f in done if f.exception() is not None]
            if failed and isinstance(failed[0], ServerUnavailableError):
                raise ServerUnavailableError(f"{failed[0]}. The finished shards are kept: run the same command "
                                             "again once the server answers") from failed[0]
            if failed:
                raise failed[0]
            for future, i in futures.items():
                self._put(results, i, future.result())
        finally:
            stop.set()
            for future in futures:
                future.cancel()
            wait(futures)  # no request of this call outlives it
        return results  # type: ignore[return-value]

    @staticmethod
    def _put(results: list, i: int, losses: np.ndarray) -> None:
        """Window ``i``'s one answer into slot ``i``; a second answer for one window is a bug."""
        if results[i] is not None:
            raise RuntimeError(f"window {i} answered twice")
        results[i] = losses

    # -- one window, with retries

    def _score_window(self, ids: np.ndarray, stop: threading.Event) -> np.ndarray:
        body = {"model": self.cfg.served_model, "prompt": ids.tolist(), "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": 0, "return_token_ids": True}
        resp = post(self._session(), self.endpoint, body, self.headers, self.cfg, stop, self._log_retry)
        return self._losses(resp, ids)

    def _losses(self, resp: requests.Response, ids: np.ndarray) -> np.ndarray:
        try:
            choice = resp.json()["choices"][0]
            logprobs = choice["prompt_logprobs"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise PromptLogprobError(f"{self.endpoint}: an answer without choices[0].prompt_logprobs "
                                     f"({_short(exc)}); does the server support prompt_logprobs?") from exc
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and [int(i) for i in echoed] != ids.tolist():
            raise PromptLogprobError(f"{self.endpoint}: the server scored other token ids than the window sent")
        if logprobs is None:
            raise PromptLogprobError(f"{self.endpoint}: prompt_logprobs is null; does the server support it?")
        per_position = [None if e is None else {int(k): _logprob(v) for k, v in e.items()} for e in logprobs]
        return prompt_logprobs_to_losses(ids, per_position)

    def _session(self) -> requests.Session:
        """One connection pool per thread, so requests never share a connection."""
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.mount("http://", HTTPAdapter(pool_connections=1, pool_maxsize=1, max_retries=0))
            session.mount("https://", HTTPAdapter(pool_connections=1, pool_maxsize=1, max_retries=0))
            self._local.session = session
        return session

    def _log_retry(self, error: str, left: float) -> None:
        with self._log_lock:
            now = time.monotonic()
            if now - self._last_log >= LOG_EVERY_S:
                self._last_log = now
                log.warning("%s: %s; trying again (for up to %.0f s more)", host_of(self.endpoint), error, left)


def _logprob(value) -> float:
    return float(value["logprob"] if isinstance(value, dict) else value)


def _retry_after(resp: requests.Response) -> float | None:
    try:
        return max(0.0, float(resp.headers.get("Retry-After", "")))
    except ValueError:
        return None
