"""The config sections of a run (one frozen dataclass each) and :class:`Config`, which holds
them; the ``sim`` section is in :mod:`sagc_jax.config.sim`."""

from __future__ import annotations

import dataclasses

from sagc_jax.config.base import ConfigError, Section, option
from sagc_jax.config.sim import SimConfig

# The hybrid controller's modes (controller.hybrid.mode; the spec 'hybrid:<mode>' picks one).
HYBRID_MODES = ("step", "per_prompt")

# Projections LoRA can adapt (models.architecture.LORA_TARGETS; this module imports no jax).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    """Which policy to train: a preset architecture or a local Hugging Face checkpoint."""

    _prefix = "model."
    _warm_start = True
    preset: str = option(
        "tiny", help="architecture preset (used when hf_checkpoint is unset)", params=True
    )
    hf_checkpoint: str | None = option(
        None,
        help="local Hugging Face model directory",
        params=True,
        outcome=False,  # a path of this machine: records compare the weights' sha256 instead
    )
    tokenizer: str | None = option(
        None,
        help="directory with tokenizer.json (default: hf_checkpoint; synthetic task: built in)",
        params=True,
    )
    param_dtype: str = option(
        "float32",
        choices=("float32", "bfloat16"),
        help="dtype the weights are stored in (bfloat16 halves their memory)",
        params=True,
    )
    compute_dtype: str = option(
        "float32",
        choices=("float32", "bfloat16"),
        help="dtype of matmul inputs and activations; softmax, log-probs and losses stay float32",
    )
    remat: str = option(
        "none",
        choices=("none", "full", "dots"),
        help="rematerialisation of each decoder layer in the backward pass: none keeps every "
        "activation, full recomputes the layer from its input, dots keeps the matmul outputs",
    )
    scan_layers: bool = option(
        False,
        help="run the update's layers as one lax.scan over their weights stacked in the program "
        "(a copy, and its gradient): one layer recomputed at a time whatever the compiler's "
        "scheduler, which XLA CPU needs for model.remat to save memory",
        resumable=True,
    )
    attention: str = option(
        "auto",
        choices=("auto", "einsum", "cudnn", "splash"),
        help="attention of the full forward (update, log-probs; decoding always uses einsum): "
        "auto picks cudnn on GPU in bfloat16, splash on TPU, einsum otherwise",
        resumable=True,
    )
    lora_rank: int = option(
        0,
        ge=0,
        help="rank of the LoRA adapters trained instead of the weights (docs/lora.md); 0: no "
        "LoRA, every weight is trained",
        params=True,
    )
    lora_alpha: float = option(
        16.0, gt=0.0, help="LoRA scale: adapters add lora_alpha / lora_rank times (x @ A) @ B"
    )
    lora_targets: tuple[str, ...] = option(
        LORA_TARGETS,
        choices=LORA_TARGETS,
        help="projections that get adapters, by their Hugging Face / PEFT module names",
        params=True,
    )
    lora_dropout: float = option(
        0.0, ge=0.0, lt=1.0, help="dropout on the adapters' input in the update (not sampling)"
    )

    def check(self) -> None:
        if self.lora_rank and not self.lora_targets:
            raise ConfigError(
                f"model.lora_targets is empty with model.lora_rank = {self.lora_rank}; name at "
                f"least one of {list(LORA_TARGETS)}, or set model.lora_rank = 0"
            )
        if len(set(self.lora_targets)) != len(self.lora_targets):
            raise ConfigError(
                f"model.lora_targets = {list(self.lora_targets)} names a projection twice"
            )


