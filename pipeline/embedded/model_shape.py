"""The architecture fields shared by every small model spec (the embedded teacher and student, the
toy reproduction's teachers and students, the bench's random-weight models), and their Hugging Face
config names."""

from __future__ import annotations

from dataclasses import dataclass

# ModelShape field -> Hugging Face config argument (the same for Qwen2Config and LlamaConfig)
HF_CONFIG_KEYS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                  "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                  "num_kv_heads": "num_key_value_heads", "context": "max_position_embeddings"}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Sizes of a small decoder; keyword-only, so subclasses may add required positional fields."""

    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = 2  # None: num_heads (no grouped-query attention)
    context: int = 512  # max_position_embeddings

    def hf_config_args(self) -> dict[str, int]:
        args = {hf_key: getattr(self, key) for key, hf_key in HF_CONFIG_KEYS.items()}
        if self.num_kv_heads is None:
            args["num_key_value_heads"] = self.num_heads
        return args
