"""The compiled policy update of a GRPO step, and the log-probability functions it uses.

The update is jitted once per input shape and takes one of two batches:
- padded (``PADDED_KEYS``): one row per trained rollout, ``prompt_bucket + max_new_tokens``
  wide, the row count one rung of a ladder (every rollout: the step's rollouts, one program per
  candidate G) times each prompt bucket;
- packed (``PACKED_KEYS``, built by ``programs.packing``): rollouts' real tokens laid end to end
  in rows of a fixed length, the row count one rung of a ladder: one program per rung,
  whatever G. The same loss, gradients and updates as the padded batch (with one mini-batch;
  several mini-batches draw packed rows rather than rollouts at random).
Either batch carries each row's share of the step's loss normaliser (``norm``), so rollouts
left out of it (no gradient: ``programs.packing``) still count in the loss's denominator, and
each token's rollout id (``rollout``), by which LoRA dropout draws its masks: a rollout's masks
are the same in either layout, in any row, micro-batch or mini-batch, with or without the
rollouts left out.
Programs compile on first use (or ahead of time) and are reused from the jit cache afterwards.
``compiled_programs()`` reports the cache sizes so tests and logs can catch recompiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sagc_jax.models import axes as ax
from sagc_jax.models import lora
from sagc_jax.parallel import ShardingPlan
from sagc_jax.programs.packing import PACKED_KEYS, PADDED_KEYS
from sagc_jax.rl import policy_loss, weighted_policy_loss
from sagc_jax.rl.logprobs import token_logprobs


def completion_logprobs(
    model, prompt_ids_bt, prompt_lens_b, completion_bt, temperature, dropout_key=None, chunk=0
):
    """float32 [B, L]: log p(completion token j | prompt, earlier completion tokens).

    prompt_ids_bt: int32 [B, P] left-padded prompts (row b's prompt in its last prompt_lens_b[b]
    columns); completion_bt: int32 [B, L]. Log-probs are taken at ``temperature``, as the sampler
    reports them, so a freshly sampled batch has ratio 1 up to float error (without LoRA
    dropout: ``dropout_key``, typed keys [B, P + L], one per token). Only the L completion
    positions' logits are computed, ``chunk`` tokens at a time (``rl.logprobs.token_logprobs``;
    0: all at once).
    """
    p = prompt_ids_bt.shape[1]
    tokens_bt = jnp.concatenate([prompt_ids_bt, completion_bt], axis=1)
    real_prompt_bt = jnp.arange(p)[None, :] >= (p - prompt_lens_b)[:, None]
    real_bt = jnp.concatenate([real_prompt_bt, jnp.ones_like(completion_bt, jnp.bool_)], axis=1)
    h_btd = model.hidden(tokens_bt, mask_bt=real_bt, dropout_key=dropout_key)[:, p - 1 : -1]
    return token_logprobs(model.logits, h_btd, completion_bt, temperature, chunk)


def packed_logprobs(
    model, tokens_bt, positions_bt, segment_ids_bt, temperature, dropout_key=None, chunk=0
):
    """float32 [B, T]: at position s, log p(tokens[s + 1] | its segment up to s), at
    ``temperature`` (as :func:`completion_logprobs`, ``chunk`` tokens of logits at a time).
    Packed rows (``train.packing``): only the positions whose next token is a scored completion
    token of the same segment mean anything. ``dropout_key``: LoRA dropout's keys [B, T], one
    per token.
    """
    h_btd = model.hidden(
        tokens_bt,
        positions_bt=positions_bt,
        segment_ids_bt=segment_ids_bt,
        dropout_key=dropout_key,
    )
    next_bt = jnp.roll(tokens_bt, -1, axis=1)  # the last column's target is never scored
    return token_logprobs(model.logits, h_btd, next_bt, temperature, chunk)


def policy_model(graphdef, params, base=None):
    """The policy: ``params`` alone, or (LoRA) the adapters ``params`` over the frozen ``base``."""
    return nnx.merge(graphdef, params) if base is None else nnx.merge(graphdef, params, base)


def reference_model(graphdef, params, ref_params, base=None):
    """The reference policy of the KL term: ``ref_params``, or (LoRA) the base with the adapters
    off (zeroed: exactly the base model's outputs, and no second copy of its weights).

    Its forward is never differentiated (the KL term stops its gradient), so it runs without
    remat: nothing to recompute, and ``nnx.remat`` of a module merged from arrays of the
    enclosing trace (``ref_params`` are not the gradient's arguments) fails in the backward."""
    if base is None:
        ref = nnx.merge(graphdef, ref_params)
    else:
        ref = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, params), base)
    ref.config = ref.config.replace(remat="none")
    return ref


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How an update batch lays its rollouts in rows, and what the loss reads of them: the
    padded layout (one rollout a row, ``PADDED_KEYS``) or the packed one (rollouts end to end,
    ``PACKED_KEYS``, the aggregation folded into per-token weights). ``spec(batch)``: the
    batch's contract from its own sizes; ``logprobs(model, rows, temperature, dropout_key,
    chunk)``: float32 per scored position (LoRA dropout's masks drawn from ``dropout_key`` by
    each token's rollout and position, ``lora.token_keys``); ``loss(logp, ref_logp, rows,
    normalizer, settings)``: (loss, metrics)."""

    keys: tuple[str, ...]
    spec: Callable[[dict], dict]
    logprobs: Callable[..., jax.Array]
    loss: Callable[..., tuple[jax.Array, dict]]


def _padded_logprobs(model, rows, temperature, dropout_key=None, chunk=0):
    args = (rows["prompt_ids"], rows["prompt_lens"], rows["completion"], temperature)
    if dropout_key is not None:
        p, new = rows["prompt_ids"].shape[1], rows["completion"].shape[1]
        # a rollout's first prompt token is position 0 (left padding clipped to 0: never seen)
        start_b = p - rows["prompt_lens"]
        positions_bt = jnp.maximum(jnp.arange(p + new)[None, :] - start_b[:, None], 0)
        rollout_bt = jnp.broadcast_to(rows["rollout"][:, None], positions_bt.shape)
        dropout_key = lora.token_keys(dropout_key, rollout_bt, positions_bt)
    return completion_logprobs(model, *args, dropout_key, chunk)


def _clip_and_kl(settings, ref_logp) -> dict:
    """The keywords both losses take: the ratio's clip range and the KL term."""
    return dict(
        eps_low=settings.eps_low,
        eps_high=settings.eps_high,
        kl_beta=settings.kl_beta,
        ref_logp_bt=ref_logp,
    )