@dataclasses.dataclass(frozen=True)
class SamplingConfig(Section):
    """Rollout sampling."""

    _prefix = "sampling."
    max_new_tokens: int = option(
        256,
        ge=1,
        help="tokens a completion may generate (EOS included); longer ones are truncated",
        warm_start=True,
    )
    decode_chunk: int | str = option(
        "auto",
        ge=0,
        help="cache slots added per decode phase, so a step attends over about the tokens so "
        "far; 0: every step attends over the whole cache; 'auto': max(32, max_new_tokens / 8)",
        resumable=True,
    )
    slots: int | str = option(
        0,
        ge=0,
        help="rows the sampler decodes at once; a finished row's slot takes the next waiting "
        "rollout; 0: all of a step's rollouts; 'auto': as many as the device memory holds "
        "(sagc-jax plan's budget)",
        resumable=True,
    )
    row_buckets: int = option(
        6,
        ge=1,
        help="row counts a decode iteration may run at: the slots and up to this many - 1 "
        "halvings of them (one program branch each); with no rollout waiting, the rows still "
        "running move to the smallest that holds them; 1: every iteration decodes all slots",
        resumable=True,
    )
    temperature: float = option(1.0, ge=0.0, help="sampling temperature; 0: greedy")
    top_p: float = option(
        1.0,
        gt=0.0,
        le=1.0,
        help="nucleus sampling: keep the smallest set of tokens with this probability; 1: off",
    )
    top_k: int = option(0, ge=0, help="0 disables top-k")
    prompt_buckets: tuple[int, ...] | str = option(
        (64, 128, 256, 512, 1024, 2048, 4096),
        ge=1,
        help="prompt lengths the sampler pads to (one program each), strictly increasing; "
        "'auto': a few rungs up to the longest prompt, derived from the data at start-up",
    )

    def check(self) -> None:
        if isinstance(self.prompt_buckets, str):
            if self.prompt_buckets != "auto":
                raise ConfigError(
                    f"sampling.prompt_buckets = {self.prompt_buckets!r} is not allowed; give a "
                    f"strictly increasing list of token counts, e.g. [128, 256], or 'auto'"
                )
        elif list(self.prompt_buckets) != sorted(set(self.prompt_buckets)):
            raise ConfigError(
                f"sampling.prompt_buckets = {list(self.prompt_buckets)} must be strictly increasing"
            )
        if isinstance(self.slots, str) and self.slots != "auto":
            raise ConfigError(
                f"sampling.slots = {self.slots!r} is not allowed; give a number of rows >= 0 "
                f"(0: all of a step's rollouts) or 'auto'"
            )
        if isinstance(self.decode_chunk, str) and self.decode_chunk != "auto":
            raise ConfigError(
                f"sampling.decode_chunk = {self.decode_chunk!r} is not allowed; give a number of "
                f"cache slots >= 0 (0: one phase over the whole cache) or 'auto'"
            )


@dataclasses.dataclass(frozen=True)
class LossConfig(Section):
    """Policy-gradient objective."""

    _prefix = "loss."
    # its names and their help: rl.losses.ALGORITHMS
    algorithm: str = option("grpo", named=True)
    eps_low: float = option(
        0.2, gt=0.0, lt=1.0, help="lower clip of the probability ratio: 1 - eps_low"
    )
    eps_high: float = option(0.2, gt=0.0, help="DAPO clip-higher uses 0.28")
    kl_beta: float = option(0.0, ge=0.0, help="k3 KL to the frozen initial policy; 0 disables")
    overlong_buffer: int = option(0, ge=0, help="DAPO soft overlong interval in tokens; 0 off")
    overlong_penalty: float = option(1.0, ge=0.0, help="reward penalty at max_new_tokens")
    mask_truncated: bool = option(False, help="drop truncated completions from the loss")
    dynamic_sampling: bool = option(False, help="DAPO: refill groups whose rewards are all equal")
    max_sampling_rounds: int = option(3, ge=1, help="rollout rounds per step with dynamic sampling")
    logprob_chunk: int = option(
        1024,
        ge=0,
        help="tokens whose float32 [tokens, vocab] logits the update computes at once (the "
        "backward recomputes each chunk's); 0: a whole microbatch's at once",
    )


@dataclasses.dataclass(frozen=True)
class SAGCConfig(Section):
    """Knobs of the paper's SAGC (``controller.kind: sagc``): its dual variable and Thompson
    sampling; the ladder, the straggler definition and the budget are ``controller.*``.

    eta: dual step size of lambda; lambda_max: its upper clip.
    posterior_gamma: forgetting factor of the Beta posteriors (memory about 1/(1-gamma) steps).
    alpha0, beta0: Beta prior of every candidate's straggler probability.
    radius: G moves at most this many rungs of the ladder per step.
    seed: seed of the Thompson-sampling generator.
    """

    _prefix = "controller.sagc."
    eta: float = option(1.0, gt=0.0, help="step size of the dual variable lambda")
    lambda_max: float = option(20.0, gt=0.0, help="upper clip of lambda")
    posterior_gamma: float = option(
        0.95,
        gt=0.0,
        le=1.0,
        help="per-step forgetting of the Beta posteriors (memory of about 1/(1-gamma) steps)",
    )
    alpha0: float = option(
        1.0, gt=0.0, help="Beta prior of every candidate's straggler probability: alpha"
    )
    beta0: float = option(
        1.0, gt=0.0, help="Beta prior of every candidate's straggler probability: beta"
    )
    radius: int = option(1, ge=1, help="G moves at most this many rungs of the ladder per step")
    seed: int = option(0, ge=0, help="seed of the Thompson-sampling generator")


