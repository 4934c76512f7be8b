"""How long a run's steps take, by the roofline model (``sim.roofline``, ``sim.steptime``): the
step timer a controller that weighs step time reads and the studies' modeled time use (the model
``sim.model`` names, with the run's sampler and update settings), and ``sagc-jax plan
--hardware``'s prediction of one step at the ladder's largest G.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from sagc_jax.config import Config, ConfigError, ModelConfig
from sagc_jax.controller import make_controller
from sagc_jax.controller.registry import CONTROLLERS
from sagc_jax.models import PRESETS, DecoderConfig, get_preset
from sagc_jax.models.hf_checkpoint import hf_architecture
from sagc_jax.programs.policy import (
    architecture,
)
from sagc_jax.programs.shapes import (
    prompts_for,
    trains_signal_only,
)
from sagc_jax.sim.roofline import (
    HARDWARE,
    MEASURED,
    REGIMES,
    Efficiency,
    dense_seconds,
    model_costs,
    rollout_seconds,
    update_seconds,
)
from sagc_jax.sim.steptime import Engine, StepTimer

GIB = 1024**3


def timed_architecture(cfg: Config) -> tuple[DecoderConfig, str]:
    """The model ``sim.model`` names, as the step-time model times it: a preset or an HF
    checkpoint (its directory or config.json), in bfloat16; empty: the config's own model. The
    name a checkpoint is known by in tables is its directory's, not its path on this machine."""
    if not cfg.sim.model:
        return architecture(cfg)[0], own_model_name(cfg.model)
    return named_architecture(cfg.sim.model)


def own_model_name(m: ModelConfig) -> str:
    """The name the ``model`` section's model is timed by: its checkpoint's, else its preset."""
    return _checkpoint_name(m.hf_checkpoint) if m.hf_checkpoint else m.preset


