"""One full GRPO step (rollout + reward + update) of sagc_jax against TRL's GRPOTrainer (CPU).

Both sides do the same work each step, on the same model: a random Llama (vocab 512, hidden 256,
mlp 688, 4 layers, 8 heads, 4 kv heads, head dim 32, tied embeddings; about 3M parameters, float32,
no rematerialisation), 8 prompts of 16 tokens x G = 8 completions of exactly 128 tokens (no
end-of-sequence stop), temperature 1, no top-k/top-p, a cheap reward (the fraction of even token
ids in the completion, so advantages are not all zero), group advantages scaled by the group std,
PPO-clip loss with eps 0.2 and a per-sequence token mean (TRL `loss_type="grpo"`, sagc_jax
`aggregation="seq_mean"`), beta = 0 (no reference model, no KL), one AdamW update per step
(learning rate 1e-6, constant schedule, global-norm clip 1.0, no weight decay).

  * sagc_jax: its lower-level API, as `Trainer.train_step` uses it: `Sampler` (`eos_ids=()`) ->
    rewards -> `group_advantages`, `completion_mask` -> `PolicyPrograms.update`; the step ends
    with `jax.device_get` of the update metrics, so the timed work has finished. Log-probs for
    the ratio come from the sampler. With `--mesh-data N` both programs run data parallel on a
    `ShardingPlan` over N XLA host devices (`--xla_force_host_platform_device_count=N`: the
    cores split between N device threads pools instead of one), as `mesh.data: N` would.
  * TRL: `GRPOTrainer.train()` on a CPU torch model (`use_cpu=True`, `bf16=False`,
    `gradient_checkpointing=False`, per-device batch 64 = 8 prompts x `num_generations=8`,
    `gradient_accumulation_steps=1`, `num_iterations=1`, so the old log-probs are the detached
    current ones and no extra forward is run), generation through `transformers.generate` with
    `min_new_tokens=128` so every row runs to 128 tokens. The tokenizer is a local word-level one
    (token i is the word `t<iii>`), so nothing is downloaded. A step is the wall time between two
    consecutive `on_step_end` callbacks: batch fetch, generation, reward, loss, backward and the
    optimizer step.

The figure per side is "rollout tokens per second of the whole step": 8 x 8 x 128 = 8192
generated tokens divided by the mean wall time of a step. `--warmup` steps per side run first
and are not timed (for sagc_jax they include compiling the sampler and update programs, reported
as "compile" = the warm-up time minus `--warmup` x the mean timed step); then `--steps` steps
are timed.
The two systems run one after the other in the same process. torch runs with
`torch.set_num_threads(--threads)` (default: every core this process may use); JAX runs on its
default CPU device as it is (XLA's own thread pool). The last line is the comparable one.

Run it on a quiet machine: the load average before and after is printed. Under contention
torch's OpenMP threads wait on preempted partners and `generate` slows down by an order of
magnitude at 2 threads on 2 busy cores (measured: 55 s against 2.9 s at 1 thread), while XLA's
thread pool degrades gracefully, so a loaded machine inflates the ratio.

    .venv/bin/pip install trl==1.16.0   # once; keeps torch, transformers as they are
    .venv/bin/python benchmarks/grpo_step.py [--steps 3] [--warmup 1] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS = 8, 8, 16, 128
VOCAB, PAD, BOS, EOS = 512, 0, 1, 2
LEARNING_RATE, EPS = 1e-6, 0.2


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps per system")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (default: usable cores)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mesh-data", type=int, default=1, help="sagc-jax on N host devices, data parallel"
    )
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1 (the first step compiles)")
    return args


def _fmt(seconds) -> str:
    return " ".join(f"{t:.2f}" for t in seconds)


def reward_b(completion_bt) -> list[float]:
    """The fraction of even token ids in each completion: cheap, and varies within a group."""
    return [sum(1 for t in row if t % 2 == 0) / max(len(row), 1) for row in completion_bt]


def run_sagc(prompts_pt, args) -> tuple[list[float], float]:
    """(timed step seconds, warm-up seconds) of sagc_jax's rollout + reward + update."""
    import jax
    import numpy as np
    from flax import nnx

    from sagc_jax.config import MeshConfig
    from sagc_jax.models import Decoder, DecoderConfig
    from sagc_jax.parallel import ShardingPlan
    from sagc_jax.rl import completion_mask, group_advantages
    from sagc_jax.sampling.sampler import Sampler
    from sagc_jax.train.optim import make_optimizer
    from sagc_jax.train.programs import PolicyPrograms, StateShardings, UpdateSettings

    cfg = DecoderConfig(
        family="llama",
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        tie_embeddings=True,
        eos_ids=(EOS,),
        bos_id=BOS,
    )
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(args.seed)))
    tx = make_optimizer(LEARNING_RATE, total_steps=100)
    opt_state = tx.init(params)
    if args.mesh_data > 1:
        plan = ShardingPlan.from_config(MeshConfig(data=args.mesh_data, fsdp=1, tensor=1))
        param_sh = plan.params(params)
        opt_sh = plan.opt_state(tx, opt_state, param_sh)
        params, opt_state = jax.device_put((params, opt_state), (param_sh, opt_sh))
        programs = PolicyPrograms(graphdef, tx, plan, StateShardings(param_sh, opt_sh))
        sampler = Sampler(
            graphdef, cfg, eos_ids=(), pad_id=PAD, plan=plan, state_shardings=param_sh
        )
    else:
        programs = PolicyPrograms(graphdef, tx)
        sampler = Sampler(graphdef, cfg, eos_ids=(), pad_id=PAD)
    settings = UpdateSettings(
        aggregation="seq_mean",
        eps_low=EPS,
        eps_high=EPS,
        kl_beta=0.0,
        temperature=1.0,
        max_new_tokens=NEW_TOKENS,
    )
    # Row r belongs to group r // G, as in `train.rollout.generate`.
    prompt_ids = np.repeat(np.asarray(prompts_pt, np.int32), GROUP, axis=0)
    prompt_lens = np.full((PROMPTS * GROUP,), PROMPT_LEN, np.int32)
    group_ids = np.repeat(np.arange(PROMPTS), GROUP)
    root_key = jax.random.key(args.seed)

    rollout_s: list[float] = []

    def step(i):
        nonlocal params, opt_state
        t0 = time.perf_counter()
        key = jax.random.fold_in(root_key, i)
        rollout_key, update_key = jax.random.split(key)
        out = sampler(
            params, prompt_ids, prompt_lens, rollout_key, max_new_tokens=NEW_TOKENS, temperature=1.0
        )
        out = sampler.to_host(out)
        rollout_s.append(time.perf_counter() - t0)
        completion = np.asarray(out.tokens_bt)
        lengths = np.asarray(out.lengths_b)
        rewards = np.asarray(
            reward_b([row[:n].tolist() for row, n in zip(completion, lengths, strict=True)]),
            np.float32,
        )
        adv, _ = group_advantages(rewards, group_ids, PROMPTS, scale_by_std=True)
        mask = completion_mask(lengths, completion.shape[1])
        batch = {
            "prompt_ids": prompt_ids,
            "prompt_lens": prompt_lens,
            "completion": completion,
            "old_logp": np.asarray(out.logprobs_bt),
            "mask": mask,
            "adv": np.asarray(adv, np.float32),
        }
        params, opt_state, upd = programs.update(params, opt_state, batch, update_key, settings)
        upd = jax.device_get(upd)
        assert int(lengths.min()) == NEW_TOKENS, lengths
        assert upd["skipped"] == 0, upd

    start = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    warm = time.perf_counter() - start
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    assert sampler.compiled_programs() == 1 and programs.compiled_programs()["update"] == 1
    print(f"sagc-jax rollout part of each timed step (s): {_fmt(rollout_s[args.warmup :])}")
    return times, warm


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