def _padded_loss(logp, ref_logp, rows, normalizer, settings):
    per_token = (logp, rows["old_logp"], rows["adv"], rows["mask"])
    aggregation = settings.aggregation
    return policy_loss(
        *per_token, normalizer, aggregation=aggregation, **_clip_and_kl(settings, ref_logp)
    )


def _packed_logprobs(model, rows, temperature, dropout_key=None, chunk=0):
    args = (rows["tokens"], rows["positions"], rows["segment_ids"], temperature)
    if dropout_key is not None:
        dropout_key = lora.token_keys(dropout_key, rows["rollout"], rows["positions"])
    return packed_logprobs(model, *args, dropout_key, chunk)


def _packed_loss(logp, ref_logp, rows, normalizer, settings):
    per_token = (logp, rows["old_logp"], rows["adv"], rows["mask"], rows["weight"])
    return weighted_policy_loss(*per_token, normalizer, **_clip_and_kl(settings, ref_logp))


def _padded_spec(batch: dict) -> dict:
    rows, new_tokens = batch["mask"].shape
    return batch_spec(rows, batch["prompt_ids"].shape[1], new_tokens)


def _packed_spec(batch: dict) -> dict:
    return packed_batch_spec(batch["mask"].shape[0], batch["tokens"].shape[1])


