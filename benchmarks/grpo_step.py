"""One full GRPO step (rollout + reward + update) of sagc_jax against TRL's GRPOTrainer (CPU).

Both sides do the same work each step, on the same model: a random Llama (vocab 512, hidden 256,
mlp 688, 4 layers, 8 heads, 4 kv heads, head dim 32, tied embeddings; about 3M parameters, float32,
no rematerialisation), initialised once by transformers and loaded into sagc_jax from a local
checkpoint (`load_hf_checkpoint`), so both sides sample from identical weights; `--prompts` prompts
of 16 tokens x G = `--group` completions (default 8 x 8), temperature 1, no top-k/top-p, a cheap
reward (the fraction of even token ids in the completion, so advantages are not all zero), group
advantages scaled by the group std, PPO-clip loss with eps 0.2 and a per-sequence token mean (TRL
`loss_type="grpo"`, sagc_jax `aggregation="seq_mean"`), beta = 0 (no reference model, no KL), one
AdamW update per step (learning rate 1e-6, constant schedule, global-norm clip 1.0, no weight
decay).

Workloads (`--workload`):
  * forced (default): every completion has exactly `--max-new-tokens` (default 128) tokens; the
    end-of-sequence token does not stop either side (sagc_jax `eos_ids=()`, TRL
    `min_new_tokens`).
  * long-tail: completions stop at the end-of-sequence token, within a cap of `--max-new-tokens`
    (default 512). The random model alone would almost never end (EOS probability about 1/512
    per token), so before either side sees the weights it gets a constant EOS logit bias, built
    from the weights alone (`add_eos_bias`: a residual channel that holds a constant no layer
    reads or writes, and an EOS embedding row that is larger there), sized by bisection on a
    teacher-forced probe of random tokens so that the expected length is `--mean-length`
    (default 60) under the cap; the hazard is then about the same at every position, so lengths
    are roughly geometric. Each side reports the lengths it actually sampled (the sides sample
    independently, so their lengths differ per sample, not in distribution). Both sides end a
    rollout when every row has ended; TRL's update then runs over rows padded to the longest
    completion, sagc_jax's over its update batch (packed or padded, below).

  * sagc_jax: its trainer's paths, as `Trainer.train_step` uses them: `Sampler` (each prompt
    prefilled once, its rows leaving the batch as they finish: `sampling.row_buckets`) -> rewards ->
    `group_advantages`, `completion_mask` -> the update batch -> the update of the run's state and
    programs as `programs.state.build_run` builds them for the trainer; the step
    ends with `jax.device_get` of the update metrics, so the timed work has finished. Log-probs
    for the ratio come from the sampler. With `--packing` (default, as `train.packing: true`) the
    update runs on the rollouts' real tokens packed into rows of prompt + max-new-tokens
    (`programs.packing.pack_update_batch`, the row count a rung of its ladder); `--no-packing`: one
    padded row per rollout. With `--mesh-data N` both programs run data parallel on a
    `ShardingPlan` over N XLA host devices (`--xla_force_host_platform_device_count=N`), as
    `mesh.data: N` would.
  * TRL: `GRPOTrainer.train()` on a CPU torch model (`use_cpu=True`, `bf16=False`,
    `gradient_checkpointing=False`, per-device batch = prompts x `num_generations`,
    `gradient_accumulation_steps=1`, `num_iterations=1`, so the old log-probs are the detached
    current ones and no extra forward is run), generation through `transformers.generate`. The
    tokenizer is a local word-level one (token i is the word `t<iii>`), so nothing is downloaded.
    A step is the wall time between two consecutive `on_step_end` callbacks: batch fetch,
    generation, reward, loss, backward and the optimizer step.

The figure per side is "generated tokens per second of the whole step": the completion tokens
that side sampled in the timed steps (end-of-sequence token included; forced: prompts x G x
max-new-tokens per step) divided by their wall time. The last line prints both and their ratio,
sagc-jax over TRL (above 1: sagc-jax is faster). `--warmup` steps per side run first and are not
timed. sagc_jax's programs are compiled ahead of their first use (the sampler before the first
step, the update whenever a step needs a new batch shape, e.g. a new packed row count) and that
time is reported as "compile", outside the steps. The two systems run one after the other in the
same process. torch runs with `torch.set_num_threads(--threads)` (default: every core this
process may use); JAX runs on its default CPU device as it is (XLA's own thread pool).

Run it on a quiet machine: the load average before and after is printed. Under contention
torch's OpenMP threads wait on preempted partners and `generate` slows down by an order of
magnitude at 2 threads on 2 busy cores (measured: 55 s against 2.9 s at 1 thread), while XLA's
thread pool degrades gracefully, so a loaded machine inflates the ratio.

    .venv/bin/pip install -e '.[bench]'   # once: trl
    .venv/bin/python benchmarks/grpo_step.py [--workload forced|long-tail] [--steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import warnings

from tunix_peer import TUNIX_ROPE_THETA

PROMPT_LEN = 16
VOCAB, PAD, BOS, EOS = 512, 0, 1, 2
LEARNING_RATE, EPS = 1e-6, 0.2
DEFAULT_NEW_TOKENS = {"forced": 128, "long-tail": 512}
# long-tail: the residual channel that carries the EOS bias, and its constant value (about 5x the
# norm of the rest of the residual of this random model, so the feature varies by about 1%)
BIAS_DIM, BIAS_VALUE = 0, 2.0


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workload",
        choices=("forced", "long-tail"),
        default="forced",
        help="forced: every completion runs to --max-new-tokens; long-tail: completions end at "
        "EOS, lengths roughly geometric with mean --mean-length (see below)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=0,
        help="completion cap (default: 128 forced, 512 long-tail)",
    )
    parser.add_argument(
        "--mean-length",
        type=float,
        default=60.0,
        help="long-tail: the expected completion length the EOS logit is tuned for",
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sagc-jax updates on packed rows (train.packing; default: on)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps per system")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (default: usable cores)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--peer",
        choices=("trl", "tunix"),
        default="trl",
        help="trl: TRL's GRPOTrainer (torch, extra 'bench'); tunix: Tunix's GRPOLearner (JAX, "
        "extra 'tunix'), on a model with rope theta 1e6 (what Tunix 0.1.7's Llama 3 applies)",
    )
    parser.add_argument(
        "--mesh-data", type=int, default=1, help="sagc-jax on N host devices, data parallel"
    )
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first step is not timed)")
    if args.prompts < 1 or args.group < 2:
        parser.error("--prompts must be >= 1 and --group >= 2 (advantages need a group)")
    args.max_new_tokens = args.max_new_tokens or DEFAULT_NEW_TOKENS[args.workload]
    if args.workload == "long-tail" and not 1 < args.mean_length < args.max_new_tokens:
        parser.error(
            f"--mean-length {args.mean_length} must lie between 1 and --max-new-tokens "
            f"{args.max_new_tokens}"
        )
    return args


def _fmt(seconds) -> str:
    return " ".join(f"{t:.2f}" for t in seconds)


def reward_b(completion_bt) -> list[float]:
    """The fraction of even token ids in each completion: cheap, and varies within a group."""
    return [sum(1 for t in row if t % 2 == 0) / max(len(row), 1) for row in completion_bt]


@dataclasses.dataclass
class Timing:
    """One side's timed steps: wall seconds and completion tokens (EOS included) per step."""

    step_s: list[float]
    tokens: list[int]
    lengths: list[int]  # every timed completion's length

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / sum(self.step_s)

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_s) / len(self.step_s)

    @property
    def mean_length(self) -> float:
        return sum(self.lengths) / len(self.lengths)