def run_trl(prompts_pt, args) -> tuple[list[float], float]:
    """(timed step seconds, warm-up seconds) of TRL's GRPOTrainer, steps as the Trainer runs."""
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

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
            max_position_embeddings=512,
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    )
    tokenizer = _word_tokenizer()
    texts = [" ".join(_word(t) for t in row) for row in prompts_pt]
    for text, row in zip(texts, prompts_pt, strict=True):  # the same prompt tokens as sagc_jax
        assert tokenizer(text)["input_ids"] == row.tolist(), text
    dataset = datasets.Dataset.from_dict({"prompt": texts})

    def reward_fn(prompts, completions, completion_ids, **kwargs):
        return reward_b(completion_ids)

    marks: list[float] = []
    lengths: list[int] = []

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    class Lengths(GRPOTrainer):
        # Checks that every completion really has 128 tokens (no early stop).
        def _generate(self, prompts):
            out = super()._generate(prompts)
            lengths.extend(len(c) for c in out[1])
            return out

    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=PROMPTS * GROUP,
            num_generations=GROUP,
            gradient_accumulation_steps=1,
            num_iterations=1,
            max_completion_length=NEW_TOKENS,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            generation_kwargs={"min_new_tokens": NEW_TOKENS},
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
    assert len(marks) == args.warmup + args.steps + 1, marks
    assert lengths and min(lengths) == NEW_TOKENS, sorted(set(lengths))
    steps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return steps[args.warmup :], sum(steps[: args.warmup])


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
    import trl

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    rng = np.random.RandomState(args.seed)
    prompts_pt = rng.randint(3, VOCAB, (PROMPTS, PROMPT_LEN)).astype(np.int32)
    tokens = PROMPTS * GROUP * NEW_TOKENS

    print(
        f"jax {jax.__version__} ({jax.devices()[0].platform}, {jax.device_count()} devices) | "
        f"torch {torch.__version__} set_num_threads({threads}) | transformers "
        f"{transformers.__version__} | trl {trl.__version__} | {cores} usable cores, "
        f"load {os.getloadavg()[0]:.2f}"
    )
    sys.stdout.flush()
    sagc_times, sagc_warm = run_sagc(prompts_pt, args)
    sagc_step = float(np.mean(sagc_times))
    print(f"sagc-jax steps (s): {_fmt(sagc_times)}")
    sys.stdout.flush()
    trl_times, trl_warm = run_trl(prompts_pt, args)
    trl_step = float(np.mean(trl_times))
    print(f"trl steps (s): {_fmt(trl_times)} (first {args.warmup} untimed: {trl_warm:.2f} s)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    compile_s = sagc_warm - args.warmup * sagc_step
    sagc_tps, trl_tps = tokens / sagc_step, tokens / trl_step
    print(
        f"grpo step ({PROMPTS}x{GROUP}, {NEW_TOKENS} new tokens, 4L/256d): "
        f"sagc-jax {sagc_tps:,.0f} tok/s (step {sagc_step:.2f} s, compile {compile_s:.1f} s) | "
        f"trl {trl_tps:,.0f} tok/s (step {trl_step:.2f} s) | ratio {sagc_tps / trl_tps:.2f}x"
    )


if __name__ == "__main__":
    main()