def named_architecture(name: str) -> tuple[DecoderConfig, str]:
    """The model ``sim.model = name`` names (a preset, an HF checkpoint directory or its
    config.json), in bfloat16, and its name in tables."""
    dtypes = {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"}
    if name in PRESETS:
        return get_preset(name, **dtypes), name
    path = Path(name)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(
            f"sim.model = {name!r} is neither a model preset ({sorted(PRESETS)}) nor an HF "
            "checkpoint directory or config.json"
        )
    try:
        return hf_architecture(str(path), **dtypes), _checkpoint_name(name)
    except ConfigError as err:  # names the file: truncated, not an object, a bad size
        raise ConfigError(f"sim.model: {err}") from None


def _checkpoint_name(path: str) -> str:
    """An HF checkpoint's name: its directory's (``.../SmolLM2-135M-Instruct``), also when
    ``path`` is the config.json in it."""
    path = Path(path)
    return path.parent.name if path.name == "config.json" else path.name


def step_timer(cfg: Config, padded_width: int, max_new_tokens: int | None = None) -> StepTimer:
    """The step-time model of ``cfg.sim`` (``sim.steptime.StepTimer``) for the model of
    ``timed_architecture``, with the config's update layout (``train.packing``; padded rows are
    ``padded_width`` tokens), ``train.epochs`` and the sampler's settings (``sampling``) with a
    cap of ``max_new_tokens`` (default ``sampling.max_new_tokens``; the synthetic workload's is
    ``sim.max_new_tokens``)."""
    timed = None if cfg.sim.hardware == "custom" else timed_architecture(cfg)
    return timer_of(cfg, timed, trains_signal_only(cfg), padded_width, max_new_tokens)


def timer_of(
    cfg: Config,
    timed: tuple[DecoderConfig, str] | None,
    signal_only: bool,
    padded_width: int,
    max_new_tokens: int | None = None,
) -> StepTimer:
    """`step_timer` for the model ``timed`` (architecture, name; None: ``sim.hardware =
    custom``, no model) whose update trains only the rollouts of non-zero advantage when
    ``signal_only`` (``TrainingSettings.signal_only``)."""
    costs, name = (None, "") if timed is None else (model_costs(timed[0]), timed[1])
    cap = cfg.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
    return StepTimer(
        cfg.sim,
        costs,
        name,
        padded_width=None if cfg.train.packing else padded_width,
        epochs=cfg.train.epochs,
        reference=cfg.loss.kl_beta > 0,
        signal_only=signal_only,
        engine=Engine.of(cfg.sampling, cap),
    )


def controller_for_run(cfg: Config, arch: DecoderConfig, signal_only: bool):
    """The run's controller (``controller.*``); one that ``weighs_step_time`` (``sagc_value``)
    weighs the modeled seconds of a step at each G by ``cfg.sim``'s step-time model (compacting
    rollouts plus the update, the prompts at the largest prompt bucket: ``cfg`` with its
    buckets resolved). ``arch``: the run's model (``resolve_run``'s), timed unless ``sim.model``
    names another; ``signal_only``: whether its update trains only the rollouts of non-zero
    advantage (``resolve_run``'s ``TrainingSettings``)."""
    step_seconds = None
    if CONTROLLERS[cfg.controller.kind].cls.weighs_step_time:
        timed = None
        if cfg.sim.hardware != "custom":
            own = (arch, own_model_name(cfg.model))
            timed = named_architecture(cfg.sim.model) if cfg.sim.model else own
        prompt = max(cfg.sampling.prompt_buckets)
        timer = timer_of(cfg, timed, signal_only, prompt + cfg.sampling.max_new_tokens)
        step_seconds = timer.step_seconds(prompt)
    return make_controller(cfg.controller, step_seconds=step_seconds)


def step_prediction(
    cfg: Config,
    hardware: str,
    num_devices: int,
    mean_new_tokens: int | None = None,
    update_flops: tuple[float, str] | None = None,
) -> dict:
    """Rollout and update seconds of one step at the ladder's largest G on ``num_devices``
    chips of ``hardware`` (a key of ``sim.roofline.HARDWARE``), by the roofline model.

    Lengths: prompts as long as the longest bucket; one completion reaches
    ``max_new_tokens`` (the straggler every synchronous step waits for) and the others are
    ``mean_new_tokens`` long (default: half of ``max_new_tokens``). Rollouts in each regime of
    ``sim.roofline.REGIMES``: ``compacting`` with the config's sampling settings (one prefill per
    prompt; ``sampling.slots: auto`` modeled as all rows), ``continuous`` with ``sim.slots`` per
    chip. The update's FLOPs: the roofline's for the step's tokens, or ``update_flops`` (FLOPs,
    what they are: the compiled update program's, from ``plan --compile``).
    """
    if hardware not in HARDWARE:
        raise ConfigError(f"--hardware {hardware!r} is not known; choose one of {list(HARDWARE)}")
    hw, arch = HARDWARE[hardware], architecture(cfg)[0]
    costs = model_costs(arch)
    g = max(make_controller(cfg.controller).candidates)
    rows = prompts_for(cfg.train, g) * g
    prompt, cap = max(cfg.sampling.prompt_buckets), cfg.sampling.max_new_tokens
    mean = min(cap, mean_new_tokens if mean_new_tokens is not None else max(1, cap // 2))
    lengths = np.full((rows // g, g), mean)
    lengths[0, 0] = cap
    eff = Efficiency.of(cfg.sim)
    settings = {  # what each regime of sim.roofline.rollout_seconds needs besides the lengths
        "compacting": Engine.of(cfg.sampling, cap).settings(lengths),
        "synchronous": {},
        "continuous": {"slots": cfg.sim.slots * num_devices},
    }
    rollout = {
        regime: rollout_seconds(
            costs, hw, lengths, prompt, num_devices, regime, eff=eff, **settings[regime]
        )
        for regime in REGIMES
    }
    tail = None
    if cfg.tail_batching.enabled:  # a tail step: extra prompts, cut once P groups are whole
        prompts = rows // g
        started = prompts + math.ceil(cfg.tail_batching.extra * prompts)
        tail_lengths = np.full((started, g), mean)
        tail_lengths[0, 0] = cap  # the straggler's group is cut and deferred
        tail_seconds = rollout_seconds(
            costs,
            hw,
            tail_lengths,
            prompt,
            num_devices,
            "compacting",
            eff=eff,
            keep_groups=prompts,
            groups_r=np.repeat(np.arange(started), g),
            **Engine.of(cfg.sampling, cap).settings(tail_lengths),
        )["seconds"]
        # the queue gains (started - prompts) a tail step; a long round (the compacting step
        # above: it waits for the deferred straggler) when it holds a step's prompts
        every = cfg.tail_batching.long_round_every
        tail_steps = math.ceil(prompts / (started - prompts))
        if every:
            tail_steps = min(tail_steps, max(every - 1, 1))
        tail = {"seconds": tail_seconds, "tail_steps": tail_steps, "started": started}
    # the update's tokens: packed rows hold the real tokens, padded rows prompt + cap each
    width = prompt + (int(lengths.mean()) if cfg.train.packing else cap)
    tokens, context = rows * width, rows * width * (width + 1) / 2
    update = update_seconds(
        costs, hw, tokens, context, num_devices, cfg.train.epochs, eff, cfg.loss.kl_beta > 0
    )
    flops_source = "forward + backward of the step's tokens by the roofline"
    if cfg.loss.kl_beta > 0:
        flops_source += ", and the reference policy's forward (KL)"
    if update_flops is not None:
        update = dense_seconds(update_flops[0], hw, num_devices, eff)
        flops_source = f"{update_flops[0] / 1e12:.3g} TFLOPs of {update_flops[1]}"
    return {
        "hardware": hw,
        "hardware_key": hardware,
        "devices": num_devices,
        "costs": costs,
        "group_size": g,
        "rows": rows,
        "prompt": prompt,
        "cap": cap,
        "mean": mean,
        "generated": int(lengths.sum()),
        "rollout": rollout,
        "update_tokens": tokens,
        "layout": "packed: real tokens" if cfg.train.packing else "padded: rows x width",
        "update_seconds": update,
        "update_flops_source": flops_source,
        "signal_only": trains_signal_only(cfg),
        "steps": cfg.train.steps,
        "tail": tail,
    }


_REGIME_NOTES = {  # what each rollout regime of the roofline is (sim/roofline.py)
    "compacting": " (this sampler: finished rows leave, slots refill)",
    "synchronous": " (every row until the longest ends)",
    "continuous": " (vLLM-style: a finished row's slot refilled at once)",
}


def format_step(pred: dict) -> str:
    """The prediction of :func:`step_prediction` as lines of text."""
    hw, costs = pred["hardware"], pred["costs"]
    lines = [
        f"step on {pred['devices']} x {hw.name} (roofline model; peak {hw.peak_flops / 1e12:.0f} "
        f"TFLOP/s, {hw.hbm_bandwidth / 1e12:.2f} TB/s per chip; {hw.source})",
        f"  model: {costs.params / 1e9:.3f} B parameters, {costs.weight_bytes / GIB:.2f} GiB of "
        f"weights read per decode step, {costs.kv_bytes_per_token / 1024:.0f} KiB of KV cache "
        f"per token",
        f"  at G = {pred['group_size']}: {pred['rows']} rollouts, prompts of {pred['prompt']} "
        f"tokens, one completion of {pred['cap']} tokens and the others {pred['mean']} "
        f"(--mean-new-tokens)",
    ]
    for date, machine, what in MEASURED.get(pred["hardware_key"], ()):
        lines.append(f"  measured here before ({date}, {machine}): {what}")
    for regime, r in pred["rollout"].items():
        rows, padding = r["rows_decoded"], 1 - r["live_rows_decoded"] / max(r["rows_decoded"], 1)
        lines.append(
            f"  rollout, {regime}{_REGIME_NOTES[regime]}: {r['seconds']:.2f} s "
            f"({r['decode_steps']} decode steps of {rows / max(r['decode_steps'], 1):,.0f} rows "
            f"on average, {100 * padding:.0f}% of them finished; {r['limit']}-bound; "
            f"{pred['generated'] / r['seconds']:,.0f} generated tokens/s)"
        )
    every = ""
    if pred["signal_only"]:
        every = (
            "; every group with learning signal: train.drop_no_signal leaves the groups whose "
            "rewards are all equal out, a share s of groups with signal costs about s x this"
        )
    lines.append(
        f"  update: {pred['update_seconds']:.2f} s ({pred['update_tokens']:,} tokens "
        f"({pred['layout']}); {pred['update_flops_source']}, at the assumed MFU{every})"
    )
    hours = {
        regime: pred["steps"] * (r["seconds"] + pred["update_seconds"]) / 3600
        for regime, r in pred["rollout"].items()
    }
    tail = pred["tail"]
    if tail is not None:
        long_s = pred["rollout"]["compacting"]["seconds"]
        cycle = (tail["tail_steps"] * tail["seconds"] + long_s) / (tail["tail_steps"] + 1)
        trained = pred["rows"] // pred["group_size"]
        hours["tail batching"] = pred["steps"] * (cycle + pred["update_seconds"]) / 3600
        lines.append(
            f"  rollout, tail batching (tail_batching.enabled): {tail['seconds']:.2f} s a tail "
            f"step ({tail['started']} prompts started, cut once {trained} groups are whole: "
            f"the straggler's group is deferred), then a long round of the deferred "
            f"prompts every {tail['tail_steps'] + 1} steps ({long_s:.2f} s, compacting): "
            f"{cycle:.2f} s a step on average"
        )
    lines.append(
        f"  {pred['steps']} steps (train.steps) at this G: {hours['compacting']:.1f} h with this "
        f"sampler (compacting), {hours['synchronous']:.1f} h synchronous, "
        f"{hours['continuous']:.1f} h with continuous batching"
        + (f", {hours['tail batching']:.1f} h with tail batching" if tail is not None else "")
        + " (one sampling round a step; no evaluation or checkpoint time)"
    )
    return "\n".join(lines)