@dataclasses.dataclass(frozen=True)
class HybridConfig(SAGCConfig):
    """Knobs of the prompt-aware hybrid controller (``controller.kind: hybrid``).

    It is SAGC with a per-prompt straggle predictor (``sagc_jax/controller/hybrid.py``): it has
    every knob of ``controller.sagc``, with the same defaults, read from this section (its
    ``posterior_gamma`` also forgets the predictor's feature-bin and global counts), and adds the
    predictor's. The ladder, the straggler definition and the budget are ``controller.*``.
    """

    _prefix = "controller.hybrid."
    mode: str = option(
        "step",
        choices=HYBRID_MODES,
        help="step: one G per step, Thompson draws conditioned on the step's prompts; "
        "per_prompt: a group size per prompt, the sizes summing to the rollout budget",
    )
    capacity: int = option(65536, ge=1, help="prompts remembered; the least recently seen go")
    decay: float = option(
        0.5, gt=0.0, le=1.0, help="per-visit forgetting of a prompt's record (1: never forget)"
    )
    prior_strength: float = option(
        8.0,
        gt=0.0,
        help="pseudo-rollouts of the shrinkage prompt -> feature bin -> global tail rate",
    )
    prediction_weight: float = option(
        10.0,
        ge=0.0,
        help="pseudo-steps the prompt-based prediction adds to SAGC's Beta posterior of each G; "
        "0: plain SAGC draws",
    )
    rows_per_step: int = option(
        0,
        ge=0,
        help="per_prompt: rows per step; 0: prompts x a budget level G chosen each step by "
        "SAGC's rule on the ladder (one rollout shape per candidate, as in SAGC)",
    )
    length_bins: tuple[int, ...] = option(
        (64, 128, 256, 512, 1024, 2048),
        ge=1,
        help="edges (prompt tokens) of the prompt-length bins of the feature prior",
    )
    difficulty_bins: int = option(
        4, ge=1, help="equal-width bins of the optional difficulty in [0, 1] (feature prior)"
    )
    calibration_bins: int = option(10, ge=2, help="bins of predicted straggle probability")

    def check(self) -> None:
        edges = list(self.length_bins)
        if edges != sorted(set(edges)):
            raise ConfigError(
                f"{self._prefix}length_bins = {edges} must be a strictly increasing list"
            )


@dataclasses.dataclass(frozen=True)
class SAGCPlusConfig(Section):
    """Knobs of SAGC+, the improved SAGC (``controller.kind: sagc_plus``; docs/controller.md):
    how it keeps the budget; the ladder, the straggler definition and the budget are
    ``controller.*``. See ``sagc_jax/controller/sagc_plus.py``.
    """

    _prefix = "controller.sagc_plus."
    memory: float = option(
        256.0,
        ge=1.0,
        help="trials (groups) a rung's estimate remembers at most; older ones are scaled away",
    )
    trial_gamma: float = option(
        0.9, gt=0.0, le=1.0, help="per-step forgetting of every rung's trial counts"
    )
    prior_strength: float = option(
        8.0,
        gt=0.0,
        help="pseudo-trials of the one-parameter tail model in each rung's estimate",
    )
    hysteresis: float = option(
        0.25,
        gt=0.0,
        help="budget slack (in steps of s_t) that must build up or run out before G changes "
        "between the two rungs of the mixture; also the clip of the slack (no wind-up)",
    )


@dataclasses.dataclass(frozen=True)
class SAGCValueConfig(Section):
    """Knobs of the value-aware controller (``controller.kind: sagc_value``; docs/controller.md):
    what a group of G is worth, learned from the step's rewards, and how its step time is
    estimated. It keeps SAGC+'s straggler budget with SAGC+'s own knobs
    (``controller.sagc_plus``). See ``sagc_jax/controller/sagc_value.py``.
    """

    _prefix = "controller.sagc_value."
    gamma: float = option(
        0.8,
        gt=0.0,
        le=1.0,
        help="per-step forgetting of the signal counts, the success model and the step times",
    )
    prior_strength: float = option(
        8.0,
        gt=0.0,
        help="pseudo-groups of the success model in each rung's estimate of P(signal)",
    )
    min_gain: float = option(
        0.05,
        ge=0.0,
        help="G leaves the rung played last (or SAGC+'s limit, when that rung is above it) only "
        "for a rung whose signal per second is higher by this relative margin",
    )
    success_threshold: float = option(
        0.5, help="a rollout counts as a success in the success model when its reward exceeds this"
    )


