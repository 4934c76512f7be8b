"""LoRA adapters of the decoder's projections: their variable type, how a layer gets them, what
they add to its output, and the weight change they stand for.

An adapted weight W (say ``q_dnh``, [D, N, H]) gets two adapters named after it: A
(``q_lora_a_dr``, [D, R]) and B (``q_lora_b_rnh``, [R, N, H]), R the rank. The projection then
computes x @ W + (alpha / R) * (x @ A) @ B, which is x @ (W + delta) with delta = (alpha / R) *
A @ B contracted over R (:func:`delta`, in W's own layout). A is drawn normal with std
1/sqrt(in features) (the role of PEFT's kaiming-uniform A, whose std is 1/sqrt(3 in)), B is
zeros: a fresh adapter leaves the model exactly as it was. Adapters are float32 whatever the
weights' dtype (as PEFT keeps them), and carry the logical axes of the dimensions they share
with W (None for R), so one sharding plan splits weights and adapters by the same rules.
With a dropout rate and keys (the update's forward only), each adapter's input x is dropped
(scaled by 1 / (1 - rate)) before A, as PEFT does. The keys are one per token
(:func:`token_keys`: its rollout and its position in it), so a token's masks follow what it is,
not the row, column or micro-batch it sits in: leaving rollouts out of the update, packing them
or splitting the batch changes no mask.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sagc_jax.models import axes as ax
from sagc_jax.models.architecture import DecoderConfig

# flax's LoRA variable type (a subclass of nnx.Param): ``nnx.split(model, LoRAParam, ...)``
# separates the adapters from the weights they adapt (and Tunix/qwix filters recognise them).
LoRAParam = nnx.LoRAParam


class Target(NamedTuple):
    """Where a LoRA target lives: the layer module, the weight and its two adapters' names."""

    module: str  # "attn" (layers.Attention) or "mlp" (layers.MLP)
    weight: str
    a: str  # [in dims..., R]: the letters after "_a_" are the input dims, then "r"
    b: str  # [R, out dims...]


# By Hugging Face / PEFT module name (models.architecture.LORA_TARGETS).
TARGETS = {
    "q_proj": Target("attn", "q_dnh", "q_lora_a_dr", "q_lora_b_rnh"),
    "k_proj": Target("attn", "k_dkh", "k_lora_a_dr", "k_lora_b_rkh"),
    "v_proj": Target("attn", "v_dkh", "v_lora_a_dr", "v_lora_b_rkh"),
    "o_proj": Target("attn", "o_nhd", "o_lora_a_nhr", "o_lora_b_rd"),
    "gate_proj": Target("mlp", "gate_df", "gate_lora_a_dr", "gate_lora_b_rf"),
    "up_proj": Target("mlp", "up_df", "up_lora_a_dr", "up_lora_b_rf"),
    "down_proj": Target("mlp", "down_fd", "down_lora_a_fr", "down_lora_b_rd"),
}
_BY_A = {t.a: t for t in TARGETS.values()}
_FIRST_INDEX = 16  # A's draw: fold_in(module key, 16 + i), after the module's own weights' draws


def scale(cfg: DecoderConfig) -> float:
    """alpha / R, the factor of every adapter's output."""
    return cfg.lora_alpha / cfg.lora_rank


def add_adapters(module: nnx.Module, cfg: DecoderConfig, key: jax.Array, kind: str) -> None:
    """Gives ``module`` (a layer of ``kind`` "attn" or "mlp") the adapters of its weights named in
    ``cfg.lora_targets``, shaped and named by those weights (no-op when ``cfg.lora_rank`` is 0)."""
    r = cfg.lora_rank
    if not r:
        return
    module.lora_scale = scale(cfg)
    module.lora_dropout = cfg.lora_dropout
    for i, (name, t) in enumerate(TARGETS.items()):
        if t.module != kind or name not in cfg.lora_targets:
            continue
        weight = getattr(module, t.weight)
        shape, axes = weight.shape, tuple(weight.get_metadata()["out_sharding"])
        ins = len(t.a.rsplit("_", 1)[1]) - 1  # input dims of W: "dr" -> 1, "nhr" -> 2
        a = ax.param(
            key,
            "normal",
            (*shape[:ins], r),
            (*axes[:ins], None),
            jnp.float32,
            fan_in=math.prod(shape[:ins]),
            index=_FIRST_INDEX + i,
            kind=LoRAParam,
        )
        b_shape, b_axes = (r, *shape[ins:]), (None, *axes[ins:])
        b = ax.param(None, "zeros", b_shape, b_axes, jnp.float32, kind=LoRAParam)
        setattr(module, t.a, a)
        setattr(module, t.b, b)


