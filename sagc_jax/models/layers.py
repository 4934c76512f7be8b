"""Decoder building blocks: RMSNorm, RoPE (with `llama3` scaling), grouped-query attention, SwiGLU.

Shapes use B batch, T query length, S key length (cache length), D model, N query heads,
K kv heads, Q = N // K query heads per kv head (G is the GRPO group size elsewhere), H head
dim, F mlp, R LoRA rank.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sagc_jax.models import axes as ax
from sagc_jax.models import lora
from sagc_jax.models.architecture import ATTENTION_PATHS, DecoderConfig, Llama3RopeScaling

# Finite, so that a query row with every key masked (a left-padding slot) stays NaN-free.
_MASKED = -0.7 * float(np.finfo(np.float32).max)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, the statistics in float32 (as transformers computes them)."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        del rngs
        self.eps = cfg.rms_norm_eps
        self.scale_d = ax.param(None, "ones", (cfg.hidden_size,), (ax.EMBED,), cfg.param_jnp_dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x32_btd = x_btd.astype(jnp.float32)
        var_bt1 = jnp.mean(jnp.square(x32_btd), axis=-1, keepdims=True)
        normed_btd = (x32_btd * jax.lax.rsqrt(var_bt1 + self.eps)).astype(x_btd.dtype)
        return self.scale_d[...].astype(x_btd.dtype) * normed_btd


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [H/2] (float32), with the `llama3` frequency-dependent scaling."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if scaling is None:
        return inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, inv_freq_h2: np.ndarray) -> jax.Array:
    """Rotates halves (x1, x2) of the head dim by position * inv_freq (transformers layout)."""
    angles_bth2 = positions_bt.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq_h2)
    sin_bt1h2 = jnp.sin(angles_bth2)[:, :, None, :]
    cos_bt1h2 = jnp.cos(angles_bth2)[:, :, None, :]
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate(
        [x1 * cos_bt1h2 - x2 * sin_bt1h2, x2 * cos_bt1h2 + x1 * sin_bt1h2], axis=-1
    )
    return rotated.astype(x_btnh.dtype)


_SPLASH_BLOCKS = (512, 256, 128)  # splash tiles: the row length must divide by one of them
# The platform "auto" resolves for while programs are traced for devices that are only described
# (ahead-of-time compiles for a TPU slice from a CPU host: ``planning.aot``); None: this host's.
_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attention_platform", default=None
)


@contextlib.contextmanager
def attention_platform(platform: str):
    """Within it, ``attention="auto"`` resolves as on ``platform`` ("tpu", "gpu", "cpu")."""
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def resolve_attention(implementation: str, dtype, length: int, backend: str | None = None) -> str:
    """The attention path a full forward of ``length`` tokens takes.

    auto: cuDNN flash attention on GPU for bfloat16/float16 (cuDNN has no float32 kernel),
    splash attention on TPU when the length divides into its 128-token tiles, the einsum
    path otherwise (CPU, float32 on GPU, odd lengths).
    """
    if implementation != "auto":
        return implementation
    backend = backend or _TARGET_PLATFORM.get() or jax.default_backend()
    if backend in ("gpu", "cuda", "rocm") and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    if backend == "tpu" and length % _SPLASH_BLOCKS[-1] == 0:
        return "splash"
    return "einsum"


def attend(
    q_btnh: jax.Array,
    k_bkhs: jax.Array,
    v_bksh: jax.Array,
    *,
    mask_bts: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    implementation: str = "einsum",
) -> jax.Array:
    """Grouped-query attention; scores and softmax in float32. Returns [B, T, N, H].

    Exactly one of:
      mask_bts: bool [B, T, S], the keys each query sees (the KV-cache path: S cache slots);
        always the einsum path;
      segment_ids_bt: int [B, T], causal attention within equal ids (S = T, no cache): a
        packed row holds several sequences, padding is its own segment (0). This is what the
        fused kernels take, so ``implementation`` ("einsum", "cudnn", "splash" or "auto", see
        :func:`resolve_attention`) applies here.

    Keys are [B, K, H, S] and values [B, K, S, H] (with a mask, also tuples of blocks along S:
    a cache that grows in blocks, see `KVCache`): both products are then plain (not transposed)
    matmuls batched over (B, K), the layouts a decode step reads fastest from the cache. The
    kernels take [B, S, K, H]; XLA folds the transposes on the way.
    """
    if (mask_bts is None) == (segment_ids_bt is None):
        raise ValueError("attend takes exactly one of mask_bts and segment_ids_bt")
    if mask_bts is None:
        t = q_btnh.shape[1]
        implementation = resolve_attention(implementation, q_btnh.dtype, t)
        if implementation == "cudnn":
            return _attend_dot_product(q_btnh, k_bkhs, v_bksh, segment_ids_bt, "cudnn")
        if implementation == "splash":
            return _attend_splash(q_btnh, k_bkhs, v_bksh, segment_ids_bt)
        if implementation != "einsum":
            raise ValueError(
                f"attention implementation {implementation!r}; allowed: "
                f"{', '.join(ATTENTION_PATHS)}"
            )
        causal_tt = jnp.tril(jnp.ones((t, t), jnp.bool_))
        mask_bts = causal_tt[None] & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
    return _attend_einsum(q_btnh, k_bkhs, v_bksh, mask_bts)


def _attend_einsum(q_btnh, k_bkhs, v_bksh, mask_bts) -> jax.Array:
    """Keys and values as arrays, or as tuples of blocks along S (`cache_blocks`): the scores
    of the blocks side by side under one softmax, the values' products summed."""
    b, t, n, h = q_btnh.shape
    k_blocks, v_blocks = cache_blocks(k_bkhs), cache_blocks(v_bksh)
    k = k_blocks[0].shape[1]
    q_bkqth = q_btnh.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    scores_bkqts = jnp.concatenate(
        [
            jnp.einsum("BKQTH,BKHS->BKQTS", q_bkqth, x, preferred_element_type=jnp.float32)
            for x in k_blocks
        ],
        axis=-1,
    ) * (h**-0.5)
    scores_bkqts = jnp.where(mask_bts[:, None, None, :, :], scores_bkqts, _MASKED)
    probs_bkqts = jax.nn.softmax(scores_bkqts, axis=-1).astype(v_blocks[0].dtype)
    starts = np.cumsum([0] + [x.shape[2] for x in v_blocks])
    out_bkqth = functools.reduce(
        jnp.add,
        [
            jnp.einsum("BKQTS,BKSH->BKQTH", probs_bkqts[..., a:z], x)
            for x, a, z in zip(v_blocks, starts[:-1], starts[1:], strict=True)
        ],
    )
    return out_bkqth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _attend_dot_product(q_btnh, k_bkhs, v_bksh, segment_ids_bt, implementation: str):
    """``jax.nn.dot_product_attention`` (cuDNN flash attention on GPU): causal, with the
    segments as a [B, 1, T, T] mask (the public API takes no segment ids; cuDNN's packed
    layout with offsets would skip the cross-segment blocks too, see the note in the module)."""
    same_b1ts = (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q_btnh,
        k_bkhs.transpose(0, 3, 1, 2),
        v_bksh.transpose(0, 2, 1, 3),
        mask=same_b1ts,
        is_causal=True,
        implementation=implementation,
    ).astype(q_btnh.dtype)


