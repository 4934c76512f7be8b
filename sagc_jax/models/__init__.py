"""Policy model: Llama/Qwen2 decoder, KV cache, presets, HF checkpoints in and out, tokenizer."""

from sagc_jax.models.architecture import PRESETS, DecoderConfig, Llama3RopeScaling, get_preset
from sagc_jax.models.decoder import Decoder, KVCache, init_cache, num_params
from sagc_jax.models.hf_checkpoint import (
    CheckpointMismatchError,
    hf_shapes,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from sagc_jax.models.tokenizer import Tokenizer

__all__ = [
    "CheckpointMismatchError",
    "hf_shapes",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "PRESETS",
    "Decoder",
    "DecoderConfig",
    "KVCache",
    "Llama3RopeScaling",
    "Tokenizer",
    "get_preset",
    "init_cache",
    "num_params",
]