def token_keys(key: jax.Array, rollout_bt: jax.Array, positions_bt: jax.Array) -> jax.Array:
    """Typed keys [B, T] of LoRA dropout, one per token: fold_in(fold_in(key, rollout),
    position), from int [B, T] rollout ids and positions in the rollout (0 at its first prompt
    token). The same token of the same rollout gets the same key wherever it sits."""
    one = lambda r, s: jax.random.fold_in(jax.random.fold_in(key, r), s)  # noqa: E731
    return jax.vmap(jax.vmap(one))(rollout_bt, positions_bt)


def _per_key(fn, keys: jax.Array) -> jax.Array:
    """``fn(key)`` of every key of ``keys`` (any shape: jax.random takes one key at a time),
    stacked in ``keys``' shape (vmapped, no reshape of the batch's split rows)."""
    for _ in range(keys.ndim):
        fn = jax.vmap(fn)
    return fn(keys)


def fold_keys(keys: jax.Array, data) -> jax.Array:
    """``jax.random.fold_in(k, data)`` of every key of ``keys``."""
    return _per_key(lambda k: jax.random.fold_in(k, data), keys)


def _dropped(x: jax.Array, keys: jax.Array, rate: float) -> jax.Array:
    """``x`` [B, T, ...] with each entry zeroed at ``rate`` (the rest scaled by 1 / (1 - rate)),
    token [b, t]'s entries drawn with ``keys[b, t]``."""
    keep = 1.0 - rate
    per_token = x.shape[keys.ndim :]
    keep_bt = _per_key(lambda k: jax.random.bernoulli(k, keep, per_token), keys)
    return jnp.where(keep_bt, x / keep, 0).astype(x.dtype)


def adapted(
    module: nnx.Module,
    target: str,
    y: jax.Array,
    x: jax.Array,
    specs: str,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """``y`` (the output x @ W) plus the adapter's (alpha / R) * (x @ A) @ B when ``module``
    adapts ``target``, else ``y`` unchanged. ``specs``: the two einsums, e.g.
    "BTD,DR->BTR;BTR,RNH->BTNH". In ``y``'s dtype (the compute dtype). With ``dropout_key``
    (typed keys [B, T], one per token of x: :func:`token_keys`), x is dropped at the module's
    ``lora_dropout`` rate first (each token's key folded with the target)."""
    t = TARGETS[target]
    if not hasattr(module, t.a):
        return y
    a_spec, b_spec = specs.split(";")
    cd = y.dtype
    if dropout_key is not None and module.lora_dropout > 0:
        keys = fold_keys(dropout_key, list(TARGETS).index(target))
        x = _dropped(x, keys, module.lora_dropout)
    x_a = jnp.einsum(a_spec, x, getattr(module, t.a)[...].astype(cd))
    return y + module.lora_scale * jnp.einsum(b_spec, x_a, getattr(module, t.b)[...].astype(cd))


def delta(a: jax.Array, b: jax.Array, lora_scale: float) -> jax.Array:
    """float32 (alpha / R) * A @ B: A [in..., R] and B [R, out...] -> [in..., out...], the
    change of the adapted weight in its own layout (``delta_dnh`` of q_proj, ``delta_nhd`` of
    o_proj, ...)."""
    return lora_scale * jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1)


def merge_adapters(adapters: nnx.State, base: nnx.State, lora_scale: float) -> nnx.State:
    """``base`` (the weights of the model without adapters) with every adapted weight replaced
    by W + delta, in W's dtype: the state of the plain model that computes what the adapted one
    does. ``adapters``: the LoRAParam part of the adapted model (``nnx.split(model, LoRAParam,
    ...)``); jit-friendly."""
    weights = dict(nnx.to_flat_state(base))
    pieces = dict(nnx.to_flat_state(adapters))
    for path, a in pieces.items():
        *where, name = path
        t = _BY_A.get(name)
        if t is None:
            continue  # a B: taken with its A
        w = weights[(*where, t.weight)]
        d = delta(a[...], pieces[(*where, t.b)][...], lora_scale)
        weights[(*where, t.weight)] = w.replace((w[...].astype(jnp.float32) + d).astype(w.dtype))
    return nnx.from_flat_state(weights)


def without_adapters(cfg: DecoderConfig) -> DecoderConfig:
    """The architecture of the base model (no adapters) of ``cfg``."""
    return cfg.replace(lora_rank=0)