@dataclasses.dataclass(frozen=True)
class ControllerConfig(Section):
    """Which group-size controller runs (the paper's SAGC, SAGC+ the improved SAGC, the
    prompt-aware hybrid or a fixed G baseline), and the straggler budget every one of them
    shares (see docs/controller.md, "Choosing delta and tau"): the ladder of G, what a
    straggler is (tau, scope; the fixed baseline measures it too), the budget delta and the
    first G. Each controller's own knobs are in its subsection."""

    _prefix = "controller."
    # its names and their help: controller.registry.CONTROLLERS
    kind: str = option("sagc_plus", named=True)
    group_size: int = option(8, ge=1, help="G of the fixed baseline (kind: fixed)")
    candidates: tuple[int, ...] = option(
        (4, 8, 16), ge=1, help="the ladder of group sizes G, strictly increasing"
    )
    delta: float = option(
        0.3,
        gt=0.0,
        lt=1.0,
        help="straggler budget: the target long-run share of straggling groups E[s_t]",
    )
    tau: float = option(
        3.0,
        gt=1.0,
        help="a group straggles when the max/median of its completion lengths exceeds tau",
    )
    scope: str = option(
        "group",
        choices=("group", "batch"),
        help="group: s_t = share of the step's groups that straggle; batch: 0/1 over the "
        "whole step",
    )
    g_init: int | None = option(
        None, ge=1, help="G of the first step (a candidate); null: the middle rung"
    )
    sagc: SAGCConfig = dataclasses.field(default_factory=SAGCConfig)
    sagc_plus: SAGCPlusConfig = dataclasses.field(default_factory=SAGCPlusConfig)
    sagc_value: SAGCValueConfig = dataclasses.field(default_factory=SAGCValueConfig)
    hybrid: HybridConfig = dataclasses.field(default_factory=HybridConfig)

    def check(self) -> None:
        c = list(self.candidates)
        if not c or c != sorted(set(c)):
            raise ConfigError(
                f"{self._prefix}candidates = {c} must be a non-empty, strictly increasing list"
            )
        if self.g_init is not None and self.g_init not in self.candidates:
            raise ConfigError(
                f"{self._prefix}g_init = {self.g_init} is not a candidate; allowed: {c}"
            )


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
    """The RL loop: batch shape, optimizer, update schedule, checkpoints and evaluation."""

    _prefix = "train."
    steps: int = option(
        100, ge=1, help="RL steps (each: rollouts, rewards, update, controller)", resumable=True
    )
    batch_mode: str = option(
        "prompts",
        choices=("prompts", "budget"),
        help="prompts: prompts_per_step x G rollouts; budget: rollout_budget / G prompts",
    )
    prompts_per_step: int = option(
        8, ge=1, help="prompts per step in prompts mode (rows: prompts_per_step x G)"
    )
    rollout_budget: int = option(64, ge=1, help="rollouts per step in budget mode")
    learning_rate: float = option(1e-6, gt=0.0, help="peak AdamW learning rate")
    lr_schedule: str = option(
        "constant",
        choices=("constant", "cosine"),
        help="constant after the warm-up, or cosine decay to 0 over the run",
    )
    warmup_steps: int = option(0, ge=0, help="optimizer updates of linear warm-up")
    weight_decay: float = option(0.0, ge=0.0, help="AdamW decoupled weight decay")
    max_grad_norm: float = option(1.0, ge=0.0, help="0 disables clipping")
    optimizer_dtype: str = option(
        "float32",
        choices=("float32", "param"),
        help="float32: Adam moments in float32 and, with bfloat16 params, a float32 master copy "
        "of the params; param: moments in the params' dtype, no master copy (least memory)",
        warm_start=True,
    )
    adam_b1: float = option(0.9, ge=0.0, lt=1.0, help="Adam's first-moment decay")
    adam_b2: float = option(0.999, ge=0.0, lt=1.0, help="Adam's second-moment decay")
    epochs: int = option(1, ge=1, help="optimisation passes over each rollout batch")
    minibatches: int = option(1, ge=1, help="optimizer updates per epoch")
    microbatches: int = option(1, ge=1, help="gradient-accumulation chunks per update")
    seed: int = option(0, ge=0, help="root seed of the run: model init, sampling keys, data order")
    checkpoint_every: int = option(
        25,
        ge=0,
        help="steps between checkpoints; 0: only at the end",
        resumable=True,
        outcome=False,
    )
    checkpoint_minutes: float = option(
        0.0, ge=0.0, help="also checkpoint this often; 0: off", resumable=True, outcome=False
    )
    keep_checkpoints: int = option(
        3, ge=1, help="sealed checkpoints kept; older ones are deleted", outcome=False
    )
    async_checkpoint: bool = option(
        True, help="write checkpoints in the background", resumable=True, outcome=False
    )
    max_nonfinite_steps: int = option(
        3,
        ge=1,
        help="abort after this many steps in a row with a non-finite loss or gradient",
        resumable=True,
    )
    skip_no_signal: bool = option(
        True,
        help="skip the update of a step without learning signal (every advantage 0 and "
        "loss.kl_beta = 0: its loss and gradient are exactly 0), counted in update/no_signal; "
        "false runs it anyway (Adam's momentum and weight decay then still move the weights)",
        resumable=True,
    )
    drop_no_signal: bool = option(
        True,
        help="leave rollouts of advantage 0 out of the update (with loss.kl_beta = 0 their loss "
        "and gradient are exactly 0; the loss's normaliser still counts them, so the update is "
        "the same to float error), counted in update/rollouts_trained; false trains every one",
        resumable=True,
    )
    spike_factor: float = option(
        10.0,
        ge=0.0,
        help="a step whose gradient norm exceeds this many times the median of the last "
        "train.spike_window steps is a spike: no checkpoint is written (but the final one) until "
        "spike_window steps pass without one, so the last stays one from before it; 0: off",
        resumable=True,
    )
    spike_window: int = option(
        20, ge=2, help="steps of gradient norms a spike is judged against", resumable=True
    )
    eval_every: int = option(
        0, ge=0, help="steps between held-out evaluations; 0: start and end", resumable=True
    )
    eval_size: int = option(128, ge=1, help="held-out prompts per evaluation")
    compile_ahead: bool = option(
        False,
        help="compile at start-up what the run will run: every candidate G's rollout and "
        "update (each packed row-count rung) and the evaluation",
        resumable=True,
        outcome=False,
    )
    memory_check: bool = option(
        True,
        help="before building the model, refuse a ladder whose largest G does not fit one "
        "device's memory by sagc-jax plan's estimate (on CPU: the host's)",
        resumable=True,
        outcome=False,
    )
    resume_changed_data: bool = option(
        False,
        help="resume although a data file changed since the checkpoint (its size or sha256 "
        "differ): the run continues at the saved step on the new contents; false: refused",
        resumable=True,
    )
    compilation_cache_dir: str | None = option(
        "auto",
        help="JAX's persistent compilation cache, shared by every command and run on this "
        "machine: auto: $XDG_CACHE_HOME/sagc-jax/xla (default ~/.cache/sagc-jax/xla); null: off",
        resumable=True,
        outcome=False,
    )
    init_checkpoint: str | None = option(
        None, help="start from the params of this run directory (e.g. the SFT warm start)"
    )
    packing: bool = option(
        True,
        help="update on packed rows of real tokens (one program per row-count rung); false: "
        "one padded row per rollout",
        resumable=True,
    )
    pack_len: int = option(
        0,
        ge=0,
        help="tokens per packed row; 0: largest prompt bucket + sampling.max_new_tokens",
        resumable=True,
    )