def add_eos_bias(model, mean_length: float, max_new_tokens: int, seed: int) -> tuple:
    """Gives `model` (a tied-embedding Llama) a constant EOS logit bias, so that completions end
    after about `mean_length` tokens (EOS included) under a cap of `max_new_tokens`.

    Llama has no output bias, so one is built from a constant feature: residual channel BIAS_DIM
    holds BIAS_VALUE for every token (embedding column), no layer reads it (the attention and MLP
    input-norm scales are 0 there) or writes it (that row of o_proj and down_proj is 0). After
    the final norm it is BIAS_VALUE / rms(residual), nearly the same at every position (the rest
    of the residual is small next to it), so every logit gets the same shift (no effect) except
    EOS, whose embedding carries BIAS_VALUE + b there: its logit rises by b * h[BIAS_DIM]. b is
    found by bisection on a teacher-forced probe of random tokens: with hazard p_bt the EOS
    probability at completion step t, E[length] = 1 + sum_{t < cap - 1} prod_{s <= t}(1 - p_bs),
    exact on the probe since only the EOS logit moves (the probe holds no EOS).
    Returns (the mean EOS logit raise, the probe's expected length).
    """
    import torch

    with torch.no_grad():
        embed_vd = model.model.embed_tokens.weight
        assert model.lm_head.weight.data_ptr() == embed_vd.data_ptr(), "embeddings must be tied"
        embed_vd[:, BIAS_DIM] = BIAS_VALUE
        for layer in model.model.layers:
            layer.input_layernorm.weight[BIAS_DIM] = 0.0
            layer.post_attention_layernorm.weight[BIAS_DIM] = 0.0
            layer.self_attn.o_proj.weight[BIAS_DIM] = 0.0
            layer.mlp.down_proj.weight[BIAS_DIM] = 0.0

        gen = torch.Generator().manual_seed(seed)
        probe_bt = torch.randint(3, VOCAB, (16, PROMPT_LEN + max_new_tokens), generator=gen)
        seen = {}
        hook = model.model.norm.register_forward_hook(lambda m, i, out: seen.update(h=out))
        # completion step t is predicted at position PROMPT_LEN - 1 + t
        logits_btv = model(probe_bt).logits[:, PROMPT_LEN - 1 : -1].float()
        hook.remove()
    feature_bt = seen["h"][:, PROMPT_LEN - 1 : -1, BIAS_DIM].float()
    eos_bt = logits_btv[..., EOS]
    others_bt = torch.cat([logits_btv[..., :EOS], logits_btv[..., EOS + 1 :]], -1).logsumexp(-1)

    def expected_length(b: float) -> float:
        survive_bt = torch.cumprod(1 - torch.sigmoid(eos_bt + b * feature_bt - others_bt), dim=1)
        return float((1 + survive_bt[:, :-1].sum(1)).mean())

    low, high = 0.0, 1.0
    while expected_length(high) > mean_length:  # the expected length falls as b grows
        low, high = high, 2 * high
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_length(mid) > mean_length else (low, mid)
    b = (low + high) / 2
    with torch.no_grad():
        embed_vd[EOS, BIAS_DIM] += b
    return float(b * feature_bt.mean()), expected_length(b)


