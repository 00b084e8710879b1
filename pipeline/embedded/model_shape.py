"""The architecture fields shared by every tiny model spec (embedded teacher and student, and the
toy reproduction's teachers and students), and their Hugging Face config names."""

from __future__ import annotations

from dataclasses import dataclass

# ModelShape field -> Hugging Face config argument (the same for Qwen2Config and LlamaConfig)
HF_CONFIG_KEYS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                  "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                  "num_kv_heads": "num_key_value_heads", "context": "max_position_embeddings"}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Sizes of a tiny decoder; keyword-only, so subclasses may add required positional fields."""

    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    context: int = 512  # max_position_embeddings

    def hf_config_args(self) -> dict[str, int]:
        return {hf_key: getattr(self, key) for key, hf_key in HF_CONFIG_KEYS.items()}