def chunk_loss(
    layout: RowLayout,
    graphdef,
    params,
    ref_params,
    rows: dict,
    normalizer,
    settings: UpdateSettings,
    base=None,
    dropout_key=None,
):
    """(loss, metrics) of the policy ``params`` (over ``base`` with LoRA, its adapters' inputs
    dropped with masks drawn from ``dropout_key`` by rollout) on a chunk of rows laid out as
    ``layout`` says; with a KL term the reference policy's log-probs, without gradient."""
    chunk = settings.logprob_chunk
    model = policy_model(graphdef, params, base)
    logp = layout.logprobs(model, rows, settings.temperature, dropout_key, chunk)
    ref_logp = None
    if settings.kl_beta > 0:
        ref = reference_model(graphdef, params, ref_params, base)
        ref_logp = jax.lax.stop_gradient(
            layout.logprobs(ref, rows, settings.temperature, chunk=chunk)
        )
    return layout.loss(logp, ref_logp, rows, normalizer, settings)


def split_rows(x: jax.Array) -> jax.Array:
    """``x`` with its leading (row) axis split over the mesh's batch axes (under a plan)."""
    return ax.constrain(x, (ax.BATCH,) + (None,) * (x.ndim - 1))


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """Static settings of the update program (hashable: part of the jit cache key)."""

    aggregation: str
    eps_low: float
    eps_high: float
    kl_beta: float
    temperature: float
    epochs: int = 1
    minibatches: int = 1
    microbatches: int = 1
    lora_dropout: float = 0.0  # > 0: the policy forward drops the adapters' inputs
    logprob_chunk: int = 0  # tokens of [tokens, vocab] logits at a time; 0: all at once

    @property
    def zero_advantage_is_inert(self) -> bool:
        """Whether a rollout of advantage 0 adds exactly 0 to the loss and its gradient (only
        its share of the normaliser counts): no KL term reads it."""
        return self.kl_beta == 0


def batch_spec(rows: int, prompt_len: int, new_tokens: int, sharding=None) -> dict:
    """ShapeDtypeStructs of an update batch (``PADDED_KEYS``) of ``rows`` rollouts."""
    shapes = {
        "prompt_ids": ((rows, prompt_len), jnp.int32),
        "prompt_lens": ((rows,), jnp.int32),
        "completion": ((rows, new_tokens), jnp.int32),
        "old_logp": ((rows, new_tokens), jnp.float32),
        "mask": ((rows, new_tokens), jnp.float32),
        "adv": ((rows,), jnp.float32),
        "rollout": ((rows,), jnp.int32),
        "norm": ((rows,), jnp.float32),
    }
    return {k: jax.ShapeDtypeStruct(*v, sharding=sharding) for k, v in shapes.items()}


def packed_batch_spec(rows: int, pack_len: int, sharding=None) -> dict:
    """ShapeDtypeStructs of a packed update batch (``PACKED_KEYS``) of ``rows`` x ``pack_len``
    (global rows: every process's rung together)."""
    dtypes = dict.fromkeys(("tokens", "positions", "segment_ids", "rollout"), jnp.int32)
    shapes = {k: (rows,) if k == "norm" else (rows, pack_len) for k in PACKED_KEYS}
    return {
        k: jax.ShapeDtypeStruct(shapes[k], dtypes.get(k, jnp.float32), sharding=sharding)
        for k in PACKED_KEYS
    }


PADDED = RowLayout(PADDED_KEYS, _padded_spec, _padded_logprobs, _padded_loss)
PACKED = RowLayout(PACKED_KEYS, _packed_spec, _packed_logprobs, _packed_loss)


def layout_of(batch: dict) -> RowLayout:
    """The row layout of an update batch: packed when it has segment ids."""
    return PACKED if "segment_ids" in batch else PADDED


@dataclasses.dataclass(frozen=True)
class StateShardings:
    """Where the trained state lives on the mesh (pytrees of ``NamedSharding``)."""

    params: Any
    opt_state: Any
    ref_params: Any = None  # None when there is no reference model
    base: Any = None  # LoRA: the frozen weights under the adapters (``params``)


