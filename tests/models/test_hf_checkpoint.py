"""Hugging Face checkpoints: parity with transformers (CPU torch), export round trip, errors."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from hf_tiny import COMMON, forward, hf_logits, randomize

from sagc_jax.models import (
    CheckpointMismatchError,
    init_cache,
    load_hf_checkpoint,
    save_hf_checkpoint,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that the 24-token test sequences reach the scaled frequency bands.
    "original_max_position_embeddings": 16,
}
CASES = {
    # GQA (4 q heads on 2 kv heads), untied embeddings, llama3 rope scaling.
    "llama_gqa_untied_llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=500_000.0,
            rope_scaling=LLAMA3_ROPE,
        ),
    ),
    # Plain multi-head attention, tied embeddings, default rope.
    "llama_mha_tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    ),
    # Qwen2: q/k/v biases, GQA (8 on 2), tied, its rope theta.
    "qwen2_bias_gqa_tied": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=1_000_000.0,
        ),
    ),
}
TOKENS_BT = np.random.RandomState(0).randint(0, COMMON["vocab_size"], (2, 24)).astype(np.int32)


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
    """(directory of a saved random transformers model, its logits on TOKENS_BT, case name)."""
    config_cls, model_cls, kwargs = CASES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **kwargs)).eval()
    randomize(model, seed=1)
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    return path, hf_logits(model, TOKENS_BT), request.param


def test_logits_match_transformers(hf_case):
    path, want_btv, name = hf_case
    model, cfg = load_hf_checkpoint(path)
    got_btv = forward(model, jnp.asarray(TOKENS_BT))
    assert got_btv.dtype == jnp.float32 and got_btv.shape == want_btv.shape
    assert np.abs(want_btv).max() > 1.0  # a comparison of meaningful logits
    assert np.abs(np.asarray(got_btv) - want_btv).max() <= 1e-4, name
    assert cfg.qkv_bias == name.startswith("qwen2")
    assert cfg.tie_embeddings == name.endswith("tied")
    assert (cfg.rope_scaling is not None) == name.endswith("llama3")


def test_export_round_trip_loads_in_transformers(hf_case, tmp_path):
    path, want_btv, name = hf_case
    model, cfg = load_hf_checkpoint(path)
    save_hf_checkpoint(model, cfg, str(tmp_path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert np.abs(hf_logits(hf_model, TOKENS_BT) - want_btv).max() <= 1e-4, name
    reloaded, cfg2 = load_hf_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    np.testing.assert_array_equal(
        forward(reloaded, jnp.asarray(TOKENS_BT)), forward(model, jnp.asarray(TOKENS_BT))
    )


def test_cached_decoding_matches_transformers_full_forward(hf_case):
    path, want_btv, _ = hf_case
    model, cfg = load_hf_checkpoint(path)
    prompt_len, t = 16, TOKENS_BT.shape[1]
    apply = nnx.jit(lambda m, x, c: m.apply_cached(x, c))
    cache = init_cache(cfg, 2, t)
    logits_btv, cache = apply(model, jnp.asarray(TOKENS_BT[:, :prompt_len]), cache)
    steps = [logits_btv]
    for i in range(prompt_len, t):
        logits_b1v, cache = apply(model, jnp.asarray(TOKENS_BT[:, i : i + 1]), cache)
        steps.append(logits_b1v)
    got_btv = np.concatenate([np.asarray(s) for s in steps], axis=1)
    assert np.abs(got_btv - want_btv).max() <= 1e-4


def test_bfloat16_load_keeps_float32_logits_close(hf_case):
    path, want_btv, _ = hf_case
    model, cfg = load_hf_checkpoint(path, dtype="bfloat16")
    assert cfg.param_dtype == cfg.compute_dtype == "bfloat16"
    assert model.embed_vd[...].dtype == jnp.bfloat16
    got_btv = np.asarray(forward(model, jnp.asarray(TOKENS_BT)))
    assert got_btv.dtype == np.float32
    # bf16 has 8 mantissa bits: a few percent of the logit scale, far from random.
    assert np.abs(got_btv - want_btv).max() < 0.1 * np.abs(want_btv).max()


# ---------------------------------------------------------------------- sharded files
def test_sharded_checkpoints_both_ways(hf_case, tmp_path):
    path, want_btv, _ = hf_case
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    hf_model.save_pretrained(str(tmp_path / "hf_sharded"), max_shard_size="20KB")
    assert os.path.exists(tmp_path / "hf_sharded" / "model.safetensors.index.json")
    model, cfg = load_hf_checkpoint(str(tmp_path / "hf_sharded"))
    assert np.abs(np.asarray(forward(model, jnp.asarray(TOKENS_BT))) - want_btv).max() <= 1e-4
    save_hf_checkpoint(model, cfg, str(tmp_path / "ours_sharded"), max_shard_bytes=20_000)
    with open(tmp_path / "ours_sharded" / "model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    hf_again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours_sharded"))
    assert np.abs(hf_logits(hf_again.eval(), TOKENS_BT) - want_btv).max() <= 1e-4


# ---------------------------------------------------------------------- errors
@pytest.fixture
def qwen_dir(tmp_path):
    config_cls, model_cls, kwargs = CASES["qwen2_bias_gqa_tied"]
    torch.manual_seed(0)
    model_cls(config_cls(**COMMON, **kwargs)).save_pretrained(str(tmp_path))
    return tmp_path


def _edit_tensors(path, edit):
    file = str(path / "model.safetensors")
    tensors = safetensors.numpy.load_file(file)
    edit(tensors)
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


def _error_line(excinfo, name):
    lines = [line for line in str(excinfo.value).splitlines() if repr(name) in line]
    assert len(lines) == 1, str(excinfo.value)
    return lines[0]


def test_missing_tensor_names_tensor_and_shapes(qwen_dir):
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_tensors(qwen_dir, lambda t: t.pop(name))
    with pytest.raises(CheckpointMismatchError) as excinfo:
        load_hf_checkpoint(str(qwen_dir))
    line = _error_line(excinfo, name)
    assert "missing" in line and "None" in line and "(56, 32)" in line


def test_unexpected_tensor_names_tensor_and_shapes(qwen_dir):
    name = "model.layers.0.self_attn.o_proj.bias"
    _edit_tensors(qwen_dir, lambda t: t.update({name: np.zeros(32, np.float32)}))
    with pytest.raises(ValueError) as excinfo:
        load_hf_checkpoint(str(qwen_dir))
    line = _error_line(excinfo, name)
    assert "unexpected" in line and "(32,)" in line and "None" in line


def test_misshaped_tensor_names_tensor_and_both_shapes(qwen_dir):
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit_tensors(qwen_dir, lambda t: t.update({name: np.zeros((32, 32), np.float32)}))
    with pytest.raises(CheckpointMismatchError) as excinfo:
        load_hf_checkpoint(str(qwen_dir))
    line = _error_line(excinfo, name)
    assert "(32, 32)" in line and "(8, 32)" in line  # checkpoint vs expected (2 kv heads x 4)
