"""Supervised warm start on task traces (``sagc-jax sft``): next-token cross-entropy on the
completion tokens of (prompt, reference completion) pairs, for the CPU demo and for users
without an instruct model. Writes the parameters as an Orbax checkpoint that
``train.init_checkpoint`` points at.

Checkpoints (params, optimizer state, step) are written every ``sft.checkpoint_every`` steps
and when a stop signal arrives; the batch of a step is a pure function of the step, so a rerun
resumes to exactly the uninterrupted result. The last checkpoint holds only the params and is
marked ``finished`` in its meta. A run directory whose saved config differs on a key that shapes
the warm start (``option(warm_start=True)``: the model, sft and data sections,
sampling.max_new_tokens and train.optimizer_dtype; not sft.checkpoint_every) is neither reused
nor resumed.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sagc_jax.config import Config, ConfigError, changed_keys, to_dict
from sagc_jax.programs.optim import make_optimizer
from sagc_jax.rl.logprobs import token_logprobs
from sagc_jax.tasks import encode_sft_batch
from sagc_jax.train.hooks import Hooks, ProgressBar, itstime
from sagc_jax.train.safety.checkpoint import CheckpointStore, newest_verified_meta
from sagc_jax.train.safety.faults import Interrupted, StopRequest, crash_point, phase, resume_hint


def sft_loss(model, tokens_bt, loss_mask_bt, chunk: int = 0):
    """Mean cross-entropy of the masked tokens given their prefix (float32 scalar); the logits
    ``chunk`` tokens at a time (``rl.logprobs.token_logprobs``; 0: all at once)."""
    inputs_bt, targets_bt = tokens_bt[:, :-1], tokens_bt[:, 1:]
    mask_bt = loss_mask_bt[:, 1:]
    logp_bt = token_logprobs(model.logits, model.hidden(inputs_bt), targets_bt, 1.0, chunk)
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


def recheck(trace: str, extra: int, length: int) -> str:
    """A trace that writes its running sums ``1 + extra`` times, ``=`` between the passes,
    before ``#answer`` (fewer passes when they would not fit in ``length`` characters)."""
    sums, answer = trace.split("#", 1)
    room = (length - len(trace)) // (len(sums) + 1)
    return "=".join([sums] * (1 + min(extra, max(room, 0)))) + "#" + answer


def sft_batch(cfg: Config, source, step: int, width: int):
    """Tokens and loss mask [B, width] of SFT step ``step``; rambling rows get no EOS target."""
    s = cfg.sft
    pairs = source.sft_pairs(s.batch_size, start=(s.seed * s.steps + step) * s.batch_size)
    rng = np.random.default_rng([s.seed, step])
    rambles = rng.random(len(pairs)) < s.ramble_fraction
    max_new = cfg.sampling.max_new_tokens
    if s.recheck_prob > 0:  # P(at least j extra passes) = recheck_prob ** j
        extra = rng.geometric(1.0 - s.recheck_prob, len(pairs)) - 1
        pairs = [
            (p, c if r else recheck(c, int(e), max_new))
            for (p, c), r, e in zip(pairs, rambles, extra, strict=True)
        ]
    pairs = [(p, ramble(c, max_new) if r else c) for (p, c), r in zip(pairs, rambles, strict=True)]
    tokens_bt, mask_bt = encode_sft_batch(source.tokenizer, pairs, width)
    for b in np.flatnonzero(rambles):  # never learn to stop a rambling completion
        mask_bt[b, np.flatnonzero(mask_bt[b])[-1]] = 0.0
    return tokens_bt, mask_bt


def check_saved_config(meta: dict, step: int, cfg: Config, run_dir: Path) -> None:
    """Raise ConfigError if the config of an SFT checkpoint (its ``meta``) differs from ``cfg``
    on a key that shapes the warm start: neither reused nor resumed, the message says what to
    do."""
    changed = changed_keys(meta["config"], cfg, "warm_start")
    if changed:
        held = (
            "a finished warm start"
            if meta.get("finished", True)
            else f"an sft run stopped at step {step}"
        )
        raise ConfigError(
            f"{run_dir}: holds {held} whose config differs in "
            f"{', '.join(changed[:8])}{'...' if len(changed) > 8 else ''}; use --force to train "
            f"again from scratch (the old checkpoints are moved aside) or another logging.run_dir"
        )


def sft_progress(cfg: Config, run_dir: Path) -> tuple[int | None, bool]:
    """(newest verified step, finished) of the SFT checkpoints in ``run_dir`` ((None, False):
    none). Raises ConfigError when their config differs from ``cfg`` on a key that shapes the
    warm start."""
    if not (run_dir / "checkpoints").is_dir():
        return None, False
    step, meta = newest_verified_meta(run_dir / "checkpoints")
    if step is None:
        return None, False
    check_saved_config(meta, step, cfg, run_dir)
    return step, meta.get("finished", True)  # before periodic saves only the end was saved