class PolicyPrograms:
    """Holds the model's graphdef, the optimizer and the jitted programs.

    With a ``ShardingPlan`` (and the state's shardings) both programs are jitted with explicit
    input and output shardings: parameters and optimizer state stay where the plan put them,
    batch rows are split over the mesh's batch axes, metrics come back replicated, and the
    activations follow the plan's logical-axis rules.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        tx: optax.GradientTransformation,
        plan: ShardingPlan | None = None,
        shardings: StateShardings | None = None,
    ):
        self.graphdef = graphdef
        self.tx = tx
        self.plan = plan
        update_kw = {}
        if plan is not None:
            if shardings is None:
                raise ValueError("PolicyPrograms with a ShardingPlan needs the state's shardings")
            rows, scalar = plan.rows, plan.replicated
            batch = rows  # every entry of either batch (padded or packed): rows split
            update_kw = dict(
                in_shardings=(
                    shardings.params,
                    shardings.opt_state,
                    shardings.ref_params,
                    shardings.base,
                    batch,
                    scalar,
                ),
                out_shardings=(shardings.params, shardings.opt_state, scalar),
            )
        # settings (last, static) is positional: jit takes no keywords with shardings.
        self._update = jax.jit(
            self._update_impl, static_argnums=(6,), donate_argnums=(0, 1), **update_kw
        )
        # Python side effects in the traced functions count traces of *this* instance (a jit
        # cache of a method is shared by every instance of the class).
        self.traces = {"update": 0}

    def compiled_programs(self) -> dict[str, int]:
        """Programs traced (each one compiled) so far, per program of this instance."""
        return dict(self.traces)

    def _rules(self):
        return self.plan.activate() if self.plan is not None else contextlib.nullcontext()

    def update(self, state, batch: dict, key, settings: UpdateSettings):
        """Runs ``epochs x minibatches`` optimizer updates on one rollout batch.

        ``state``: a ``programs.state.PolicyState`` (params, opt_state, ref_params, base). With
        LoRA, ``params`` are the adapters (the only arrays differentiated and in the optimizer
        state) and ``base`` the frozen weights under them, neither donated nor changed.

        batch: padded (``PADDED_KEYS``, from ``programs.packing.padded_update_batch``):
        prompt_ids [N, P], prompt_lens [N], completion [N, L], old_logp [N, L] (rollout time),
        mask [N, L], adv [N], rollout [N], norm [N]; or packed (``PACKED_KEYS``, from
        ``programs.packing.pack_update_batch``): [R, pack_len] per token and norm [R]. Numpy or
        (multi-process: must be) global arrays. N (R) must divide by minibatches x microbatches.
        Returns (params, opt_state, metrics averaged over updates; per-token metrics are token
        means over each update's rows); an update whose loss or gradient is not finite is
        skipped and counted in ``skipped``.
        """
        params, opt_state, ref_params, base = state
        return self._update(params, opt_state, ref_params, base, batch, key, settings)

    def lower_update(self, state, batch, key, settings: UpdateSettings) -> jax.stages.Lowered:
        """The update for ``batch``'s shapes (arrays or ShapeDtypeStructs), lowered."""
        params, opt_state, ref_params, base = state
        return self._update.lower(params, opt_state, ref_params, base, batch, key, settings)

    def _update_impl(self, params, opt_state, ref_params, base, batch, key, settings):
        self.traces["update"] += 1
        with self._rules():
            return self._update_traced(params, opt_state, ref_params, base, batch, key, settings)

    def _update_traced(
        self, params, opt_state, ref_params, base, batch, key, settings: UpdateSettings
    ):
        """The stages: the batch checked against its layout's spec; the rows of each of the
        ``epochs x minibatches`` updates drawn (``update_order``); per update the gradient
        accumulated over its micro-batch chunks (``accumulated_loss``) and the optimizer step
        applied where loss and gradient are finite (``guarded_step``)."""
        layout = layout_of(batch)
        per_row = {k: batch[k] for k in layout.keys}
        # the batch's contract, checked when traced: its spec's shapes and dtypes, row for row
        chex.assert_trees_all_equal_shapes_and_dtypes(per_row, layout.spec(batch))
        n = batch["mask"].shape[0]
        # Every mini-batch is normalised by its share of the whole-batch denominator (rows left
        # out included: the rows' ``norm``), so the objective of one optimizer update is the
        # full-batch loss restricted to its rows.
        normalizer = jnp.maximum(jnp.sum(batch["norm"]), 1.0) / settings.minibatches

        def loss_fn(p, rows, dropout_key):
            if settings.lora_dropout == 0:
                dropout_key = None
            loss, metrics = chunk_loss(
                layout, self.graphdef, p, ref_params, rows, normalizer, settings, base, dropout_key
            )
            # per-token means -> sums, so the update's metrics are means over all its tokens
            tokens = jnp.sum(rows["mask"])
            return loss, ({k: v * tokens for k, v in metrics.items()}, tokens)

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def one_update(carry, xs):
            (params, opt_state), (idx_r, update_key) = carry, xs
            rows = jax.tree.map(lambda x: split_rows(x[idx_r]), per_row)
            loss, (sums, tokens), grads = accumulated_loss(
                grad_fn, params, rows, settings.microbatches, update_key
            )
            params, opt_state, grad_norm, finite = guarded_step(
                self.tx, loss, grads, params, opt_state
            )
            out = {
                "loss": loss,
                "grad_norm": grad_norm,
                "skipped": (~finite).astype(jnp.float32),
                **{k: v / jnp.maximum(tokens, 1.0) for k, v in sums.items()},
            }
            return (params, opt_state), out

        xs = update_order(key, n, settings.epochs, settings.minibatches)
        (params, opt_state), per_update = jax.lax.scan(one_update, (params, opt_state), xs)
        metrics = jax.tree.map(jnp.mean, per_update)
        metrics["skipped"] = jnp.sum(per_update["skipped"])
        return params, opt_state, metrics


def update_order(key, rows: int, epochs: int, minibatches: int):
    """``(order, keys)``: the rows of each of the ``epochs x minibatches`` updates, int
    ``[updates, rows / minibatches]`` (a permutation of the rows per epoch), and LoRA dropout's
    key of each update: its epoch's, so a rollout's masks do not depend on its mini-batch."""
    order = jnp.concatenate(
        [jax.random.permutation(jax.random.fold_in(key, epoch), rows) for epoch in range(epochs)]
    ).reshape(epochs * minibatches, rows // minibatches)
    # fold_in(key, epochs): apart from the permutations' fold_in(key, epoch < epochs)
    epoch_keys = jax.random.split(jax.random.fold_in(key, epochs), epochs)
    return order, epoch_keys[jnp.arange(len(order)) // minibatches]


def accumulated_loss(grad_fn, params, rows: dict, micro: int, update_key):
    """``(loss, metrics, grads)`` of one update's rows, summed over ``micro`` chunks (gradient
    accumulation; ``grad_fn(params, chunk, dropout_key)`` gives each chunk's). Chunk c holds
    rows c, c + micro, ...: each chunk keeps the rows' split over the mesh's batch axes (a
    leading-axis reshape would put chunks on different devices). Every chunk gets the update's
    key (LoRA dropout's): masks are drawn by rollout, so no chunk needs a key of its own."""
    micro_rows = jax.tree.leaves(rows)[0].shape[0] // micro
    chunks = jax.tree.map(
        lambda x: jnp.swapaxes(x.reshape(micro_rows, micro, *x.shape[1:]), 0, 1), rows
    )

    def accumulate(acc, chunk):
        (loss, metrics), grads = grad_fn(params, chunk, update_key)
        return jax.tree.map(jnp.add, acc, (loss, metrics, grads)), None

    first = jax.tree.map(lambda x: x[0], chunks)
    (loss, metrics), grads = grad_fn(params, first, update_key)
    if micro > 1:
        rest = jax.tree.map(lambda x: x[1:], chunks)
        (loss, metrics, grads), _ = jax.lax.scan(accumulate, (loss, metrics, grads), rest)
    return loss, metrics, grads


def guarded_step(tx, loss, grads, params, opt_state):
    """``(params, opt_state, grad_norm, finite)`` after the optimizer's step, or as they were
    where the loss or the gradient is not finite (the step skipped, as optax's
    ``apply_if_finite``)."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    return params, opt_state, grad_norm, finite