@dataclasses.dataclass(frozen=True)
class SFTConfig(Section):
    """Supervised warm start on task traces (``sagc-jax sft``)."""

    _prefix = "sft."
    _warm_start = True
    steps: int = option(300, ge=1, help="optimizer steps of the warm start")
    batch_size: int = option(32, ge=1, help="traces per step")
    learning_rate: float = option(
        1e-3, gt=0.0, help="peak AdamW learning rate (linear warm-up, then constant)"
    )
    warmup_steps: int = option(20, ge=0, help="steps of linear warm-up")
    seed: int = option(0, ge=0, help="seed of the model init and the traces' order")
    ramble_fraction: float = option(
        0.0,
        ge=0.0,
        le=1.0,
        help="share of traces that never conclude (repeat the last sum up to "
        "sampling.max_new_tokens): a deliberately imperfect warm start that RL must fix",
    )
    recheck_prob: float = option(
        0.0,
        ge=0.0,
        lt=1.0,
        help="concluded traces write their running sums again, '=' between the passes, with "
        "P(at least j extra passes) = recheck_prob ** j (as many as fit in "
        "sampling.max_new_tokens): long correct answers, a length tail RL does not remove",
    )
    checkpoint_every: int = option(
        100,
        ge=0,
        help="save params and optimizer state every N steps to resume from (0: only at the end "
        "and when stopped by a signal)",
        warm_start=False,
    )


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """Where prompts and rewards come from."""

    _prefix = "data."
    _warm_start = True
    # its names and their help: tasks.source.SOURCES
    task: str = option("synthetic", named=True, params=True)
    path: str | None = option(None, help="JSONL or Parquet of {prompt, answer} (task: dataset)")
    eval_path: str | None = option(None, help="held-out file (task: dataset)")
    reward: str = option(
        "auto",
        named=True,  # tasks.rewards.REWARDS: the built-ins and their help
        help="'auto': the task's own reward; 'module:function': a function of your own",
    )
    reward_on_error: str = option(
        "raise",
        choices=("raise", "zero"),
        help="a reward function that raises, returns a non-finite value or runs past "
        "data.reward_timeout_s on a row: stop the run naming the function and the row (raise), "
        "or score the row 0 and count it in reward_failed_rows / reward_timeouts (zero)",
    )
    reward_timeout_s: float = option(
        60.0,
        ge=0.0,
        help="seconds a reward of your own ('module:function') may take per batch: it runs in a "
        "worker process, killed at the limit; the batch is then scored row by row (within the "
        "limit again) to find the rows that hang, which data.reward_on_error treats; 0: no "
        "limit, called in the trainer's process (a reward that needs the accelerator or shares "
        "state with the trainer)",
        resumable=True,
    )
    math_timeout_s: float = option(
        2.0,
        gt=0.0,
        help="math reward: seconds one completion's symbolic check may take before its worker "
        "process is killed; it scores 0 and counts in reward_timeouts",
        resumable=True,
    )
    math_batch_timeout_s: float = option(
        30.0,
        gt=0.0,
        help="math reward: seconds the symbolic checks of one batch may take together; rows "
        "unfinished then score 0 and count in reward_timeouts",
        resumable=True,
    )
    math_workers: int = option(
        2, ge=1, le=64, help="math reward: symbolic checker processes", resumable=True
    )
    chat_template: bool | None = option(
        None,
        help="wrap dataset prompts in the tokenizer's chat template; None: on when the "
        "tokenizer has a template (a chat model), said once in the log",
    )
    eval_split: int = option(
        128,
        ge=0,
        help="task dataset without data.eval_path: rows of data.path set aside by a seeded "
        "draw (data.seed) as the held-out set, never trained on (nor any row with the same "
        "prompt); 0: evaluate on the first training rows, named in the log as not held out",
    )
    on_long_prompt: str = option(
        "error",
        choices=("error", "skip"),
        help="a dataset prompt longer than the largest prompt bucket: stop at load time naming "
        "its row (error), or leave the row out and print how many were (skip)",
    )
    min_terms: int = option(2, ge=1, help="synthetic task: fewest terms per problem")
    max_terms: int = option(8, ge=1, help="synthetic task: most terms per problem")
    min_digits: int = option(1, ge=1, help="synthetic task: fewest digits of a term (1..9)")
    max_digits: int = option(1, ge=1, help="synthetic task: most digits of a term (min_digits..9)")
    modulus: int | None = option(None, ge=2, help="synthetic task: running sums modulo this")
    curriculum_steps: int = option(
        0,
        ge=0,
        help="synthetic task: 0 = off; else the train split's most terms per problem rises "
        "linearly (floored) from curriculum_start_terms at step 0 to max_terms at this step, "
        "then stays; held-out and SFT problems are never capped",
    )
    curriculum_start_terms: int | None = option(
        None,
        ge=1,
        help="synthetic task: the curriculum's most terms per problem at step 0, in "
        "[min_terms, max_terms]; None = min_terms",
    )
    prompt_pool: int = option(
        0,
        ge=0,
        help="synthetic task: 0 = an endless stream of new problems; N = training problems "
        "drawn from a fixed pool of N, revisited every epoch in a new order (prompt id = pool "
        "index), as a dataset is; the hybrid controller learns per prompt from the revisits",
    )
    seed: int = option(
        0,
        ge=0,
        help="seed of the synthetic problems, of the dataset's order and of the reasoning_gym "
        "training entries",
    )
    rg_dataset: str | None = option(
        None,
        help="reasoning_gym task: the reasoning-gym dataset name (basic_arithmetic, chain_sum, "
        "countdown, gsm_symbolic, ...)",
    )
    rg_config: dict | None = option(
        None,
        help="reasoning_gym task: a mapping of the dataset's config keyword arguments, e.g. "
        "{min_terms: 2, max_terms: 3}; None: its defaults",
    )
    rg_train_size: int = option(
        1000, ge=1, help="reasoning_gym task: training entries, generated from data.seed"
    )
    rg_eval_size: int = option(
        200,
        ge=1,
        help="reasoning_gym task: held-out entries, generated from data.rg_eval_seed (those "
        "whose question is also a training one are dropped)",
    )
    rg_answer: str = option(
        "tags",
        choices=("tags", "final"),
        help="reasoning_gym task: where the reward reads the answer: the last <answer></answer> "
        "tags, as reasoning-gym asks (tags); or those, else the final answer of the math "
        "reward's conventions (\\boxed{}, '####', 'answer is', the last number) for a model "
        "that does not write the tags (final)",
    )
    rg_eval_seed: int = option(
        1_000_000,
        ge=0,
        help="reasoning_gym task: seed of the held-out entries; reasoning-gym draws entry i of "
        "seed s from Random(s + i), so the generator seeds of the held-out entries (rg_eval_seed "
        "onwards) must not overlap the training ones (seed to seed + rg_train_size - 1)",
    )

    def check(self) -> None:
        if self.min_terms > self.max_terms:
            raise ConfigError(
                f"data.min_terms = {self.min_terms} > data.max_terms = {self.max_terms}"
            )
        start = self.curriculum_start_terms
        if start is not None and not self.min_terms <= start <= self.max_terms:
            raise ConfigError(
                f"data.curriculum_start_terms = {start} is outside [data.min_terms = "
                f"{self.min_terms}, data.max_terms = {self.max_terms}]"
            )
        if self.min_digits > self.max_digits:
            raise ConfigError(
                f"data.min_digits = {self.min_digits} > data.max_digits = {self.max_digits}"
            )
        if self.task == "dataset" and not self.path:
            raise ConfigError("data.task = 'dataset' needs data.path (a JSONL or Parquet file)")
        if self.task == "reasoning_gym":
            if not self.rg_dataset:
                raise ConfigError(
                    "data.task = 'reasoning_gym' needs data.rg_dataset (a reasoning-gym dataset "
                    "name, e.g. chain_sum)"
                )
            train = (self.seed, self.seed + self.rg_train_size)
            held = (self.rg_eval_seed, self.rg_eval_seed + self.rg_eval_size)
            if held[0] < train[1] and train[0] < held[1]:  # entry i of seed s: Random(s + i)
                raise ConfigError(
                    f"data.rg_eval_seed = {self.rg_eval_seed} draws held-out entries from the "
                    f"generator seeds [{held[0]}, {held[1]}), which overlap the training ones "
                    f"[{train[0]}, {train[1]}) (data.seed, data.rg_train_size): reasoning-gym "
                    f"draws entry i of seed s from Random(s + i); use data.rg_eval_seed >= "
                    f"{train[1]} or <= {train[0] - self.rg_eval_size}"
                )
        if self.math_batch_timeout_s < self.math_timeout_s:
            raise ConfigError(
                f"data.math_batch_timeout_s = {self.math_batch_timeout_s} < data.math_timeout_s = "
                f"{self.math_timeout_s}: the batch limit must allow at least one full check"
            )


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """Device mesh shape; -1 means all remaining devices."""

    _prefix = "mesh."
    _resumable = True  # checkpoints are restored into the new mesh's shardings
    data: int = option(
        1,
        ge=-1,
        help="devices of the data-parallel axis (rows split, weights replicated); -1: the rest",
    )
    fsdp: int = option(
        -1, ge=-1, help="devices of the fully sharded axis (rows and weights split); -1: the rest"
    )
    tensor: int = option(
        1, ge=-1, help="devices of the tensor-parallel axis (heads and MLP split); -1: the rest"
    )

    def check(self) -> None:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            if size == 0:
                raise ConfigError(f"mesh.{name} = 0 is not allowed; use a positive size or -1")
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ConfigError(f"mesh: at most one axis may be -1, got {sizes}")


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    """Where and how a run writes its outputs."""

    _prefix = "logging."
    _resumable = True
    _outcome = False
    run_dir: str | None = option(None, help="default: runs/<command>-<config name>-<timestamp>")
    plots: bool = option(True, help="write PNG plots of the run's metrics at the end")
    tensorboard: bool = option(True, help="write TensorBoard event files beside metrics.jsonl")
    progress: bool = option(True, help="progress bar on stderr")
    completions_every: int = option(
        10,
        ge=0,
        help="write the step's completions (text, rewards, advantages) to "
        "RUN/completions/step-NNNNNN.pI.jsonl every this many steps and at the last (0: never)",
    )
    completions_groups: int = option(
        4,
        ge=0,
        help="whole groups a logged step writes, drawn at random over every process's (0: all)",
    )
    completions_chars: int = option(
        2000,
        ge=64,
        help="longer prompt and completion texts keep their first and last half of this many "
        "characters (their full length in tokens is written beside them)",
    )


