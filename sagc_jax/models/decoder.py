"""The decoder (`Decoder`) and its KV cache (`KVCache`, `init_cache`).

Two entry points:
  * `model(tokens_bt, positions_bt=None, mask_bt=None, segment_ids_bt=None) -> logits_btv`: full
    forward, no cache; with `segment_ids_bt` a row holds several sequences (packed); with
    `dropout_key` (a key per token), LoRA dropout on the adapters' inputs (the update's forward);
  * `model.apply_cached(tokens_bt, cache) -> (logits_btv, cache)`: prefill (T = prompt length) or
    decode (T = 1) over a KV cache of S slots, rows left-padded.

Cache layout: row b holds its tokens in slots [start_b[b], index); slot s < start_b[b] is
left padding. Row b's token in slot s has position s - start_b[b]. Logits are always float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sagc_jax.models import axes as ax
from sagc_jax.models import lora
from sagc_jax.models.architecture import DecoderConfig
from sagc_jax.models.layers import MLP, Attention, RMSNorm, cache_blocks


class KVCache(NamedTuple):
    """Keys and values of every layer, plus where each row starts and where to write next.

    k_lbkhs: tuple (one per layer) of keys [B, K, H, S] in the compute dtype.
    v_lbksh: tuple (one per layer) of values [B, K, S, H] in the compute dtype.
        A layer's keys (and values) may also be a tuple of blocks that follow each other along
        S: a cache that grows by a block leaves the slots already written where they are
        (the sampler's decode phases). Such a cache takes one token per row (decode).
    start_b: int32 [B], first valid slot of each row (prompts are left-padded).
    index: int32 scalar, the slot the next token is written to; or int32 [B], one per row (rows
        at different points of their completions, one new token each).
    """

    k_lbkhs: tuple[jax.Array, ...]
    v_lbksh: tuple[jax.Array, ...]
    start_b: jax.Array
    index: jax.Array

    @property
    def slots(self) -> int:
        """S: the cache slots of each row (over all blocks)."""
        return sum(v.shape[2] for v in cache_blocks(self.v_lbksh[0]))


def init_cache(cfg: DecoderConfig, batch: int, length: int, start_b=None, dtype=None) -> KVCache:
    """An empty cache of `length` slots for `batch` rows; `start_b` [B] defaults to zeros."""
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, length)
    v_shape = (batch, cfg.num_kv_heads, length, cfg.head_dim)
    dtype = dtype or cfg.compute_jnp_dtype
    k_lbkhs = tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers))
    v_lbksh = tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers))
    start_b = jnp.zeros((batch,), jnp.int32) if start_b is None else jnp.asarray(start_b, jnp.int32)
    return KVCache(k_lbkhs, v_lbksh, start_b, jnp.zeros((), jnp.int32))


class Block(nnx.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(
        self,
        x_btd,
        positions_bt,
        mask_bts,
        kv_cache=None,
        cache_index=None,
        segment_ids_bt=None,
        dropout_key=None,
    ):
        y_btd, kv_cache = self.attn(
            self.attn_norm(x_btd),
            positions_bt,
            mask_bts,
            kv_cache,
            cache_index,
            segment_ids_bt,
            dropout_key,
        )
        x_btd = ax.constrain(x_btd + y_btd, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))
        x_btd = x_btd + self.mlp(self.mlp_norm(x_btd), dropout_key)
        return ax.constrain(x_btd, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)), kv_cache


# What the backward pass keeps of a layer's forward ("none" keeps everything): "full" keeps
# only the layer's input and recomputes the rest; "dots" also keeps the matmul outputs.
_REMAT_POLICY = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _block_forward(block: Block, x_btd, positions_bt, segment_ids_bt, dropout_key):
    x_btd, _ = block(
        x_btd, positions_bt, None, segment_ids_bt=segment_ids_bt, dropout_key=dropout_key
    )
    return x_btd


class Decoder(nnx.Module):
    """Llama 3.x / Qwen2 decoder-only transformer (see `DecoderConfig`)."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        d, v, dt = cfg.hidden_size, cfg.vocab_size, cfg.param_jnp_dtype
        key = rngs.params()
        self.embed_vd = ax.param(key, "normal", (v, d), (ax.VOCAB, ax.EMBED), dt, fan_in=d, index=0)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head_dv = ax.param(
                key, "normal", (d, v), (ax.EMBED, ax.VOCAB), dt, fan_in=d, index=1
            )

    # ----------------------------------------------------------------- pieces
    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        # The lookup reads a whole (gathered) table, so its gradient is a local scatter-add
        # followed by one reduce-scatter into the table's shards, not a reshuffle of activations.
        table_vd = ax.constrain(
            self.embed_vd[...].astype(self.config.compute_jnp_dtype), (None, None)
        )
        x_btd = jnp.take(table_vd, tokens_bt, axis=0)
        return ax.constrain(x_btd, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))

    def logits(self, h_btd: jax.Array) -> jax.Array:
        """Final norm then the (tied or untied) output projection; float32 [B, T, V]."""
        h_btd = self.final_norm(h_btd)
        cd = self.config.compute_jnp_dtype
        if self.config.tie_embeddings:
            logits_btv = jnp.einsum(
                "BTD,VD->BTV",
                h_btd,
                self.embed_vd[...].astype(cd),
                preferred_element_type=jnp.float32,
            )
        else:
            logits_btv = jnp.einsum(
                "BTD,DV->BTV",
                h_btd,
                self.lm_head_dv[...].astype(cd),
                preferred_element_type=jnp.float32,
            )
        return ax.constrain(logits_btv.astype(jnp.float32), (ax.BATCH, ax.LENGTH, ax.ACT_VOCAB))

    # ----------------------------------------------------------------- no cache
    def hidden(
        self, tokens_bt, positions_bt=None, mask_bt=None, segment_ids_bt=None, dropout_key=None
    ) -> jax.Array:
        """Hidden states [B, T, D] before the final norm, causal attention, no cache.

        mask_bt: 1 for real tokens, 0 for padding (padding keys are never attended to); when given
        without positions, positions count real tokens only (left padding friendly).
        segment_ids_bt: int [B, T] instead of mask_bt, for packed rows: attention is causal
        within equal ids (1..n, 0 = padding), and ``positions_bt`` (restarting at 0 in each
        segment) must be given too.
        dropout_key: LoRA dropout on the adapters' inputs: typed keys [B, T], one per token
        (``lora.token_keys``), each folded with the layer's index.
        """
        b, t = tokens_bt.shape
        if segment_ids_bt is not None:
            if mask_bt is not None or positions_bt is None:
                raise ValueError("segment_ids_bt needs positions_bt and no mask_bt")
        elif mask_bt is None:
            segment_ids_bt = jnp.ones((b, t), jnp.int32)
        else:
            # one segment of real tokens: padding (segment 0) is never seen from a real token
            segment_ids_bt = mask_bt.astype(jnp.int32)
            if positions_bt is None:
                positions_bt = jnp.maximum(jnp.cumsum(segment_ids_bt, axis=1) - 1, 0)
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x_btd = self.embed(tokens_bt)
        if self.config.scan_layers:
            return self._scanned_layers(x_btd, positions_bt, segment_ids_bt, dropout_key)
        forward = _block_forward
        if self.config.remat != "none":
            forward = nnx.remat(_block_forward, policy=_REMAT_POLICY[self.config.remat])
        for i, block in enumerate(self.layers):
            key = None if dropout_key is None else lora.fold_keys(dropout_key, i)
            x_btd = forward(block, x_btd, positions_bt, segment_ids_bt, key)
        return x_btd

    def _scanned_layers(self, x_btd, positions_bt, segment_ids_bt, dropout_key) -> jax.Array:
        """The layers as one ``lax.scan`` over their weights stacked inside the program, each
        iteration under ``jax.checkpoint`` with the remat policy (``scan_layers``, after
        MaxText's).

        Unrolled checkpointed layers leave the compiler free to schedule every layer's
        recomputation at once (XLA CPU drops the barriers around them: 12.9 GiB of temporaries
        for SmolLM2's remat-full update, 2.4 scanned; docs/scale-out.md); a scan runs one
        layer's forward, and in the backward one layer's recomputation, at a time, whatever the
        scheduler. The stacked weights are a copy made in the program (and their gradient
        another): the layers' weights twice more, against every layer's recomputed values."""
        graphdef, _ = nnx.split(self.layers[0])
        stacked = jax.tree.map(
            lambda *leaves: jnp.stack(leaves), *(nnx.split(block)[1] for block in self.layers)
        )

        def layer(x_btd, weights_and_index):
            weights, i = weights_and_index
            key = None if dropout_key is None else lora.fold_keys(dropout_key, i)
            block = nnx.merge(graphdef, weights)
            return _block_forward(block, x_btd, positions_bt, segment_ids_bt, key), None

        if self.config.remat != "none":
            policy = _REMAT_POLICY[self.config.remat]
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        index_l = jnp.arange(len(self.layers), dtype=jnp.uint32)
        x_btd, _ = jax.lax.scan(layer, x_btd, (stacked, index_l))
        return x_btd

    def __call__(
        self, tokens_bt, positions_bt=None, mask_bt=None, segment_ids_bt=None, dropout_key=None
    ):
        """int32 tokens [B, T] -> float32 logits [B, T, V]."""
        return self.logits(
            self.hidden(tokens_bt, positions_bt, mask_bt, segment_ids_bt, dropout_key)
        )

    # ----------------------------------------------------------------- KV cache
    def apply_cached(
        self, tokens_bt: jax.Array, cache: KVCache, *, last_only: bool = False
    ) -> tuple[jax.Array, KVCache]:
        """Runs T new tokens per row at slots [cache.index, cache.index + T).

        Returns float32 logits [B, T, V] ([B, 1, V] if `last_only`, which a prefill wants) and
        the cache with the new keys/values written and `index` advanced by T. A per-row
        `index` [B] takes T = 1 (decode).
        """
        b, t = tokens_bt.shape
        s = cache.slots
        if t != 1 and (cache.index.ndim == 1 or isinstance(cache.v_lbksh[0], tuple)):
            raise ValueError(
                f"a per-row cache index or a cache in blocks takes one token per row, not {t}"
            )
        index_b1 = jnp.broadcast_to(cache.index, (b,))[:, None]
        slots_bt = index_b1 + jnp.arange(t, dtype=jnp.int32)[None, :]
        key_slots_s = jnp.arange(s, dtype=jnp.int32)
        mask_bts = (key_slots_s[None, None, :] <= slots_bt[:, :, None]) & (
            key_slots_s[None, None, :] >= cache.start_b[:, None, None]
        )
        positions_bt = jnp.maximum(slots_bt - cache.start_b[:, None], 0)
        x_btd = self.embed(tokens_bt)
        new_k, new_v = [], []
        for block, k_bkhs, v_bksh in zip(self.layers, cache.k_lbkhs, cache.v_lbksh, strict=True):
            x_btd, (k_bkhs, v_bksh) = block(
                x_btd, positions_bt, mask_bts, (k_bkhs, v_bksh), cache.index
            )
            new_k.append(k_bkhs)
            new_v.append(v_bksh)
        if last_only:
            x_btd = x_btd[:, -1:]
        new_cache = KVCache(tuple(new_k), tuple(new_v), cache.start_b, cache.index + t)
        return self.logits(x_btd), new_cache


def num_params(state) -> int:
    """Total number of parameter elements in an nnx state (concrete or abstract)."""
    return sum(int(x.size) for x in jax.tree.leaves(state))