def build_models(args, checkpoint_dir: str):
    """(torch LlamaForCausalLM, sagc_jax Decoder, its DecoderConfig, a note): one random
    initialisation by transformers (seed `--seed`), EOS raised for long-tail, then written to
    `checkpoint_dir` and read back by sagc_jax, so both sides hold the same weights."""
    import torch
    import transformers

    from sagc_jax.models import load_hf_checkpoint

    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            tie_word_embeddings=True,
            max_position_embeddings=max(512, PROMPT_LEN + args.max_new_tokens),
            rope_theta=TUNIX_ROPE_THETA if args.peer == "tunix" else 10_000.0,
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    )
    note = "EOS never stops"
    if args.workload == "long-tail":
        raise_, expected = add_eos_bias(model, args.mean_length, args.max_new_tokens, args.seed)
        note = (
            f"EOS logit +{raise_:.2f} (constant-feature bias), expected length {expected:.1f} "
            f"on a random-token probe"
        )
    model.save_pretrained(checkpoint_dir)
    jax_model, cfg = load_hf_checkpoint(checkpoint_dir)
    return model, jax_model, cfg, note


def run_sagc(jax_model, cfg, prompts_pt, args) -> tuple[Timing, float]:
    """(timed steps, compile seconds) of sagc_jax's rollout + reward + update."""
    import jax
    import numpy as np
    from flax import nnx

    from sagc_jax.config import load_config
    from sagc_jax.parallel import ShardingPlan
    from sagc_jax.programs.policy import Policy
    from sagc_jax.programs.shapes import training_settings
    from sagc_jax.programs.state import build_run
    from sagc_jax.rl import completion_mask, group_advantages
    from sagc_jax.sampling.sampler import Sampler

    new_tokens, prompts, group = args.max_new_tokens, args.prompts, args.group
    eos_ids = () if args.workload == "forced" else (EOS,)
    # the run's state and update programs as the trainer builds them (`programs.state.build_run`)
    # from the settings above; the update computes a microbatch's logits at once, as TRL does
    run_cfg = load_config(
        None,
        [
            f"mesh.data={args.mesh_data}",
            "model.param_dtype=float32",
            f"train.learning_rate={LEARNING_RATE}",
            "train.lr_schedule=constant",
            "train.steps=100",
            "loss.algorithm=grpo",
            f"loss.eps_low={EPS}",
            f"loss.eps_high={EPS}",
            "loss.kl_beta=0",
            "loss.logprob_chunk=0",
            "sampling.temperature=1.0",
            f"sampling.max_new_tokens={new_tokens}",
        ],
    )
    plan = ShardingPlan.from_config(run_cfg.mesh, jax.devices()[: args.mesh_data])
    batch_shards = plan.batch_shards
    graphdef, params = nnx.split(jax_model)
    shardings = plan.params(params)
    policy = Policy(graphdef, jax.device_put(params, shardings), cfg, shardings)
    run, run_state = build_run(training_settings(run_cfg), plan, policy)
    sampler = Sampler(
        graphdef, cfg, eos_ids=eos_ids, pad_id=PAD, plan=plan, state_shardings=shardings
    )
    settings = run.settings

    # Row r belongs to group r // G, as in `train.rollout.generate`.
    prompt_ids = np.repeat(np.asarray(prompts_pt, np.int32), group, axis=0)
    prompt_lens = np.full((prompts * group,), PROMPT_LEN, np.int32)
    group_ids = np.repeat(np.arange(prompts), group)
    root_key = jax.random.key(args.seed)

    def update_batch(completion, old_logp, mask, adv) -> dict:
        """The update's input as `UpdateBatcher` (train/update_batch.py) builds it (one process)."""
        from sagc_jax.programs.packing import (
            pack_update_batch,
            packed_rows_needed,
            padded_update_batch,
            resolve_pack_len,
            row_multiple,
        )

        arrays = (prompt_ids, prompt_lens, completion, old_logp, adv, mask)
        kw = dict(aggregation=settings.aggregation, max_new_tokens=new_tokens)
        if not args.packing:
            return padded_update_batch(*arrays, **kw, rows=len(prompt_lens))
        pack_len = resolve_pack_len(0, (PROMPT_LEN,), new_tokens)
        rows = packed_rows_needed(
            prompt_lens,
            mask,
            pack_len=pack_len,
            multiple=row_multiple(1, 1, batch_shards),
            max_rows=len(prompt_lens),
        )
        return pack_update_batch(*arrays, **kw, pack_len=pack_len, rows=rows)

    start = time.perf_counter()
    sampler.compile(
        run_state.params, len(prompt_ids), PROMPT_LEN, max_new_tokens=new_tokens, prompts=prompts
    )
    compile_s = time.perf_counter() - start
    update_shapes: set = set()
    rollout_s: list[float] = []

    def step(i) -> tuple[float, np.ndarray]:
        """(seconds, completion lengths [B]) of step i, compiling excluded."""
        nonlocal run_state, compile_s
        t0 = time.perf_counter()
        key = jax.random.fold_in(root_key, i)
        rollout_key, update_key = jax.random.split(key)
        out = sampler(  # each prompt once: its G rollouts share one prefill
            run_state.params,
            np.asarray(prompts_pt, np.int32),
            prompt_lens[::group],
            rollout_key,
            prompt_index_r=group_ids,
            max_new_tokens=new_tokens,
            temperature=1.0,
        )
        out = sampler.to_host(out)
        rollout_s.append(time.perf_counter() - t0)
        completion = np.asarray(out.tokens_bt)
        lengths = np.asarray(out.lengths_b)
        rewards = np.asarray(
            reward_b([row[:n].tolist() for row, n in zip(completion, lengths, strict=True)]),
            np.float32,
        )
        adv, _ = group_advantages(rewards, group_ids, prompts, scale_by_std=True)
        mask = completion_mask(lengths, completion.shape[1])
        batch = update_batch(
            completion, np.asarray(out.logprobs_bt), mask, np.asarray(adv, np.float32)
        )
        shape = batch["mask"].shape
        paused = 0.0
        if shape not in update_shapes:  # a new packed row count: compile it outside the step
            t1 = time.perf_counter()
            run.compile_update(run_state, batch, update_key)
            paused = time.perf_counter() - t1
            compile_s += paused
            update_shapes.add(shape)
        run_state, upd = run.update(run_state, batch, update_key)
        upd = jax.device_get(upd)
        if args.workload == "forced":
            assert int(lengths.min()) == new_tokens, lengths
        assert upd["skipped"] == 0, upd
        return time.perf_counter() - t0 - paused, lengths

    for i in range(args.warmup):
        step(i)
    timing = Timing([], [], [])
    for i in range(args.warmup, args.warmup + args.steps):
        seconds, lengths = step(i)
        timing.step_s.append(seconds)
        timing.tokens.append(int(lengths.sum()))
        timing.lengths.extend(lengths.tolist())
    # every program was compiled ahead of its first call: one sampler, one update per shape
    assert sampler.compiled_programs() == 1, sampler.compiled_programs()
    assert run.compiled_programs()["update"] == len(update_shapes), update_shapes
    layout = "packed rows" if args.packing else "padded rows"
    shapes = ", ".join(f"{r}x{t}" for r, t in sorted(update_shapes))
    print(f"sagc-jax rollout part of each timed step (s): {_fmt(rollout_s[args.warmup :])}")
    print(f"sagc-jax update batches compiled ({layout}): {shapes}")
    return timing, compile_s