def _attend_splash(q_btnh, k_bkhs, v_bksh, segment_ids_bt, interpret: bool = False):
    """TPU splash attention (causal mask, segment ids), one multi-query kernel per KV head;
    under sharding rules it runs per device on its rows (``shard_map`` over the batch axes)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as splash_mask,
    )

    b, t, n, h = q_btnh.shape
    k = k_bkhs.shape[1]
    block = next((size for size in _SPLASH_BLOCKS if t % size == 0), None)
    if block is None:
        raise ValueError(
            f"splash attention needs a row length that divides by {_SPLASH_BLOCKS[-1]}, got {t}; "
            f"set train.pack_len to a multiple of {_SPLASH_BLOCKS[-1]} or model.attention: einsum"
        )
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * (n // k))
    kernel = splash.make_splash_mqa_single_device(mask=mask, block_sizes=sizes, interpret=interpret)

    def local(q_btnh, k_bkhs, v_bksh, segment_ids_bt):
        lb = q_btnh.shape[0]
        # [B, K, G, T, H] queries, pre-scaled (the kernel does not scale)
        q_bkqth = (q_btnh * h**-0.5).reshape(lb, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
        k_bksh = k_bkhs.transpose(0, 1, 3, 2)

        def one_row(q_kgth, k_ksh, v_ksh, seg_t):
            ids = splash.SegmentIds(q=seg_t, kv=seg_t)
            return jax.vmap(lambda q, k_, v: kernel(q, k_, v, segment_ids=ids))(
                q_kgth, k_ksh, v_ksh
            )

        out_bkqth = jax.vmap(one_row)(q_bkqth, k_bksh, v_bksh, segment_ids_bt)
        return out_bkqth.transpose(0, 3, 1, 2, 4).reshape(lb, t, n, h).astype(q_btnh.dtype)

    active = ax.active_rules()
    if active is None:
        return local(q_btnh, k_bkhs, v_bksh, segment_ids_bt)
    mesh, rules = active
    rows = ax.mesh_spec((ax.BATCH,), (b,), mesh, rules)[0]
    spec = jax.sharding.PartitionSpec(rows)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=False)(
        q_btnh, k_bkhs, v_bksh, segment_ids_bt
    )


def cache_blocks(x) -> tuple[jax.Array, ...]:
    """A layer's cached keys or values as a tuple of blocks along S (one: the array itself)."""
    return x if isinstance(x, tuple) else (x,)


