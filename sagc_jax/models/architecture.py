"""Decoder hyperparameters (`DecoderConfig`), Hugging Face config.json conversion and presets.

One frozen dataclass covers Llama 3.x and Qwen2/Qwen2.5: the two differ only in biases on the
q/k/v projections, rope theta / rope scaling, norm epsilon and whether the embeddings are tied.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "dots")
ATTENTION_PATHS = ("auto", "einsum", "cudnn", "splash")  # models.layers.resolve_attention
_FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Projections LoRA can adapt, by their Hugging Face / PEFT module names (models.lora).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """The `llama3` rope-scaling parameters (frequency-dependent interpolation of RoPE)."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a Llama/Qwen2 decoder-only transformer.

    Dimension letters used across `sagc_jax.models`: V vocab_size, D hidden_size,
    F intermediate_size, N num_heads, K num_kv_heads, H head_dim.
    `param_dtype` is the storage dtype of the weights, `compute_dtype` the dtype of matmul inputs
    and activations; softmax, log-probs and logits are always float32.
    `lora_rank` > 0 adds LoRA adapters of that rank to the `lora_targets` projections, scaled by
    `lora_alpha / lora_rank`, their input dropped at rate `lora_dropout` in a forward given a
    dropout key (see `models.lora`); 0 builds the plain model.
    """

    family: str = "llama"  # "llama" or "qwen2": only decides the HF architecture name
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10_000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = False
    max_position_embeddings: int = 2048
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"  # "none", "full" (recompute each layer) or "dots" (keep matmul outputs)
    scan_layers: bool = False  # the full forward's layers as one lax.scan over stacked weights
    attention: str = "auto"  # full-forward attention: "auto", "einsum", "cudnn" or "splash"
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_dropout: float = 0.0

    def __post_init__(self):
        if self.family not in _FAMILIES:
            raise ValueError(f"DecoderConfig.family={self.family!r}; allowed: {sorted(_FAMILIES)}")
        for field in ("param_dtype", "compute_dtype"):
            if getattr(self, field) not in _DTYPES:
                raise ValueError(
                    f"DecoderConfig.{field}={getattr(self, field)!r}; allowed: {sorted(_DTYPES)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention needs it)"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"DecoderConfig.remat={self.remat!r}; allowed: {', '.join(REMAT_POLICIES)}"
            )
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(
                f"DecoderConfig.attention={self.attention!r}; allowed: {', '.join(ATTENTION_PATHS)}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.lora_rank < 0:
            raise ValueError(
                f"DecoderConfig.lora_rank={self.lora_rank}; allowed: >= 0 (0: no LoRA)"
            )
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(
                f"DecoderConfig.lora_targets has {unknown}; allowed: {', '.join(LORA_TARGETS)}"
            )

    @property
    def param_jnp_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def compute_jnp_dtype(self):
        return _DTYPES[self.compute_dtype]

    def replace(self, **changes) -> DecoderConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides) -> DecoderConfig:
        """Builds a config from a Hugging Face `config.json` dict (transformers v4 or v5 keys)."""
        model_type = hf.get("model_type")
        if model_type not in _FAMILIES:
            raise ValueError(
                f"config.json model_type={model_type!r} is not supported; allowed: "
                f"{sorted(_FAMILIES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"config.json hidden_act={hf['hidden_act']!r}; only 'silu' is supported"
            )
        if model_type == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
            raise ValueError("config.json attention_bias/mlp_bias=true is not supported for llama")
        if model_type == "qwen2" and hf.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true is not supported for qwen2")
        # transformers v5 writes `rope_parameters`; v4 writes `rope_theta` and `rope_scaling`.
        rope = dict(hf.get("rope_parameters") or {})
        rope.update(hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", rope.get("rope_theta", 10_000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = Llama3RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "default":
            scaling = None
        else:
            raise ValueError(
                f"config.json rope type {rope_type!r} is not supported; allowed: default, llama3"
            )
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        heads = hf["num_attention_heads"]
        kwargs = dict(
            family=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", model_type == "qwen2")),
            qkv_bias=model_type == "qwen2",
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            bos_id=hf.get("bos_token_id"),
            eos_ids=eos_ids,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict transformers needs to rebuild this model (v4 and v5 keys)."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters = {**self.rope_scaling.to_hf(), "rope_theta": self.rope_theta}
        eos = list(self.eos_ids) if len(self.eos_ids) > 1 else (self.eos_ids or [None])[0]
        hf = {
            "architectures": [_FAMILIES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_id,
            "eos_token_id": eos,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
            "use_cache": True,
        }
        if self.family == "llama":
            hf.update(attention_bias=False, mlp_bias=False)
        else:
            hf.update(use_sliding_window=False, sliding_window=None)
        return hf


# ---------------------------------------------------------------------- presets
_QWEN25 = dict(
    family="qwen2",
    vocab_size=151_936,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_embeddings=True,
    qkv_bias=True,
    bos_id=151_643,
    eos_ids=(151_643, 151_645),
)
_LLAMA32 = dict(
    family="llama",
    vocab_size=128_256,
    rope_theta=500_000.0,
    rms_norm_eps=1e-5,
    tie_embeddings=True,
    qkv_bias=False,
    rope_scaling=Llama3RopeScaling(),
    max_position_embeddings=131_072,
    bos_id=128_000,
    eos_ids=(128_001, 128_008, 128_009),
)

PRESETS: dict[str, DecoderConfig] = {
    # A few hundred thousand parameters: CPU tests and demos.
    "tiny": DecoderConfig(
        family="llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10_000.0,
        tie_embeddings=True,
        max_position_embeddings=2048,
        bos_id=1,
        eos_ids=(2,),
    ),
    "qwen2.5-0.5b": DecoderConfig(
        **_QWEN25,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=32_768,
    ),
    "qwen2.5-1.5b": DecoderConfig(
        **_QWEN25,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        max_position_embeddings=131_072,
    ),
    "qwen2.5-3b": DecoderConfig(
        **_QWEN25,
        hidden_size=2048,
        intermediate_size=11008,
        num_layers=36,
        num_heads=16,
        num_kv_heads=2,
        head_dim=128,
        max_position_embeddings=32_768,
    ),
    "llama-3.2-1b": DecoderConfig(
        **_LLAMA32,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
    ),
    "llama-3.2-3b": DecoderConfig(
        **_LLAMA32,
        hidden_size=3072,
        intermediate_size=8192,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        head_dim=128,
    ),
}


def get_preset(name: str, **overrides) -> DecoderConfig:
    """Returns preset `name`, with `overrides` (e.g. param_dtype="bfloat16") applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
