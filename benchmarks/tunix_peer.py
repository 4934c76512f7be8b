"""The Tunix side of the peer benchmarks (google-tunix 0.1.7: `pip install -e '.[tunix]'`).

Tunix is Google's JAX post-training library (GRPO/DAPO learners, a vanilla JAX sampler, Flax NNX
Llama 3 / Qwen models). Here its Llama 3 is built from the same HF safetensors checkpoint that
sagc_jax loads (`tunix.models.llama3.params.create_model_from_safe_tensors`), and
`check_same_logits` compares one forward pass of both before anything is timed.

What Tunix 0.1.7 does differently, and how the benchmarks meet it (docs/tunix-conventions.md has
the loss conventions):
- Its Llama 3 attention applies rope with theta 1e6 whatever the config says (model.py calls
  `apply_rope` without the config's `rope_theta`), so the shared model uses theta 1e6.
- Prompts and completions are text: `IdTokenizer` maps token i to the word `t<iii>` both ways
  (the word-level scheme of the TRL side), with no BOS, and `pad_id` -1 (Tunix masks every token
  equal to the pad id, sampled ones too, so a real id there would drop tokens).
- The end-of-sequence token is left out of a Tunix completion (never trained on): its lengths
  are one shorter than sagc_jax's and TRL's for every row that ended, and `completion_tokens`
  adds it back so tokens per second count the same tokens on every side.
- `RolloutConfig.seed=None` samples every rollout with the key 0: each step gets its own seed
  (a traced value, nothing recompiles).
"""

from __future__ import annotations

import functools
import time

TUNIX_ROPE_THETA = 1e6
TUNIX_PAD = -1


class IdTokenizer:
    """Token i <-> word `t<iii>`: the five methods Tunix's tokenizer adapter calls."""

    def __init__(self, eos_id: int):
        self._eos = eos_id

    def encode(self, text, **kwargs) -> list[int]:
        return [int(word[1:]) for word in str(text).split()]

    def decode(self, ids, **kwargs) -> str:
        return words(ids)

    def bos_id(self):
        return None  # no BOS is prepended

    def eos_id(self) -> int:
        return self._eos

    def pad_id(self) -> int:
        return TUNIX_PAD


def version() -> str:
    from importlib import metadata

    return metadata.version("google-tunix")


def words(ids) -> str:
    return " ".join(f"t{int(i):03d}" for i in ids)


def tunix_model(checkpoint_dir: str, cfg):
    """Tunix's Llama 3 from the HF checkpoint in `checkpoint_dir` (`cfg`: its sagc_jax
    DecoderConfig, for the shapes), on one CPU device, float32."""
    from tunix.models.llama3 import model as llama3
    from tunix.models.llama3 import params as llama3_params

    if cfg.rope_theta != TUNIX_ROPE_THETA or cfg.rope_scaling is not None:
        raise SystemExit(
            f"tunix_peer: Tunix 0.1.7's Llama 3 always uses rope theta {TUNIX_ROPE_THETA:g} and "
            f"no rope scaling; the checkpoint has theta {cfg.rope_theta:g}, scaling "
            f"{cfg.rope_scaling}"
        )
    config = llama3.ModelConfig(
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads,
        rope_theta=int(cfg.rope_theta),
        norm_eps=cfg.rms_norm_eps,
        weight_tying=cfg.tie_embeddings,
    )
    return llama3_params.create_model_from_safe_tensors(checkpoint_dir, config, one_device_mesh())


@functools.cache
def one_device_mesh():
    """Tunix's ("fsdp", "tp") mesh over the first device (jax.make_mesh's explicit axis types
    break Tunix's embedding lookup, so a plain Mesh)."""
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


def check_same_logits(jax_model, model, tokens_bt, atol: float = 1e-4) -> float:
    """Max |logits difference| of one causal forward pass over `tokens_bt` on both sides;
    exits with a message when it exceeds `atol` (the two models are then not the same)."""
    import jax.numpy as jnp
    import numpy as np

    tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
    b, t = tokens_bt.shape
    positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask_bts = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), jnp.bool_)), (b, t, t))
    theirs, _ = model(tokens_bt, positions_bt, None, mask_bts)
    ours = jax_model(tokens_bt)
    diff = float(np.max(np.abs(np.asarray(theirs, np.float32) - np.asarray(ours, np.float32))))
    if not diff <= atol:
        raise SystemExit(
            f"tunix_peer: the Tunix model's logits differ from sagc_jax's by {diff:.3g} (> "
            f"{atol:g}) on the same weights and tokens {tuple(tokens_bt.shape)}: nothing timed"
        )
    return diff


