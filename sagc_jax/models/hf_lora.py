"""LoRA adapters out to Hugging Face: merged into the weights (``save_merged``), or alone in
PEFT's layout (``save_peft_adapters``).

An adapted projection computes x @ (W + (alpha / r) * A @ B), A and B contracted over the rank
r (``models.lora``). Here A carries W's input dimensions and B its output dimensions
(``q_lora_a_dr`` [D, r], ``q_lora_b_rnh`` [r, N, H] for ``q_dnh`` [D, N, H]); PEFT stores the
same factors as torch Linear weights, ``lora_A.weight`` [r, in] and ``lora_B.weight``
[out, r], under the name of the HF module they adapt. The layout change of each factor is the
one of its base weight in ``hf_checkpoint.RULES`` on the side it shares with it, a plain
transpose on the rank's side.
"""

from __future__ import annotations

import json
import os

import jax
from flax import nnx

from sagc_jax.models import lora
from sagc_jax.models.architecture import DecoderConfig
from sagc_jax.models.hf_checkpoint import RULES, TRANSFORMS, save_hf_params, write_safetensors

# Base weight's transform -> (A's, B's): A shares W's input side, B its output side.
_FACTOR_TRANSFORMS = {
    "transpose": ("transpose", "transpose"),
    "split_out_heads": ("transpose", "split_out_heads"),
    "split_in_heads": ("split_in_heads", "transpose"),
}
_RULE_BY_PATH = {rule.path: rule for rule in RULES}
PEFT_PREFIX = "base_model.model."  # PeftModel -> the CausalLM it wraps


def peft_tensors(adapters: nnx.State, config: DecoderConfig) -> dict[str, jax.Array]:
    """PEFT's tensor name -> factor in torch's layout, for every adapter of ``config`` in
    ``adapters`` (the ``lora.LoRAParam`` part of the adapted model):
    ``base_model.model.<HF module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]."""
    flat = dict(nnx.to_flat_state(adapters))
    tensors = {}
    for module in config.lora_targets:
        t = lora.TARGETS[module]
        rule = _RULE_BY_PATH[f"layers.{{i}}.{t.module}.{t.weight}"]
        a_transform, b_transform = _FACTOR_TRANSFORMS[rule.transform]
        for i in range(config.num_layers):
            name = PEFT_PREFIX + rule.hf.format(i=i).removesuffix(".weight")
            a, b = flat[("layers", i, t.module, t.a)][...], flat[("layers", i, t.module, t.b)][...]
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
    adapters: nnx.State,
    config: DecoderConfig,
    path: str,
    base: str | None,
    dropout: float = 0.0,
) -> None:
    """Writes adapter_config.json and adapter_model.safetensors into ``path``, which
    ``peft.PeftModel.from_pretrained(<base model>, path)`` loads."""
    write_safetensors(peft_tensors(adapters, config), path, stem="adapter_model")
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(peft_config(config, base, dropout), f, indent=2)


def save_merged(
    base: nnx.State,
    adapters: nnx.State,
    config: DecoderConfig,
    path: str,
    max_shard_bytes: int | None = None,
) -> None:
    """Writes the HF checkpoint (config.json, safetensors) of the plain model that computes what
    the adapted one does: ``base`` (its weights) with ``adapters`` (its LoRAParam part) merged in
    (``lora.merge_adapters``)."""
    merged = lora.merge_adapters(adapters, base, lora.scale(config))
    flat = {p: v[...] for p, v in nnx.to_flat_state(merged)}
    save_hf_params(flat, lora.without_adapters(config), path, max_shard_bytes)


__all__ = ["peft_config", "peft_tensors", "save_merged", "save_peft_adapters"]