def set_aside(run_dir: Path) -> str:
    """Move the checkpoints of an earlier SFT in ``run_dir`` to ``checkpoints.replaced`` (one
    earlier copy is kept) and drop its summary; returns what was done ("" if nothing)."""
    ckpt = run_dir / "checkpoints"
    (run_dir / "summary.json").unlink(missing_ok=True)
    if not ckpt.exists():
        return ""
    aside = run_dir / "checkpoints.replaced"
    shutil.rmtree(aside, ignore_errors=True)
    ckpt.rename(aside)
    return f"moved the earlier checkpoints to {aside}"


def run_sft(cfg: Config, trainer_parts, run_dir: Path, progress: bool = True) -> dict:
    """Train ``trainer_parts`` = (graphdef, params, source) on ``cfg.sft.steps`` batches of
    traces, resuming from the latest checkpoint under ``run_dir/checkpoints``; save the params
    there. Returns a summary. A stop signal saves a checkpoint and raises ``Interrupted``."""
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
    if s.ramble_fraction > 0 or s.recheck_prob > 0:
        completion = max(completion, cfg.sampling.max_new_tokens)
    width = 1 + source.task.max_prompt_chars() + completion + 1

    @jax.jit
    def step_fn(params, opt_state, tokens_bt, mask_bt):
        def loss_fn(p):
            model = nnx.merge(graphdef, p)
            return sft_loss(model, tokens_bt, mask_bt, cfg.loss.logprob_chunk)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    store = CheckpointStore(run_dir / "checkpoints", keep=2)
    try:
        return _train(cfg, store, step_fn, params, opt_state, source, width, progress)
    finally:
        store.close()


def _train(cfg: Config, store, step_fn, params, opt_state, source, width, progress) -> dict:
    """The step loop of `run_sft` from the latest checkpoint of ``store``, on the hooks of the
    GRPO loop: the progress bar, then the checkpoint (every ``sft.checkpoint_every`` steps, at
    the end, and at a stop request, which then ends the run)."""
    s = cfg.sft
    run_dir = store.directory.parent
    start, loss = 0, math.nan
    crash_point("startup", 0)
    kept = ""
    if store.latest_step() is not None:
        kept = f"the checkpoints in {run_dir} are kept; {resume_hint(cfg, run_dir)}"
    with phase("start-up", kept):
        restored = store.restore_newest(
            {"params": params, "opt_state": opt_state},
            check_meta=lambda meta: check_saved_config(meta, meta["step"], cfg, run_dir),
        )
    if restored is not None:
        start, items, meta = restored
        params, opt_state, loss = items["params"], items["opt_state"], meta["loss"]

    def sft_step(step: int) -> dict:
        nonlocal params, opt_state
        crash_point("sft", step)
        tokens_bt, mask_bt = sft_batch(cfg, source, step, width)
        params, opt_state, step_loss = step_fn(params, opt_state, tokens_bt, mask_bt)
        return {"loss": step_loss}  # on the device: read only when shown or saved

    hooks = Hooks(s.steps)
    bar = None
    if progress:

        def shown_loss(step: int, record: dict) -> dict | None:
            if step % 10 == 1 or step == s.steps:
                return {"loss": f"{float(record['loss']):.3f}"}
            return None

        bar = ProgressBar("sft", s.steps, start, shown_loss)
        hooks.add(bar)

    def checkpoint(step: int, record: dict) -> None:
        nonlocal loss
        stopping = stop.should_stop(step)
        if stopping or itstime(step, s.checkpoint_every, s.steps):
            loss = float(record["loss"])
            meta = {
                "step": step,
                "config": to_dict(cfg),
                "finished": step == s.steps,  # what train.init_checkpoint may start from
                "loss": loss,
            }
            store.save(step, {"params": params, "opt_state": opt_state}, meta)
        if stopping:
            hooks.stop(stop.name)

    hooks.add(checkpoint)
    t0 = time.perf_counter()
    try:
        with StopRequest() as stop:
            done = hooks.run(start, sft_step)
    finally:
        if bar is not None:
            bar.close()
    if hooks.stopped:
        store.wait()
        raise Interrupted(
            stop.signum,
            f"training, after step {done} of {s.steps}",
            f"checkpoint of step {done} saved in {run_dir}; {resume_hint(cfg, run_dir)}",
        )
    return {
        "steps": s.steps,
        "steps_run": done - start,
        "final_loss": loss,
        "wall_clock_s": time.perf_counter() - t0,
        "params": params,
    }
