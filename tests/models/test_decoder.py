"""Decoder: presets (real sizes through jax.eval_shape), dtypes, masks, KV cache, remat, axes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sagc_jax.models import (
    PRESETS,
    Decoder,
    DecoderConfig,
    get_preset,
    hf_shapes,
    init_cache,
    num_params,
)
from sagc_jax.models.decoder import Block

# Published parameter counts (tied embeddings counted once).
PUBLISHED = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
}


@nnx.jit(static_argnames="last_only")
def _apply_cached(model, tokens_bt, cache, last_only=False):
    return model.apply_cached(tokens_bt, cache, last_only=last_only)


@nnx.jit
def _forward(model, tokens_bt, mask_bt=None):
    return model(tokens_bt, mask_bt=mask_bt)


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("tiny")
    return cfg, Decoder(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_size_presets_match_published_parameter_counts(name):
    cfg = get_preset(name, param_dtype="bfloat16")
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    assert num_params(state) == PUBLISHED[name]
    chex.assert_type(jax.tree.leaves(state), jnp.bfloat16)
    # The same count seen as HF tensors (what a checkpoint of this preset must contain).
    assert sum(int(np.prod(s)) for s in hf_shapes(cfg).values()) == PUBLISHED[name]


def test_tiny_preset_is_small(tiny):
    cfg, model = tiny
    assert 100_000 < num_params(nnx.state(model, nnx.Param)) < 1_000_000
    assert set(PRESETS) >= {"tiny", *PUBLISHED}


def test_unknown_preset_names_the_allowed_ones():
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        get_preset("gpt2")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_config_round_trip(name):
    cfg = get_preset(name)
    assert DecoderConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_logits_are_float32_btv_for_int32_tokens(tiny):
    cfg, model = tiny
    tokens_bt = jnp.arange(2 * 5, dtype=jnp.int32).reshape(2, 5)
    logits_btv = _forward(model, tokens_bt)
    assert logits_btv.shape == (2, 5, cfg.vocab_size)
    assert logits_btv.dtype == jnp.float32


def test_bfloat16_params_and_compute_keep_float32_logits(tiny):
    cfg, model = tiny
    cfg16 = cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    model16 = Decoder(cfg16, rngs=nnx.Rngs(0))
    chex.assert_type(jax.tree.leaves(nnx.state(model16, nnx.Param)), jnp.bfloat16)
    tokens_bt = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    logits16_btv, logits32_btv = _forward(model16, tokens_bt), _forward(model, tokens_bt)
    assert logits16_btv.dtype == jnp.float32
    # Same init key, so the bf16 model is a rounded copy of the float32 one.
    err = float(jnp.max(jnp.abs(logits16_btv - logits32_btv)))
    assert 0 < err < 0.1 * float(jnp.max(jnp.abs(logits32_btv)))


def test_causality_future_tokens_do_not_change_past_logits(tiny):
    _, model = tiny
    a_bt = jnp.array([[5, 6, 7, 8, 9]], jnp.int32)
    b_bt = jnp.array([[5, 6, 7, 100, 200]], jnp.int32)
    np.testing.assert_allclose(
        _forward(model, a_bt)[:, :3], _forward(model, b_bt)[:, :3], atol=1e-6
    )
    assert not np.allclose(_forward(model, a_bt)[:, 3:], _forward(model, b_bt)[:, 3:], atol=1e-3)


def test_left_padding_mask_equals_unpadded_forward(tiny):
    _, model = tiny
    seq_t = jnp.array([11, 12, 13, 14], jnp.int32)
    padded_bt = jnp.array([[0, 0, 11, 12, 13, 14]], jnp.int32)
    mask_bt = jnp.array([[0, 0, 1, 1, 1, 1]], jnp.int32)
    np.testing.assert_allclose(
        _forward(model, padded_bt, mask_bt)[0, 2:], _forward(model, seq_t[None])[0], atol=1e-5
    )


def test_cached_prefill_and_decode_equal_full_forward_with_left_padding(tiny):
    cfg, model = tiny
    rng = np.random.RandomState(0)
    seqs = [rng.randint(3, cfg.vocab_size, n) for n in (9, 6)]  # prompt 5/2 + 4 decoded
    prompt_len = 5
    prompts_bt = np.zeros((2, prompt_len), np.int32)
    prompts_bt[0] = seqs[0][:5]
    prompts_bt[1, 3:] = seqs[1][:2]  # left padding: 3 pad slots
    cache = init_cache(cfg, 2, prompt_len + 4, start_b=[0, 3])
    logits_b1v, cache = _apply_cached(model, jnp.asarray(prompts_bt), cache, last_only=True)
    steps = [logits_b1v]
    for i in range(3):
        next_b1 = jnp.array([[seqs[0][5 + i]], [seqs[1][2 + i]]], jnp.int32)
        logits_b1v, cache = _apply_cached(model, next_b1, cache)
        steps.append(logits_b1v)
    assert int(cache.index) == prompt_len + 3
    for row, (seq, n_prompt) in enumerate(zip(seqs, (5, 2), strict=True)):
        full_tv = _forward(model, jnp.asarray(seq[None], jnp.int32))[0]
        want_tv = full_tv[n_prompt - 1 : n_prompt + 3]
        got_tv = jnp.stack([s[row, 0] for s in steps])
        np.testing.assert_allclose(got_tv, want_tv, atol=1e-5)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("policy", ["none", "full", "dots"])
def test_remat_and_scanned_layers_give_same_logits_and_gradients(tiny, policy, scan_layers):
    """Scanned over their stacked weights, each layer's gradient lands on its own weights, as
    the unrolled layers' do."""
    cfg = tiny[0].replace(num_layers=3)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    other = Decoder(cfg.replace(remat=policy, scan_layers=scan_layers), rngs=nnx.Rngs(0))
    tokens_bt = jnp.array([[1, 2, 3, 4, 5, 6]], jnp.int32)

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(tokens_bt))[..., 7])

    g_plain = nnx.jit(nnx.grad(loss))(model)
    g_other = nnx.jit(nnx.grad(loss))(other)
    chex.assert_trees_all_close(g_plain, g_other, rtol=1e-6, atol=1e-6)


