"""Greedy generation for evaluation: transformers (default, CPU or GPU) or vLLM (GPU, optional).

Both take prompts and stop sequences and return each completion cut before its first stop sequence.

transformers: prompts are sorted by length and batched with left padding; a batch stops once every
row has produced a stop sequence or EOS (a per-row stopping criterion that decodes only the new
tokens), or after ``max_new_tokens``. Prompts longer than the model's context minus
``max_new_tokens`` keep their last tokens (the problem itself, after the exemplars) and are counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol, Sequence


from pipeline.runtime.config import ConfigError, check_at_least, check_choice
from pipeline.evaluation.tasks import cut_at_stop
from pipeline.folders.model_source import resolve_device

log = logging.getLogger(__name__)


BACKENDS = ("transformers", "vllm")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class GenerationSettings:
    """How a checkpoint generates (the ``generation`` group of ``make eval-student``)."""

    backend: str = "transformers"  # transformers (CPU or GPU) | vllm (GPU, where vllm is installed)
    dtype: str = "auto"  # auto (bfloat16 on a GPU that has it, else float32) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N (transformers backend)
    batch_size: int = 8  # prompts per generate call (transformers; vLLM schedules its own batches)
    max_new_tokens: int = 256
    seed: int = 0
    cpu_threads: int | None = 2  # torch threads on CPU (None: torch's default, all cores)
    trust_remote_code: bool = False
    vllm: dict = field(default_factory=dict)  # extra vllm.LLM arguments (gpu_memory_utilization, tensor_parallel_size, ...)

    def problems(self) -> list[str]:
        found: list[str] = []
        check_choice(found, "backend", self.backend, BACKENDS)
        check_choice(found, "dtype", self.dtype, DTYPES)
        for key in ("batch_size", "max_new_tokens", "cpu_threads"):
            check_at_least(found, key, getattr(self, key), 1)
        return found


@dataclass(frozen=True, kw_only=True)
class GenerationConfig(GenerationSettings):
    model: str  # a local folder or a hub id
    revision: str | None = None


class Generator(Protocol):
    truncated_prompts: int

    def generate(self, prompts: Sequence[str], stop: Sequence[str]) -> list[str]: ...

    def describe(self) -> dict: ...


def make_generator(cfg: GenerationConfig, loaded: LoadedModel | None = None) -> Generator:
    """The configured backend's generator; the transformers one uses ``loaded`` if given."""
    if cfg.backend == "transformers":
        return HFGenerator(cfg, loaded)
    if cfg.backend == "vllm":
        return VLLMGenerator(cfg)
    raise ConfigError(f"backend: {cfg.backend!r} is not one of transformers, vllm")


def _torch_dtype(name: str, device):
    import torch  # lazy: seconds to import; a config error is refused first
    if name == "auto":
        on_gpu = device.type == "cuda"
        return torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ConfigError(f"dtype: {name!r} is not one of auto, {', '.join(dtypes)}")
    return dtypes[name]


@dataclass
class LoadedModel:
    """A checkpoint loaded with transformers on the configured device and dtype."""

    model: object
    tokenizer: object
    device: torch.device
    dtype: torch.dtype

    def describe(self) -> dict:
        return {"backend": "transformers", "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch.")}


def load_model(cfg: GenerationConfig) -> LoadedModel:
    """``AutoModelForCausalLM``/``AutoTokenizer`` of ``cfg.model`` in eval mode (CPU threads, seed,
    device and dtype as configured); a checkpoint that cannot be loaded is one line."""
    import torch  # lazy: seconds to import; a config error is refused first
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: seconds to import; a config error is refused first
    device = resolve_device(cfg.device)
    if device.type == "cpu" and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    torch.manual_seed(cfg.seed)
    dtype = _torch_dtype(cfg.dtype, device)
    kwargs = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype, **kwargs)
    except OSError as exc:  # not found locally and the hub unreachable, or not a checkpoint
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot load checkpoint {cfg.model}: {first}") from exc
    return LoadedModel(model.to(device).eval(), tokenizer, device, dtype)


