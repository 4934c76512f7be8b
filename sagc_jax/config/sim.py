"""The ``sim:`` section of a run's config: the offline simulator's workload and step-time model.

:class:`sagc_jax.config.Config` holds it as its ``sim`` field, so a config file's ``sim:``
mapping and ``--set sim.key=value`` build it; the simulator (``sagc_jax.sim``) reads it. Like the
rest of the package, this module imports neither numpy nor jax.
"""

from __future__ import annotations

import dataclasses

from sagc_jax.config.base import ConfigError, Section, option

__all__ = ["HARDWARE_NAMES", "SimConfig"]

# The accelerators of the roofline model: the keys of sim.roofline.HARDWARE (a test checks).
HARDWARE_NAMES = ("h100", "h200", "a100-80gb", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e")


@dataclasses.dataclass(frozen=True)
class SimConfig(Section):
    """Offline simulator: a synthetic rollout-length workload and a step-time model.

    The defaults are the calibrated workload of ``configs/sim/reasoning_drift.yaml``.

    Lengths of completion i of prompt p at step t (tokens, EOS included):
    ``L = min(max_new_tokens, ceil(m_t * exp(prompt_sigma * z_p + group_sigma * e_pi) * f))``
    where ``m_t`` drifts from ``median_start`` to ``median_end`` (geometric; the median length of
    successful completions), ``group_sigma`` drifts linearly to ``group_sigma_end``, ``f`` is
    ``failure_length_ratio`` for failed completions (success probability per prompt drawn from
    Beta with mean ``success_mean``) and ``e_pi`` is Student-t with ``tail_df`` degrees of freedom
    (heavy tail). With probability ``runaway_prob`` a completion runs to ``max_new_tokens``.

    With ``prompt_pool: N`` the prompts come from a fixed pool of N, shuffled every epoch (step t
    takes the next ``prompts_per_step`` of the epoch's order), and a prompt keeps its ``z_p``,
    success probability and prompt length across epochs. It also has a straggle tendency
    ``v_p ~ N(0, 1)`` scaled by ``h = prompt_heterogeneity``: its within-group spread is
    multiplied by ``exp(h v_p / 2)`` and its runaway probability is
    ``runaway_prob * exp(h v_p - h^2 / 2)`` (same mean over the pool). Its prompt length is
    ``prompt_tokens * exp(prompt_length_sigma * w_p)`` where ``w_p`` has correlation
    ``prompt_length_corr`` with ``v_p``.
    """

    _prefix = "sim."
    _resumable = True  # the offline simulator's section: training never reads it
    steps: int = option(300, ge=1, help="simulated steps")
    prompts_per_step: int = option(64, ge=1, help="prompts per simulated step")
    seed: int = option(
        0, ge=0, help="seed of the workload (every controller sees the same lengths)"
    )
    controllers: tuple[str, ...] = option(
        ("fixed:4", "fixed:8", "fixed:16", "sagc", "sagc_plus"),
        named=True,  # controller.registry.CONTROLLERS: its specs
        help="controller specs to compare (sagc_value's rewards: the workload's successes)",
    )
    max_new_tokens: int = option(8192, ge=1, help="length cap of a completion (tokens)")
    prompt_tokens: int = option(256, ge=0, help="tokens of a prompt")
    median_start: float = option(
        350.0, gt=0.0, help="median length of successful completions at the first step (tokens)"
    )
    median_end: float = option(
        1200.0, gt=0.0, help="median length of successful completions at the last step (tokens)"
    )
    prompt_sigma: float = option(0.5, ge=0.0, help="log-spread of a prompt's length scale z_p")
    group_sigma: float = option(
        0.15, ge=0.0, help="log-spread of lengths within a group at the first step"
    )
    group_sigma_end: float | None = option(0.6, ge=0.0, help="spread at the last step")
    tail_df: float = option(3.0, gt=0.0, help="Student-t degrees of freedom; inf = Gaussian")
    success_mean: float = option(
        0.4, ge=0.0, le=1.0, help="mean success probability of a prompt (Beta)"
    )
    success_mean_end: float | None = option(
        None,
        ge=0.0,
        le=1.0,
        help="mean success probability of a fresh prompt at the last step, linear from "
        "success_mean (the policy learns); null: constant",
    )
    success_concentration: float = option(
        1.5,
        gt=0.0,
        help="concentration of that Beta (small: prompts mostly solved or mostly failed)",
    )
    failure_length_ratio: float = option(
        3.0, gt=0.0, help="failed completions are this many times longer"
    )
    runaway_prob: float = option(
        0.002, ge=0.0, le=1.0, help="probability that a completion runs to max_new_tokens"
    )
    # A fixed pool of prompts revisited every epoch (PromptPoolWorkload).
    prompt_pool: int = option(
        0,
        ge=0,
        help="0: every step draws fresh prompts; N: a fixed pool of N prompts, "
        "each with a persistent length scale, success rate and straggle tendency",
    )
    prompt_heterogeneity: float = option(
        1.0, ge=0.0, help="pool: std of a prompt's log straggle tendency (0: none)"
    )
    prompt_length_sigma: float = option(
        0.5, ge=0.0, help="pool: log-spread of prompt token lengths around prompt_tokens"
    )
    prompt_length_corr: float = option(
        0.5, ge=-1.0, le=1.0, help="pool: correlation of log prompt length with straggle tendency"
    )
    # Step-time model (sim/steptime.py): modeled seconds of a step from its lengths.
    hardware: str = option(
        "h100",
        choices=("custom", *HARDWARE_NAMES),
        help="accelerator of the roofline model (sim/roofline.py); custom: the illustrative "
        "constants *_seconds below",
    )
    devices: int = option(1, ge=1, help="chips of that accelerator; a step's rows are split")
    model: str = option(
        "",
        help="model whose step is timed: a preset name, or an HF checkpoint directory or its "
        "config.json; empty: the config's model section",
    )
    slots: int = option(
        256, ge=1, help="continuous batching: rollouts decoding at once per chip (vLLM: 256)"
    )
    bandwidth_efficiency: float = option(
        0.7, gt=0.0, le=1.0, help="share of HBM bandwidth a decode step reaches"
    )
    decode_flops_efficiency: float = option(
        0.5, gt=0.0, le=1.0, help="share of peak FLOP/s a decode step reaches"
    )
    mfu: float = option(0.4, gt=0.0, le=1.0, help="share of peak FLOP/s of prefill and update")
    launch_seconds: float = option(50e-6, ge=0.0, help="fixed cost of one decode step")
    # hardware: custom, the illustrative constants (only ratios between controllers mean much).
    decode_step_seconds: float = option(0.02, ge=0.0, help="custom: fixed cost of a decode step")
    decode_seq_seconds: float = option(2e-5, ge=0.0, help="custom: cost per row per decode step")
    prefill_token_seconds: float = option(2e-6, ge=0.0, help="custom: prefill cost per token")
    update_token_seconds: float = option(4e-5, ge=0.0, help="custom: update cost per token")
    step_overhead_seconds: float = option(1.0, ge=0.0, help="custom: update cost per step")

    def check(self) -> None:
        if not self.controllers:
            raise ConfigError("sim.controllers is empty; give e.g. ['fixed:4', 'sagc']")
        if self.hardware != "custom":
            for f in dataclasses.fields(self):
                if f.name.endswith("_seconds") and f.name != "launch_seconds":
                    if getattr(self, f.name) != f.default:
                        raise ConfigError(
                            f"sim.{f.name} applies to sim.hardware: custom only, not "
                            f"{self.hardware!r}; set sim.hardware=custom or drop the key"
                        )