def _backward_temp_bytes(cfg: DecoderConfig, rows: int, length: int) -> int:
    """Temporary bytes of the compiled gradient of ``cfg``'s forward (``memory_analysis``)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))

    def loss(params, tokens_bt):
        return jnp.sum(nnx.merge(graphdef, params)(tokens_bt) ** 2)

    tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(abstract, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA CPU's scheduler")
def test_remat_full_keeps_about_one_layer_input_per_layer():
    """What each more layer adds to the compiled backward with remat full: its input and little
    else. XLA CPU's default (breadth-first) scheduler put each layer's recomputation beside its
    forward, so the update kept every layer's activations (24 layer inputs a layer here, as many
    as without remat); sagc_jax sets XLA_FLAGS to the depth-first scheduler (about 2). Scanned,
    one layer is recomputed at a time whatever the scheduler; each layer then also adds its
    weights' copy in the stack and that copy's gradient."""
    cfg = DecoderConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        attention="einsum",
    )
    rows, length = 8, 64
    layer_input = rows * length * cfg.hidden_size * 4  # float32 [B, T, D]
    block = nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0)))
    layer_weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(block)))
    variants = {
        "none": (cfg, 0),
        "full": (cfg.replace(remat="full"), 0),
        "full, scanned": (cfg.replace(remat="full", scan_layers=True), 2 * layer_weights),
    }
    per_layer = {
        name: (
            (
                _backward_temp_bytes(arch.replace(num_layers=4), rows, length)
                - _backward_temp_bytes(arch.replace(num_layers=2), rows, length)
            )
            / 2
            - stacked
        )
        / layer_input
        for name, (arch, stacked) in variants.items()
    }
    assert per_layer["full"] <= 4, per_layer
    assert per_layer["full, scanned"] <= 4, per_layer
    assert per_layer["full"] <= per_layer["none"] / 4, per_layer


def test_every_parameter_has_one_logical_axis_name_per_dimension(tiny):
    _, model = tiny
    state = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(state)
    for (path, var), (_, spec) in zip(
        nnx.to_flat_state(state), nnx.to_flat_state(specs), strict=True
    ):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var[...].ndim, path
        assert all(isinstance(n, str) for n in names), path
        assert tuple(spec.get_value()) == tuple(names), path
    q_names = dict(nnx.to_flat_state(state))[("layers", 0, "attn", "q_dnh")].get_metadata()
    assert q_names["out_sharding"] == ("embed", "q_heads", "head_dim")