def _word(i: int) -> str:
    return f"t{i:03d}"


def _word_tokenizer():
    """A local tokenizer over the model's 512 ids: id i <-> word `t<iii>` (3 digits, so that no
    special token is a prefix of another word), no special tokens added."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {_word(i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=_word(3)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=_word(PAD),
        bos_token=_word(BOS),
        eos_token=_word(EOS),
        unk_token=_word(3),
        padding_side="left",
    )


def run_trl(model, prompts_pt, args) -> tuple[Timing, float]:
    """(timed steps, warm-up seconds) of TRL's GRPOTrainer, steps as the Trainer runs them."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    new_tokens = args.max_new_tokens
    tokenizer = _word_tokenizer()
    texts = [" ".join(_word(t) for t in row) for row in prompts_pt]
    for text, row in zip(texts, prompts_pt, strict=True):  # the same prompt tokens as sagc_jax
        assert tokenizer(text)["input_ids"] == row.tolist(), text
    dataset = datasets.Dataset.from_dict({"prompt": texts})

    def reward_fn(prompts, completions, completion_ids, **kwargs):
        return reward_b(completion_ids)

    marks: list[float] = []
    lengths: list[list[int]] = []  # per step

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    class Lengths(GRPOTrainer):
        # Each step generates once; its completions (EOS included) give the step's tokens.
        def _generate(self, prompts):
            out = super()._generate(prompts)
            lengths.append([len(c) for c in out[1]])
            return out

    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=args.prompts * args.group,
            num_generations=args.group,
            gradient_accumulation_steps=1,
            num_iterations=1,
            max_completion_length=new_tokens,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            generation_kwargs={"min_new_tokens": new_tokens} if args.workload == "forced" else {},
            beta=0.0,
            epsilon=EPS,
            loss_type="grpo",
            scale_rewards="group",
            learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            max_steps=args.warmup + args.steps,
            logging_steps=10_000,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            log_completions=False,
            seed=args.seed,
        )
        trainer = Lengths(
            model=model,
            reward_funcs=reward_fn,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        trainer.remove_callback(transformers.PrinterCallback)  # keep the output to our lines
        trainer.train()
    steps = args.warmup + args.steps
    assert len(marks) == steps + 1 and len(lengths) == steps, (marks, len(lengths))
    if args.workload == "forced":
        assert min(min(s) for s in lengths) == new_tokens, lengths
    step_s = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    timed = lengths[args.warmup :]
    timing = Timing(step_s[args.warmup :], [sum(s) for s in timed], [n for s in timed for n in s])
    return timing, sum(step_s[: args.warmup])


def load_tunix(jax_model, cfg, checkpoint_dir, seed: int):
    """Tunix's Llama 3 from the checkpoint sagc_jax loaded, checked to give the same logits."""
    import numpy as np
    import tunix_peer

    model = tunix_peer.tunix_model(checkpoint_dir, cfg)
    probe = np.random.RandomState(seed + 1).randint(3, VOCAB, (2, PROMPT_LEN + 16))
    diff = tunix_peer.check_same_logits(jax_model, model, probe)
    print(f"tunix model: the same logits as sagc-jax's to {diff:.1e} (max abs, 2 x 32 tokens)")
    return model


def run_tunix(model, prompts_pt, args) -> tuple[Timing, float, list]:
    """(timed steps, warm-up seconds, per timed step (rollout s, update s)) of Tunix's
    GRPOLearner with its vanilla rollout."""
    import tunix_peer

    record = tunix_peer.run_grpo(
        model,
        prompts_pt,
        group=args.group,
        new_tokens=args.max_new_tokens,
        eos_ids=() if args.workload == "forced" else (EOS,),
        steps=args.steps,
        warmup=args.warmup,
        reward=reward_b,
        lr=LEARNING_RATE,
        eps=EPS,
    )
    if args.workload == "forced":
        assert min(min(s) for s in record["lengths"]) == args.max_new_tokens, record["lengths"]
    timed = slice(args.warmup, None)
    lengths = record["lengths"][timed]
    timing = Timing(
        record["step"][timed], [sum(s) for s in lengths], [n for s in lengths for n in s]
    )
    split = list(zip(record["rollout"][timed], record["update"][timed], strict=True))
    return timing, sum(record["step"][: args.warmup]), split


def _lengths_summary(name: str, timing: Timing, cap: int) -> str:
    import numpy as np

    x = np.asarray(timing.lengths)
    return (
        f"{name} completion lengths ({len(x)} timed): mean {x.mean():.1f}, median "
        f"{np.median(x):.0f}, p90 {np.percentile(x, 90):.0f}, max {x.max()}, at the cap "
        f"{np.mean(x == cap):.1%}"
    )


def _versions(peer: str) -> str:
    if peer == "tunix":
        import flax
        import tunix

        return f"tunix {tunix.__version__} | flax {flax.__version__}"
    import torch
    import transformers
    import trl

    return (
        f"torch {torch.__version__} | transformers {transformers.__version__} | trl "
        f"{trl.__version__}"
    )


def main() -> None:
    args = _parse()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU-against-CPU comparison
    if args.mesh_data > 1:  # before jax is imported
        flag = f"--xla_force_host_platform_device_count={args.mesh_data}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    warnings.filterwarnings("ignore")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or cores

    import jax
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # save_pretrained's "Writing model shards"
    rng = np.random.RandomState(args.seed)
    prompts_pt = rng.randint(3, VOCAB, (args.prompts, PROMPT_LEN)).astype(np.int32)

    print(
        f"jax {jax.__version__} ({jax.devices()[0].platform}, {jax.device_count()} devices) | "
        f"{_versions(args.peer)} | torch set_num_threads({threads}) | {cores} usable cores, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        torch_model, jax_model, cfg, note = build_models(args, checkpoint_dir)
        if args.peer == "tunix":  # before anything is timed: the same weights, the same logits
            tunix_model = load_tunix(jax_model, cfg, checkpoint_dir, args.seed)
    print(f"workload {args.workload}: {note}")
    sys.stdout.flush()
    sagc, compile_s = run_sagc(jax_model, cfg, prompts_pt, args)
    print(f"sagc-jax steps (s): {_fmt(sagc.step_s)}")
    print(_lengths_summary("sagc-jax", sagc, args.max_new_tokens))
    sys.stdout.flush()
    if args.peer == "tunix":
        theirs, warm_s, split = run_tunix(tunix_model, prompts_pt, args)
        print(
            f"tunix steps (s): {_fmt(theirs.step_s)} (first {args.warmup} untimed, compiling: "
            f"{warm_s:.2f} s)"
        )
        print(
            "tunix rollout / update part of each timed step (s): "
            + " ".join(f"{r:.2f}/{u:.2f}" for r, u in split)
        )
    else:
        theirs, warm_s = run_trl(torch_model, prompts_pt, args)
        print(f"trl steps (s): {_fmt(theirs.step_s)} (first {args.warmup} untimed: {warm_s:.2f} s)")
    print(_lengths_summary(args.peer, theirs, args.max_new_tokens))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    layout = "packed" if args.packing else "padded"
    print(
        f"grpo step ({args.workload}, {args.prompts}x{args.group}, max {args.max_new_tokens} new "
        f"tokens, 4L/256d, {layout} update): sagc-jax {sagc.tokens_per_s:,.0f} tok/s (step "
        f"{sagc.mean_step_s:.2f} s, mean length {sagc.mean_length:.1f}, compile {compile_s:.1f} s)"
        f" | {args.peer} {theirs.tokens_per_s:,.0f} tok/s (step {theirs.mean_step_s:.2f} s, mean "
        f"length {theirs.mean_length:.1f}) | ratio {sagc.tokens_per_s / theirs.tokens_per_s:.2f}x"
    )


if __name__ == "__main__":
    main()