def completion_tokens(tokens, cap: int) -> list[int]:
    """Lengths of Tunix completions counted as sagc_jax and TRL count them: EOS included (Tunix
    drops it), so a row that ended before `cap` tokens gets one back."""
    return [len(t) + 1 if len(t) < cap else len(t) for t in tokens]


def run_grpo(model, prompts_pt, *, group, new_tokens, eos_ids, steps, warmup, reward, lr, eps):
    """Tunix's GRPOLearner with its vanilla rollout on `prompts_pt` ([P, prompt length] ids):
    `warmup` untimed steps then `steps` timed ones, G = `group`, temperature 1 without top-k/p,
    beta 0, PPO clip `eps`, per-sequence token mean, AdamW (`lr`, no weight decay, global-norm
    clip 1.0). `reward(list of completion id lists) -> list of floats`; `eos_ids` empty: no row
    stops early. Returns per step (all of them, warm-up first): step, rollout and update seconds,
    and completion lengths (`completion_tokens`)."""
    import jax
    import numpy as np
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    prompt_len = prompts_pt.shape[1]
    # forced: an end token no sampled id can equal
    eos_tokens = list(eos_ids) or [TUNIX_PAD]
    mesh = one_device_mesh()
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=new_tokens,
        max_prompt_length=prompt_len,
        kv_cache_size=prompt_len + new_tokens,
        temperature=1.0,
        top_p=1.0,  # with top_p None Tunix samples greedily; 1.0 and no top_k: plain sampling
        top_k=None,
        eos_tokens=eos_tokens,
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in roles},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.chain(
                optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0)
            ),
            eval_every_n_steps=10**9,
            max_steps=warmup + steps,
            pbar_description=None,
        ),
        rollout_config=rollout_config,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        reference=None,
        tokenizer=IdTokenizer(eos_tokens[0]),
        cluster_config=cluster_config,
    )
    algo = grpo_learner.GRPOConfig(
        num_generations=group,
        num_iterations=1,
        beta=0.0,
        epsilon=eps,
        loss_agg_mode="sequence-mean-token-mean",
    )

    def reward_fn(prompts, completions, **kwargs):
        return reward([[int(w[1:]) for w in text.split()] for text in completions])

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=reward_fn)
    record = {"step": [], "rollout": [], "update": [], "lengths": []}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            record[name].append(time.perf_counter() - start)
            return out

        return wrapper

    generate = cluster.generate

    def generate_fresh(*args, **kwargs):
        rollout_config.seed = jax.random.PRNGKey(1000 + len(record["rollout"]))
        out = generate(*args, **kwargs)
        record["lengths"].append(completion_tokens(out.tokens, new_tokens))
        return out

    cluster.generate = timed("rollout", generate_fresh)
    cluster.update_actor = timed("update", cluster.update_actor)
    learner._run_global_step = timed("step", learner._run_global_step)
    dataset = [{"prompts": np.array([words(row) for row in prompts_pt])}] * (warmup + steps)
    learner.train(dataset)
    done = len(record["step"])
    if done != warmup + steps or len(record["lengths"]) != done:
        raise SystemExit(f"tunix_peer: GRPOLearner ran {done} steps, expected {warmup + steps}")
    return record


def run_sampler(model, prompts_bt, *, new_tokens, eos_ids, repeats, seed=0):
    """Tunix's vanilla sampler on `prompts_bt` ([B, prompt length] ids, one row per completion):
    temperature 1 without top-k/p, a cache of prompt + `new_tokens` slots, `eos_ids` empty: no
    row stops early. Returns (best seconds of `repeats` timed calls, the first call's seconds,
    the completion lengths of the best call, EOS included)."""
    from tunix.generate import sampler as sampler_lib

    cfg = model.config
    prompt_len = prompts_bt.shape[1]
    eos_tokens = list(eos_ids) or [TUNIX_PAD]
    sampler = sampler_lib.Sampler(
        model,
        IdTokenizer(eos_tokens[0]),
        sampler_lib.CacheConfig(
            cache_size=prompt_len + new_tokens,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        ),
    )
    texts = [words(row) for row in prompts_bt]

    def call(i):
        start = time.perf_counter()
        out = sampler(
            input_strings=texts,
            max_generation_steps=new_tokens,
            max_prompt_length=prompt_len,
            temperature=1.0,
            top_p=1.0,  # with top_p None Tunix samples greedily
            top_k=None,
            seed=seed + i,
            eos_tokens=eos_tokens,
        )
        return time.perf_counter() - start, completion_tokens(out.tokens, new_tokens)

    first, _ = call(0)
    best, lengths = min(call(i) for i in range(1, repeats + 1))
    return best, first, lengths