class HFGenerator:
    def __init__(self, cfg: GenerationConfig, loaded: LoadedModel | None = None):
        self.cfg = cfg
        self.loaded = loaded or load_model(cfg)
        self.model, self.device, self.dtype = self.loaded.model, self.loaded.device, self.loaded.dtype
        self.tokenizer = self.loaded.tokenizer
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        context = getattr(self.model.config, "max_position_embeddings", None)
        self.max_prompt_tokens = max(1, context - cfg.max_new_tokens) if context else None
        self.truncated_prompts = 0

    def describe(self) -> dict:
        return self.loaded.describe()

    def generate(self, prompts: Sequence[str], stop: Sequence[str]) -> list[str]:
        ids = [self._encode(p) for p in prompts]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # similar lengths share a batch
        out: list[str] = [""] * len(ids)
        for start in range(0, len(order), self.cfg.batch_size):
            batch = order[start:start + self.cfg.batch_size]
            for i, text in zip(batch, self._generate_batch([ids[i] for i in batch], tuple(stop))):
                out[i] = cut_at_stop(text, tuple(stop))
        return out

    def _encode(self, prompt: str) -> list[int]:
        ids = self.tokenizer(prompt)["input_ids"]
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            self.truncated_prompts += 1
            ids = ids[-self.max_prompt_tokens:]
        return ids

    def _generate_batch(self, batch: list[list[int]], stop: tuple[str, ...]) -> list[str]:
        import torch  # lazy: seconds to import; a config error is refused first
        from transformers import StoppingCriteriaList  # lazy: seconds to import; a config error is refused first
        enc = self.tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt").to(self.device)
        prompt_len = enc["input_ids"].shape[1]
        criterion = StopOnSequences(self.tokenizer, stop, prompt_len)
        with torch.inference_mode():
            generated = self.model.generate(
                **enc, max_new_tokens=self.cfg.max_new_tokens, do_sample=False, temperature=None, top_p=None,
                top_k=None, pad_token_id=self.tokenizer.pad_token_id, stopping_criteria=StoppingCriteriaList([criterion]),
            )  # (B, T_prompt + T_new)
        return self.tokenizer.batch_decode(generated[:, prompt_len:], skip_special_tokens=True)


class StopOnSequences:
    """Per-row stopping criterion: a row is done once its new tokens decode to a text holding one of
    ``stop``. Returns a (B,) bool tensor, as transformers expects."""

    def __init__(self, tokenizer, stop: tuple[str, ...], prompt_len: int):
        self.tokenizer, self.stop, self.prompt_len = tokenizer, stop, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        import torch  # lazy: seconds to import; a config error is refused first
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stop) for t in texts], device=input_ids.device)


class VLLMGenerator:
    """vLLM's offline engine: greedy ``SamplingParams(temperature=0)`` with the stop sequences;
    results come back in prompt order."""

    def __init__(self, cfg: GenerationConfig):
        try:
            from vllm import LLM  # optional and heavy: only where this backend runs
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError("backend=vllm needs vLLM: pip install 'vocagno[vllm]' in its own environment "
                               "(it pins its own torch and transformers)") from exc
        self.cfg = cfg
        self.llm = LLM(model=cfg.model, revision=cfg.revision, dtype=cfg.dtype, seed=cfg.seed,
                       trust_remote_code=cfg.trust_remote_code, **cfg.vllm)
        self.truncated_prompts = 0  # vLLM refuses a prompt longer than its context instead

    def describe(self) -> dict:
        return {"backend": "vllm", "device": "cuda", "dtype": self.cfg.dtype}

    def generate(self, prompts: Sequence[str], stop: Sequence[str]) -> list[str]:
        from vllm import SamplingParams  # optional and heavy: only where this backend runs

        params = SamplingParams(temperature=0.0, max_tokens=self.cfg.max_new_tokens, stop=list(stop), seed=self.cfg.seed)
        outputs = self.llm.generate(list(prompts), params, use_tqdm=False)
        return [cut_at_stop(o.outputs[0].text, tuple(stop)) for o in outputs]
