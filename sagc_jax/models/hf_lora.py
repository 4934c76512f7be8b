"""LoRA adapters out to Hugging Face: merged into the weights, or alone in PEFT's layout.

An adapted projection computes x @ (W + (alpha / r) * A @ B), A and B contracted over the rank
r. Here A carries W's input dimensions and B its output dimensions (``q_lora_a_dr`` [D, r],
``q_lora_b_rnh`` [r, N, H] for ``q_dnh`` [D, N, H]); PEFT stores the same factors as
torch Linear weights, ``lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r], under the name
of the HF module they adapt. The layout change of each factor is the one of its base weight in
``hf_checkpoint.RULES`` on the side it shares with it, a plain transpose on the rank's side.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from sagc_jax.models.config import DecoderConfig
from sagc_jax.models.hf_checkpoint import RULES, TRANSFORMS, write_safetensors


@dataclasses.dataclass(frozen=True)
class Target:
    """One adaptable projection: its HF module name (PEFT's target) and our parameter names."""

    module: str  # HF module, e.g. "q_proj"
    weight: str  # base weight path below a layer, e.g. "attn.q_dnh"
    a: str  # A factor path below a layer (W's input dims, r)
    b: str  # B factor path below a layer (r, W's output dims)


TARGETS: dict[str, Target] = {
    t.module: t
    for t in (
        Target("q_proj", "attn.q_dnh", "attn.q_lora_a_dr", "attn.q_lora_b_rnh"),
        Target("k_proj", "attn.k_dkh", "attn.k_lora_a_dr", "attn.k_lora_b_rkh"),
        Target("v_proj", "attn.v_dkh", "attn.v_lora_a_dr", "attn.v_lora_b_rkh"),
        Target("o_proj", "attn.o_nhd", "attn.o_lora_a_nhr", "attn.o_lora_b_rd"),
        Target("gate_proj", "mlp.gate_df", "mlp.gate_lora_a_dr", "mlp.gate_lora_b_rf"),
        Target("up_proj", "mlp.up_df", "mlp.up_lora_a_dr", "mlp.up_lora_b_rf"),
        Target("down_proj", "mlp.down_fd", "mlp.down_lora_a_fr", "mlp.down_lora_b_rd"),
    )
}
# Base weight's transform -> (A's, B's): A shares W's input side, B its output side.
_FACTOR_TRANSFORMS = {
    "transpose": ("transpose", "transpose"),
    "split_out_heads": ("transpose", "split_out_heads"),
    "split_in_heads": ("split_in_heads", "transpose"),
}
_RULE_BY_PATH = {rule.path: rule for rule in RULES}
PEFT_PREFIX = "base_model.model."  # PeftModel -> the CausalLM it wraps


def _layer_path(i: int, name: str) -> tuple:
    return ("layers", i, *name.split("."))


def lora_delta(a, b, scale: float) -> jax.Array:
    """``scale`` * A @ B in float32, in the base weight's layout: A [in dims..., r] and
    B [r, out dims...] -> [in dims..., out dims...]."""
    return scale * jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1)


def merge_lora(flat: dict[tuple, jax.Array], config: DecoderConfig) -> dict[tuple, jax.Array]:
    """The parameters of the plain model (path -> array, no adapters): every adapted weight
    W + (alpha / r) * A @ B, computed in float32 and stored in W's dtype."""
    merged = dict(flat)
    scale = config.lora_alpha / config.lora_rank
    for module in config.lora_targets:
        t = TARGETS[module]
        for i in range(config.num_layers):
            w_path = _layer_path(i, t.weight)
            a, b = merged.pop(_layer_path(i, t.a)), merged.pop(_layer_path(i, t.b))
            w = merged[w_path]
            merged[w_path] = (w.astype(jnp.float32) + lora_delta(a, b, scale)).astype(w.dtype)
    return merged


def peft_tensors(flat: dict[tuple, jax.Array], config: DecoderConfig) -> dict[str, jax.Array]:
    """PEFT's tensor name -> factor in torch's layout, for every adapter of ``flat``:
    ``base_model.model.<HF module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]."""
    tensors = {}
    for module in config.lora_targets:
        t = TARGETS[module]
        rule = _RULE_BY_PATH["layers.{i}." + t.weight]
        a_transform, b_transform = _FACTOR_TRANSFORMS[rule.transform]
        for i in range(config.num_layers):
            name = PEFT_PREFIX + rule.hf.format(i=i).removesuffix(".weight")
            a, b = flat[_layer_path(i, t.a)], flat[_layer_path(i, t.b)]
            tensors[f"{name}.lora_A.weight"] = TRANSFORMS[a_transform].to_hf(a)
            tensors[f"{name}.lora_B.weight"] = TRANSFORMS[b_transform].to_hf(b)
    return tensors


def peft_config(config: DecoderConfig, base: str | None, dropout: float) -> dict:
    """adapter_config.json of PEFT's LoRA for causal LMs; ``base``: the base model's directory
    (or hub name), None when it has none."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": dropout,
        "target_modules": list(config.lora_targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_peft_adapters(
    flat: dict[tuple, jax.Array],
    config: DecoderConfig,
    path: str,
    base: str | None,
    dropout: float = 0.0,
) -> None:
    """Writes adapter_config.json and adapter_model.safetensors into ``path``, which
    ``peft.PeftModel.from_pretrained(<base model>, path)`` loads."""
    write_safetensors(peft_tensors(flat, config), path, stem="adapter_model")
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config(config, base, dropout), f, indent=2)


__all__ = ["TARGETS", "Target", "lora_delta", "merge_lora", "peft_tensors", "save_peft_adapters"]