@dataclasses.dataclass(frozen=True)
class TailBatchingConfig(Section):
    """On-policy tail batching beside the group-size controller (docs/controller.md, "Tail
    batching"): a step starts more prompts than it trains, ends its rollout once enough whole
    groups have finished, and trains the prompts it cut later, in a long round that waits for
    all of its groups. Every kept completion is complete and from the current policy."""

    _prefix = "tail_batching."
    enabled: bool = option(False, help="start extra prompts and keep the first whole groups")
    extra: float = option(
        0.25,
        gt=0.0,
        le=4.0,
        help="extra prompts a tail step starts, a share of the prompts it trains (rounded up to "
        "whole prompts per process)",
    )
    long_round_every: int = option(
        0,
        ge=0,
        help="a long round every this many steps when prompts wait (0: only when a whole "
        "step's prompts wait); a long round trains the oldest deferred prompts and waits for "
        "all of its groups",
    )


@dataclasses.dataclass(frozen=True)
class Config(Section):
    """The whole run configuration."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    controller: ControllerConfig = dataclasses.field(default_factory=ControllerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)
    tail_batching: TailBatchingConfig = dataclasses.field(default_factory=TailBatchingConfig)

    def check(self) -> None:
        """Rules across sections."""
        c, t = self.controller, self.train
        if self.tail_batching.enabled:
            for on, what in (
                (c.kind == "hybrid", "controller.kind = 'hybrid' (its sizes are per prompt)"),
                (self.loss.dynamic_sampling, "loss.dynamic_sampling (its refill rounds)"),
            ):
                if on:
                    raise ConfigError(
                        f"tail_batching.enabled = true does not combine with {what}; turn one "
                        f"of them off"
                    )
        if c.kind == "sagc_value" and t.batch_mode != "prompts":
            raise ConfigError(
                "controller.kind = 'sagc_value' needs train.batch_mode = prompts: it weighs "
                "P groups at each G, and batch_mode = budget changes P with G"
            )
        if c.kind == "hybrid":
            if t.batch_mode != "prompts":
                raise ConfigError(
                    "controller.kind = 'hybrid' needs train.batch_mode = prompts: it decides from "
                    "the step's prompts, which batch_mode = budget chooses after G (a per-prompt "
                    "rollout budget is controller.hybrid.rows_per_step)"
                )
            if self.loss.dynamic_sampling:
                raise ConfigError(
                    "controller.kind = 'hybrid' does not train with loss.dynamic_sampling yet: "
                    "the refill rounds bring prompts the controller did not decide for; set it "
                    "to false"
                )
            if c.hybrid.mode == "per_prompt" and c.hybrid.rows_per_step:  # 0: P x G rows
                budget, g = c.hybrid.rows_per_step, c.candidates
                lo, hi = t.prompts_per_step * min(g), t.prompts_per_step * max(g)
                if not lo <= budget <= hi:
                    raise ConfigError(
                        f"controller.hybrid.rows_per_step = {budget} cannot be split into "
                        f"train.prompts_per_step = {t.prompts_per_step} groups from the ladder "
                        f"{list(g)}: allowed {lo} to {hi}"
                    )
