"""LoRA export: merged Hugging Face weights and PEFT-layout adapters, checked against
transformers + PEFT's own LoRA forward (CPU torch)."""

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from sagc_jax.models import Decoder, load_hf_checkpoint, lora
from sagc_jax.models.hf_lora import save_merged, save_peft_adapters

COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=56,
    num_hidden_layers=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
CASES = {
    # GQA, untied embeddings, every projection adapted
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        tuple(lora.TARGETS),
    ),
    # q/k/v biases (not adapted: bias "none"), tied embeddings, a subset of projections
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
        ("q_proj", "v_proj", "o_proj", "down_proj"),
    ),
}
TOKENS_BT = np.random.RandomState(0).randint(0, COMMON["vocab_size"], (2, 16)).astype(np.int32)
RANK, ALPHA = 4, 8.0


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of unit-scale activations (HF's std-0.02 init gives near-zero logits)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _hf_logits(model, tokens_bt) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens_bt, dtype=torch.long)).logits.float().numpy()


@nnx.jit
def _forward(model, tokens_bt):
    return model(tokens_bt)


def _adapted_model(base_dir: str, targets: tuple[str, ...], seed: int) -> Decoder:
    """The model of ``base_dir`` with adapters on ``targets``: A as initialised, B drawn too
    (LoRA's zero B would make every check below pass trivially)."""
    base, cfg = load_hf_checkpoint(base_dir)
    model = Decoder(
        cfg.replace(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=targets), rngs=nnx.Rngs(seed)
    )
    nnx.update(model, nnx.state(base))
    adapters = nnx.state(model, lora.LoRAParam)
    key = jax.random.key(seed)
    for path, var in nnx.to_flat_state(adapters):
        if "_lora_b_" in path[-1]:
            key, sub = jax.random.split(key)
            var.set_value(0.5 * jax.random.normal(sub, var.shape) / RANK**0.5)
    nnx.update(model, adapters)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    """A random transformers model, random adapters on it, and both exports of them."""
    config_cls, model_cls, kwargs, targets = CASES[request.param]
    torch.manual_seed(0)
    hf_model = model_cls(config_cls(**COMMON, **kwargs)).eval()
    _randomize(hf_model, seed=1)
    root = tmp_path_factory.mktemp(request.param)
    base_dir, adapter_dir, merged_dir = (str(root / d) for d in ("base", "adapter", "merged"))
    hf_model.save_pretrained(base_dir)
    model = _adapted_model(base_dir, targets, seed=2)
    _, adapters, base = nnx.split(model, lora.LoRAParam, nnx.Param)
    save_peft_adapters(adapters, model.config, adapter_dir, base=base_dir)
    save_merged(base, adapters, model.config, merged_dir)
    return dict(
        logits=np.asarray(_forward(model, jnp.asarray(TOKENS_BT))),
        base_dir=base_dir,
        adapter_dir=adapter_dir,
        merged_dir=merged_dir,
        model_cls=model_cls,
        base_logits=_hf_logits(hf_model, TOKENS_BT),
        name=request.param,
    )


def test_peft_loads_the_adapters_and_agrees_with_the_merged_export(exported):
    base = exported["model_cls"].from_pretrained(exported["base_dir"]).eval()
    peft_model = peft.PeftModel.from_pretrained(base, exported["adapter_dir"]).eval()
    assert isinstance(peft_model.peft_config["default"], peft.LoraConfig)
    want_btv = _hf_logits(peft_model, TOKENS_BT)
    # the adapters change the logits (so the comparisons below can fail)
    assert np.abs(want_btv - exported["base_logits"]).max() > 0.5, exported["name"]

    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(exported["merged_dir"]).eval()
    assert np.abs(_hf_logits(merged_hf, TOKENS_BT) - want_btv).max() <= 1e-4
    merged, _ = load_hf_checkpoint(exported["merged_dir"])
    got_btv = np.asarray(_forward(merged, jnp.asarray(TOKENS_BT)))
    assert np.abs(got_btv - want_btv).max() <= 1e-4, exported["name"]
    # and our adapted model (the adapters unmerged) computes the same
    assert np.abs(exported["logits"] - want_btv).max() <= 1e-4, exported["name"]