def _write(k_bkhs, v_bksh, k_bkht, v_bkth, index):
    """The T new keys and values written at slots [index, index + T): ``index`` a scalar, or
    int32 [B] with T = 1 (row b writes at its own slot: a scatter along the rows)."""
    zero = jnp.zeros((), jnp.int32)
    k_bkht, v_bkth = k_bkht.astype(k_bkhs.dtype), v_bkth.astype(v_bksh.dtype)
    if index.ndim == 0:  # every row writes at the same slot
        return (
            jax.lax.dynamic_update_slice(k_bkhs, k_bkht, (zero, zero, zero, index)),
            jax.lax.dynamic_update_slice(v_bksh, v_bkth, (zero, zero, index, zero)),
        )
    return (
        jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (zero, zero, i)))(
            k_bkhs, k_bkht, index
        ),
        jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (zero, i, zero)))(
            v_bksh, v_bkth, index
        ),
    )


def _write_blocks(k_blocks, v_blocks, k_bkh1, v_bk1h, index):
    """One new key and value per row written at slot index[b] (or every row's at the scalar
    ``index``) of a cache in blocks along S: the block that holds a row's slot takes its value,
    the others get back the value they already have there (an update slice clamps its start,
    so it cannot simply be skipped)."""
    zero = jnp.zeros((), jnp.int32)

    def put(c, x, i, inside, axis):
        """x written into c at slot i along axis where inside, c's own value there elsewhere."""
        at = [zero] * c.ndim
        at[axis] = i
        old = jax.lax.dynamic_slice(c, at, x.shape)
        return jax.lax.dynamic_update_slice(c, jnp.where(inside, x.astype(c.dtype), old), at)

    new_k, new_v, offset = [], [], 0
    for k_bkhs, v_bksh in zip(k_blocks, v_blocks, strict=True):
        width = v_bksh.shape[2]
        local = index - offset
        inside = (local >= 0) & (local < width)
        local = jnp.clip(local, 0, width - 1)
        if index.ndim == 0:  # one slot for every row: one slice of the whole batch
            new_k.append(put(k_bkhs, k_bkh1, local, inside, 3))
            new_v.append(put(v_bksh, v_bk1h, local, inside, 2))
        else:
            new_k.append(jax.vmap(functools.partial(put, axis=2))(k_bkhs, k_bkh1, local, inside))
            new_v.append(jax.vmap(functools.partial(put, axis=1))(v_bksh, v_bk1h, local, inside))
        offset += width
    return tuple(new_k), tuple(new_v)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v biases and an optional KV cache."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        d, n, k, h, dt = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.param_jnp_dtype,
        )
        self.compute_dtype = cfg.compute_jnp_dtype
        self.implementation = cfg.attention  # of the full (no-cache) forward
        # One draw from rngs per module: each draw is a traced state update, slow under eval_shape.
        key = rngs.params()
        # Hashable rope settings (not an array): the frequencies are trace-time constants.
        self.rope = (h, cfg.rope_theta, cfg.rope_scaling)
        qkv_axes = (ax.EMBED, ax.Q_HEADS, ax.HEAD_DIM), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM)
        self.q_dnh = ax.param(key, "normal", (d, n, h), qkv_axes[0], dt, fan_in=d, index=0)
        self.k_dkh = ax.param(key, "normal", (d, k, h), qkv_axes[1], dt, fan_in=d, index=1)
        self.v_dkh = ax.param(key, "normal", (d, k, h), qkv_axes[1], dt, fan_in=d, index=2)
        o_axes = (ax.Q_HEADS, ax.HEAD_DIM, ax.EMBED)
        self.o_nhd = ax.param(key, "normal", (n, h, d), o_axes, dt, fan_in=n * h, index=3)
        self.qkv_bias = cfg.qkv_bias
        if cfg.qkv_bias:
            self.q_bias_nh = ax.param(None, "zeros", (n, h), (ax.Q_HEADS, ax.HEAD_DIM), dt)
            self.k_bias_kh = ax.param(None, "zeros", (k, h), (ax.KV_HEADS, ax.HEAD_DIM), dt)
            self.v_bias_kh = ax.param(None, "zeros", (k, h), (ax.KV_HEADS, ax.HEAD_DIM), dt)
        lora.add_adapters(self, cfg, key, "attn")

    def __call__(
        self,
        x_btd: jax.Array,
        positions_bt: jax.Array,
        mask_bts: jax.Array | None = None,
        kv_cache: tuple[jax.Array, jax.Array] | None = None,
        cache_index: jax.Array | None = None,
        segment_ids_bt: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """x [B, T, D] -> ([B, T, D], updated (k [B, K, H, S], v [B, K, S, H]) or None).

        Without a cache, S = T and attention is causal within equal `segment_ids_bt` [B, T]
        (see `attend`). With a cache, the new keys and values are written at slots
        [cache_index, cache_index + T) (a scalar, or int32 [B] with T = 1: one slot per row) and
        `mask_bts` covers all S cache slots.
        `dropout_key`: LoRA dropout on the adapters' inputs (`lora.adapted`).
        """
        cd = self.compute_dtype
        q_btnh = jnp.einsum("BTD,DNH->BTNH", x_btd, self.q_dnh[...].astype(cd))
        k_btkh = jnp.einsum("BTD,DKH->BTKH", x_btd, self.k_dkh[...].astype(cd))
        v_btkh = jnp.einsum("BTD,DKH->BTKH", x_btd, self.v_dkh[...].astype(cd))
        drop = dropout_key
        q_btnh = lora.adapted(self, "q_proj", q_btnh, x_btd, "BTD,DR->BTR;BTR,RNH->BTNH", drop)
        k_btkh = lora.adapted(self, "k_proj", k_btkh, x_btd, "BTD,DR->BTR;BTR,RKH->BTKH", drop)
        v_btkh = lora.adapted(self, "v_proj", v_btkh, x_btd, "BTD,DR->BTR;BTR,RKH->BTKH", drop)
        if self.qkv_bias:
            q_btnh = q_btnh + self.q_bias_nh[...].astype(cd)
            k_btkh = k_btkh + self.k_bias_kh[...].astype(cd)
            v_btkh = v_btkh + self.v_bias_kh[...].astype(cd)
        inv_freq_h2 = rope_inv_freq(*self.rope)
        q_btnh = ax.constrain(
            apply_rope(q_btnh, positions_bt, inv_freq_h2), (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, None)
        )
        k_btkh = apply_rope(k_btkh, positions_bt, inv_freq_h2)
        k_bkht = k_btkh.transpose(0, 2, 3, 1)
        v_bkth = v_btkh.transpose(0, 2, 1, 3)
        if kv_cache is None:
            k_bkhs, v_bksh, new_cache = k_bkht, v_bkth, None
        else:
            k_cache, v_cache = kv_cache
            if isinstance(k_cache, tuple):  # blocks along S: each row writes in one of them
                k_bkhs, v_bksh = _write_blocks(k_cache, v_cache, k_bkht, v_bkth, cache_index)
            else:
                k_bkhs, v_bksh = _write(k_cache, v_cache, k_bkht, v_bkth, cache_index)
            k_bkhs = jax.tree.map(
                lambda x: ax.constrain(x, (ax.BATCH, ax.ACT_KV_HEADS, None, ax.CACHE_LENGTH)),
                k_bkhs,
            )
            v_bksh = jax.tree.map(
                lambda x: ax.constrain(x, (ax.BATCH, ax.ACT_KV_HEADS, ax.CACHE_LENGTH, None)),
                v_bksh,
            )
            new_cache = (k_bkhs, v_bksh)
        out_btnh = attend(
            q_btnh,
            jax.tree.map(lambda x: x.astype(cd), k_bkhs),
            jax.tree.map(lambda x: x.astype(cd), v_bksh),
            mask_bts=mask_bts,
            segment_ids_bt=segment_ids_bt,
            implementation=self.implementation,
        )
        y_btd = jnp.einsum("BTNH,NHD->BTD", out_btnh, self.o_nhd[...].astype(cd))
        y_btd = lora.adapted(self, "o_proj", y_btd, out_btnh, "BTNH,NHR->BTR;BTR,RD->BTD", drop)
        return y_btd, new_cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        d, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.param_jnp_dtype
        self.compute_dtype = cfg.compute_jnp_dtype
        key = rngs.params()
        in_axes, out_axes = (ax.EMBED, ax.MLP), (ax.MLP, ax.EMBED)
        self.gate_df = ax.param(key, "normal", (d, f), in_axes, dt, fan_in=d, index=0)
        self.up_df = ax.param(key, "normal", (d, f), in_axes, dt, fan_in=d, index=1)
        self.down_fd = ax.param(key, "normal", (f, d), out_axes, dt, fan_in=f, index=2)
        lora.add_adapters(self, cfg, key, "mlp")

    def __call__(self, x_btd: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """x [B, T, D] -> [B, T, D]; `dropout_key`: LoRA dropout (`lora.adapted`)."""
        cd, drop = self.compute_dtype, dropout_key
        gate_btf = jnp.einsum("BTD,DF->BTF", x_btd, self.gate_df[...].astype(cd))
        up_btf = jnp.einsum("BTD,DF->BTF", x_btd, self.up_df[...].astype(cd))
        gate_btf = lora.adapted(self, "gate_proj", gate_btf, x_btd, "BTD,DR->BTR;BTR,RF->BTF", drop)
        up_btf = lora.adapted(self, "up_proj", up_btf, x_btd, "BTD,DR->BTR;BTR,RF->BTF", drop)
        h_btf = ax.constrain(jax.nn.silu(gate_btf) * up_btf, (ax.BATCH, ax.LENGTH, ax.ACT_MLP))
        y_btd = jnp.einsum("BTF,FD->BTD", h_btf, self.down_fd[...].astype(cd))
        return lora.adapted(self, "down_proj", y_btd, h_btf, "BTF,FR->BTR;BTR,RD->BTD", drop)
