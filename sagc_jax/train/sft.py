"""Supervised warm start on task traces (``sagc-jax sft``): next-token cross-entropy on the
completion tokens of (prompt, reference completion) pairs, for the CPU demo and for users
without an instruct model. Writes the parameters as an Orbax checkpoint that
``train.init_checkpoint`` points at.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sagc_jax.config import Config, ConfigError, to_dict
from sagc_jax.tasks import encode_sft_batch
from sagc_jax.train.checkpoint import CheckpointStore
from sagc_jax.train.optim import make_optimizer


def sft_loss(model, tokens_bt, loss_mask_bt):
    """Mean cross-entropy of the masked tokens given their prefix (float32 scalar)."""
    inputs_bt, targets_bt = tokens_bt[:, :-1], tokens_bt[:, 1:]
    mask_bt = loss_mask_bt[:, 1:]
    logits_btv = model(inputs_bt)
    logp_bt = jnp.take_along_axis(
        jax.nn.log_softmax(logits_btv, axis=-1), targets_bt[..., None], axis=-1
    )[..., 0]
    return -jnp.sum(logp_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1.0)


def ramble(trace: str, length: int) -> str:
    """A trace that never concludes: its running sums, then the last one repeated until
    ``length`` characters, and no ``#answer``."""
    sums = trace.split("#", 1)[0]
    last = sums.rsplit(">", 1)[-1]
    out = sums
    while len(out) < length:
        out += ">" + last
    return out[:length]


def sft_batch(cfg: Config, source, step: int, width: int):
    """Tokens and loss mask [B, width] of SFT step ``step``; rambling rows get no EOS target."""
    s = cfg.sft
    pairs = source.sft_pairs(s.batch_size, start=(s.seed * s.steps + step) * s.batch_size)
    rng = np.random.default_rng([s.seed, step])
    rambles = rng.random(len(pairs)) < s.ramble_fraction
    max_new = cfg.sampling.max_new_tokens
    pairs = [(p, ramble(c, max_new) if r else c) for (p, c), r in zip(pairs, rambles, strict=True)]
    tokens_bt, mask_bt = encode_sft_batch(source.tokenizer, pairs, width)
    for b in np.flatnonzero(rambles):  # never learn to stop a rambling completion
        mask_bt[b, np.flatnonzero(mask_bt[b])[-1]] = 0.0
    return tokens_bt, mask_bt


def run_sft(cfg: Config, trainer_parts, run_dir: Path, progress: bool = True) -> dict:
    """Train ``trainer_parts`` = (graphdef, params, source) on ``cfg.sft.steps`` batches of
    traces; save the params under ``run_dir/checkpoints``. Returns a summary."""
    graphdef, params, source = trainer_parts
    if not hasattr(source, "sft_pairs"):
        raise ConfigError("sagc-jax sft needs task traces: use data.task = 'synthetic'")
    s = cfg.sft
    tx = make_optimizer(
        s.learning_rate,
        total_steps=s.steps,
        warmup_steps=s.warmup_steps,
        schedule="cosine",
        state_dtype=cfg.train.optimizer_dtype,
        param_dtype=cfg.model.param_dtype,
    )
    opt_state = tx.init(params)
    completion = source.task.max_completion_chars()
    if s.ramble_fraction > 0:
        completion = max(completion, cfg.sampling.max_new_tokens)
    width = 1 + source.task.max_prompt_chars() + completion + 1

    @jax.jit
    def step_fn(params, opt_state, tokens_bt, mask_bt):
        def loss_fn(p):
            return sft_loss(nnx.merge(graphdef, p), tokens_bt, mask_bt)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=s.steps, desc="sft", unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    loss = float("nan")
    for step in range(s.steps):
        tokens_bt, mask_bt = sft_batch(cfg, source, step, width)
        params, opt_state, loss_ = step_fn(params, opt_state, tokens_bt, mask_bt)
        if bar is not None and (step % 10 == 0 or step == s.steps - 1):
            loss = float(loss_)
            bar.set_postfix(loss=f"{loss:.3f}")
        if bar is not None:
            bar.update(1)
    loss = float(loss_)
    if bar is not None:
        bar.close()
    store = CheckpointStore(run_dir / "checkpoints", keep=1)
    store.save(
        s.steps,
        {"params": params},
        {"step": s.steps, "config": to_dict(cfg), "has_opt_state": False, "final_loss": loss},
    )
    store.wait()
    store.close()
    return {
        "steps": s.steps,
        "final_loss": loss,
        "wall_clock_s": time.perf_counter() - t0,
        "params": params,
    }
