"""Run by tests/parallel/test_parallel.py in a subprocess with 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``). Prints one JSON object.

``sharded_worker.py update KL_BETA``: one greedy generation and two GRPO updates on several
meshes (the first mesh is one device); ``sharded_worker.py trainer RUN_DIR``: a short run of the
Trainer on a mesh, with the programs it compiled.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np

from sagc_jax.config import MeshConfig, load_config
from sagc_jax.parallel import ShardingPlan, bytes_per_device
from sagc_jax.programs.policy import build_sharded_policy, preset_architecture
from sagc_jax.programs.shapes import training_settings
from sagc_jax.programs.state import abstract_policy, build_run
from sagc_jax.rl import completion_mask
from sagc_jax.sampling import left_pad
from sagc_jax.sampling.sampler import policy_sampler

MESHES = {
    "single": (1, 1, 1),
    "fsdp2": (1, 2, 1),
    "fsdp8": (1, 8, 1),
    "tensor4": (1, 1, 4),
    "mixed": (2, 2, 2),
}
ROWS, PROMPT, NEW = 16, 8, 8


class _Tok:  # what the model builder and the sampler need of a tokenizer
    bos_id, eos_id, pad_id = 1, 2, 0


def batch():
    rng = np.random.default_rng(0)
    lens = rng.integers(2, PROMPT + 1, ROWS)
    ids, _ = left_pad([rng.integers(3, 500, n).tolist() for n in lens], 0, (PROMPT,))
    lengths = rng.integers(1, NEW + 1, ROWS)
    return {
        "prompt_ids": ids,
        "prompt_lens": lens.astype(np.int32),
        "completion": rng.integers(3, 500, (ROWS, NEW)).astype(np.int32),
        "old_logp": rng.normal(-3.0, 0.5, (ROWS, NEW)).astype(np.float32),
        "mask": completion_mask(lengths, NEW),
        "adv": rng.normal(size=ROWS).astype(np.float32),
        "rollout": np.arange(ROWS, dtype=np.int32),
        "norm": completion_mask(lengths, NEW).sum(axis=1),  # DAPO's token_mean: its tokens
    }


def run(mesh_shape, devices, kl_beta):
    """The run's state and programs as the trainer builds them (``programs.state.build_run``)
    on the mesh ``mesh_shape``: one greedy generation, two updates."""
    overrides = ["model.preset=tiny", "data.task=synthetic", f"loss.kl_beta={kl_beta}"]
    overrides += ["train.minibatches=2", "train.microbatches=2", "train.learning_rate=1e-3"]
    overrides += [f"sampling.max_new_tokens={NEW}", "loss.algorithm=dapo", "loss.eps_high=0.28"]
    cfg = load_config(None, overrides)
    plan = ShardingPlan.from_config(MeshConfig(*mesh_shape), devices)
    abstract = abstract_policy(preset_architecture(cfg.model, _Tok()), plan)
    policy = build_sharded_policy(abstract, None, 0)
    programs, state = build_run(training_settings(cfg), plan, policy)
    assert (state.ref_params is not None) == (kl_beta > 0)
    params, opt_state = state.params, state.opt_state
    param_bytes = bytes_per_device(params)
    opt_bytes = bytes_per_device(opt_state)
    sampler = policy_sampler(
        policy.graphdef, policy.arch, _Tok(), plan=plan, state_shardings=policy.shardings
    )
    b = batch()
    out = sampler.to_host(
        sampler(
            params,
            b["prompt_ids"],
            b["prompt_lens"],
            jax.random.key(1),
            max_new_tokens=NEW,
            temperature=0.0,
        )
    )
    cache_bytes = bytes_per_device(sampler.empty_cache(ROWS, PROMPT + NEW))
    state, metrics = programs.update(state, plan.global_rows(b), jax.random.key(0))
    # a second call with the same shapes must reuse the program
    state, _ = programs.update(state, plan.global_rows(b), jax.random.key(0))
    params = state.params
    return {
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "params": [np.asarray(x).ravel()[:64].tolist() for x in jax.tree.leaves(params)],
        "param_bytes": param_bytes,
        "opt_bytes": opt_bytes,
        "cache_bytes": cache_bytes,
        "tokens": np.asarray(out.tokens_bt).tolist(),
        "logprobs": np.asarray(out.logprobs_bt).tolist(),
        "update_traces": programs.compiled_programs()["update"],
        "sampler_traces": sampler.num_traces,
        "param_spec": list(params["layers"][0]["mlp"]["gate_df"].sharding.spec),
    }


def trainer_compiles(run_dir):
    """A Trainer on a (data 2, fsdp 4) mesh visiting G = 2, 4, 2, 4: programs traced (one
    rollout program per G, one packed update per row-count rung used)."""
    from helpers import TINY, CyclingController

    from sagc_jax.train.loop import Trainer

    overrides = [*TINY, "train.prompts_per_step=4", "train.steps=4", "mesh.data=2"]
    trainer = Trainer(load_config(None, [*overrides, "logging.tensorboard=false"]), run_dir)
    trainer.controller = CyclingController((2, 4))
    summary = trainer.run(progress=False)
    trainer.close()
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {
        "mesh": dict(trainer.plan.mesh.shape),
        "sampler_traces": trainer.sampler.num_traces,
        "update_traces": trainer.programs.compiled_programs()["update"],
        "update_rungs": len({r["update_rows"] for r in lines if "group_size" in r}),
        "steps": summary["steps"],
        "eval_accuracy": summary["eval/accuracy"],
    }


def main():
    devices = jax.devices()
    assert len(devices) == 8, f"expected 8 simulated devices, got {len(devices)}"
    if sys.argv[1] == "trainer":
        print(json.dumps(trainer_compiles(sys.argv[2])))
        return
    kl_beta = float(sys.argv[2])
    result = {}
    for name, shape in MESHES.items():
        result[name] = run(shape, devices[: int(np.prod(shape))], kl_beta)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
