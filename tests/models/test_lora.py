"""LoRA on the policy: adapters leave a fresh model exact, only they train, the samplers decode
them merged, checkpoints name the base and resume exactly, a mesh trains like one device."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import PYTHONPATH, ROOT, TINY, sets

from sagc_jax.cli import main
from sagc_jax.config import ConfigError, load_config
from sagc_jax.models import Decoder, KVCache, get_preset, init_cache
from sagc_jax.models.architecture import LORA_TARGETS
from sagc_jax.models.lora import TARGETS, LoRAParam, delta, merge_adapters, scale, token_keys
from sagc_jax.train.loop import Trainer
from sagc_jax.train.lora_base import base_identity, check_same_base

# DAPO's overlong shaping: the random tiny model's rewards differ by length, so the adapters
# get real gradients (all-zero rewards give none)
LORA = ["model.lora_rank=4", "logging.tensorboard=false", "loss.overlong_buffer=8"]


def _split(cfg, seed=0):
    return nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)), LoRAParam, ...)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_the_config_keys_name_the_model_targets():
    from sagc_jax import config

    assert config.LORA_TARGETS == LORA_TARGETS == tuple(TARGETS)


def test_fresh_adapters_give_exactly_the_base_model():
    cfg = get_preset("tiny")
    base_graphdef, base = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    assert not any("lora" in str(path) for path, _ in nnx.to_flat_state(base))
    graphdef, adapters, weights = _split(cfg.replace(lora_rank=4))
    # the same weights as the plain model of the same seed, and one A and B per target and layer
    for a, b in zip(_leaves(weights), _leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(jax.tree.leaves(adapters)) == 2 * len(TARGETS) * cfg.num_layers
    tokens_bt = jnp.asarray(np.random.default_rng(0).integers(3, 500, (2, 9)), jnp.int32)
    plain, adapted = nnx.merge(base_graphdef, base), nnx.merge(graphdef, adapters, weights)
    np.testing.assert_array_equal(adapted(tokens_bt), plain(tokens_bt))
    cache = init_cache(cfg, 2, 12)
    np.testing.assert_array_equal(
        adapted.apply_cached(tokens_bt, cache)[0], plain.apply_cached(tokens_bt, cache)[0]
    )
    assert isinstance(cache, KVCache)


def test_merged_adapters_compute_the_adapted_model():
    cfg = get_preset("tiny", lora_rank=4, lora_targets=("q_proj", "o_proj", "down_proj"))
    graphdef, adapters, weights = _split(cfg)
    key = jax.random.key(1)
    adapters = jax.tree.map(lambda x: jax.random.normal(key, x.shape) * 0.1, adapters)
    attn = adapters["layers"][0]["attn"]
    assert set(attn) == {"q_lora_a_dr", "q_lora_b_rnh", "o_lora_a_nhr", "o_lora_b_rd"}
    delta_nhd = delta(attn["o_lora_a_nhr"][...], attn["o_lora_b_rd"][...], scale(cfg))
    assert delta_nhd.shape == weights["layers"][0]["attn"]["o_nhd"].shape
    merged = merge_adapters(adapters, weights, scale(cfg))
    plain_graphdef = nnx.split(Decoder(cfg.replace(lora_rank=0), rngs=nnx.Rngs(0)))[0]
    tokens_bt = jnp.asarray(np.random.default_rng(0).integers(3, 500, (2, 9)), jnp.int32)
    adapted_btv = nnx.merge(graphdef, adapters, weights)(tokens_bt)
    merged_btv = nnx.merge(plain_graphdef, merged)(tokens_bt)
    base_btv = nnx.merge(plain_graphdef, weights)(tokens_bt)
    assert float(jnp.max(jnp.abs(adapted_btv - base_btv))) > 0.1  # the adapters do something
    np.testing.assert_allclose(merged_btv, adapted_btv, atol=2e-4)


def test_dropout_acts_only_with_keys_and_follows_the_rollout():
    """LoRA dropout drops the adapters' inputs in a forward given keys (the update's), never
    otherwise (sampling, the reference); the same keys drop the same entries, and the keys go
    with the rollout (``token_keys``): a rollout moved to another row is dropped alike."""
    cfg = get_preset("tiny", lora_rank=4, lora_dropout=0.5)
    graphdef, adapters, weights = _split(cfg)
    key = jax.random.key(1)
    adapters = jax.tree.map(lambda x: jax.random.normal(key, x.shape) * 0.1, adapters)
    model = nnx.merge(graphdef, adapters, weights)
    plain = nnx.merge(_split(cfg.replace(lora_dropout=0.0))[0], adapters, weights)
    tokens_bt = jnp.asarray(np.random.default_rng(0).integers(3, 500, (2, 9)), jnp.int32)
    positions_bt = jnp.broadcast_to(jnp.arange(9), (2, 9))
    rollout_bt = jnp.broadcast_to(jnp.array([[5], [7]]), (2, 9))  # two rollouts' ids
    keys_bt = token_keys(jax.random.key(2), rollout_bt, positions_bt)
    np.testing.assert_array_equal(model(tokens_bt), plain(tokens_bt))
    dropped = model(tokens_bt, dropout_key=keys_bt)
    assert float(jnp.max(jnp.abs(dropped - plain(tokens_bt)))) > 1e-3
    np.testing.assert_array_equal(dropped, model(tokens_bt, dropout_key=keys_bt))
    swapped = model(tokens_bt[::-1], dropout_key=keys_bt[::-1])  # rollouts 7 and 5 swap rows
    np.testing.assert_allclose(swapped[::-1], dropped, atol=1e-6)
    # on the base (adapters zero) dropout changes nothing
    zero = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, adapters), weights)
    np.testing.assert_array_equal(zero(tokens_bt, dropout_key=keys_bt), zero(tokens_bt))


def _update_batch(rows=8, prompt=6, new=12, seed=0):
    """A padded update batch (programs.packing.PADDED_KEYS) with random tokens and advantages."""
    rng = np.random.default_rng(seed)
    return {
        "norm": np.ones((rows,), np.float32),  # GRPO's seq_mean: one per sequence
        "prompt_ids": rng.integers(3, 15, (rows, prompt)).astype(np.int32),
        "prompt_lens": np.full((rows,), prompt, np.int32),
        "completion": rng.integers(3, 15, (rows, new)).astype(np.int32),
        "old_logp": rng.normal(-3.0, 0.5, (rows, new)).astype(np.float32),
        "mask": np.ones((rows, new), np.float32),
        "adv": rng.normal(size=rows).astype(np.float32),
        "rollout": np.arange(rows, dtype=np.int32),
    }


@pytest.mark.slow
def test_only_the_adapters_train_and_the_reference_is_the_base(tmp_path):
    overrides = [*TINY, *LORA, "train.steps=2", "loss.kl_beta=0.05", "model.param_dtype=bfloat16"]
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg, tmp_path / "run")
    base, fresh = _leaves(trainer.state.base), _leaves(trainer.state.params)
    assert {str(x.dtype) for x in base} == {"bfloat16"}  # the base as configured
    assert {str(x.dtype) for x in fresh} == {"float32"}  # the adapters always
    adapter_shapes = [x.shape for x in jax.tree.leaves(trainer.state.params)]
    # the optimizer's moments mirror the adapters only: no moment, no master copy of a weight
    moments = [x.shape for x in jax.tree.leaves(trainer.state.opt_state) if np.ndim(x) > 0]
    assert sorted(moments) == sorted(adapter_shapes * 2)
    assert trainer.state.ref_params is None  # the reference is the base: no copy of it
    kls = []
    for seed in range(2):
        trainer.state, upd = trainer.programs.update(
            trainer.state, _update_batch(seed=seed), jax.random.key(seed)
        )
        kls.append(float(upd["kl"]))
        assert float(upd["grad_norm"]) > 0 and float(upd["skipped"]) == 0
    assert kls[0] == 0.0 < kls[1]  # fresh adapters are the reference; trained ones are not
    for a, b in zip(_leaves(trainer.state.base), base, strict=True):
        np.testing.assert_array_equal(a, b)  # frozen
    changed = [
        not np.array_equal(a, b) for a, b in zip(_leaves(trainer.state.params), fresh, strict=True)
    ]
    assert all(changed)
    trainer.run(progress=False)  # the trainer's own steps: one program each, the base named
    trainer.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sizes = {r["group_size"] for r in lines if "group_size" in r}
    assert trainer.programs.merge._cache_size() == 1 and trainer.sampler.num_traces == len(sizes)
    meta = json.loads((tmp_path / "run" / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["base"] == {"preset": "tiny", "seed": cfg.train.seed}


def _run(cfg_overrides, run_dir):
    trainer = Trainer(load_config(None, cfg_overrides), run_dir)
    trainer.run(progress=False)
    trainer.close()
    return trainer


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    common = [
        *TINY,
        *LORA,
        "train.checkpoint_every=2",
        "loss.kl_beta=0.05",
        "model.lora_dropout=0.1",  # its keys too continue as they would have
        "train.microbatches=2",
    ]
    straight = _run([*common, "train.steps=4"], tmp_path / "straight")
    _run([*common, "train.steps=2"], tmp_path / "resumed")
    second = Trainer(load_config(None, [*common, "train.steps=4"]), tmp_path / "resumed")
    assert second.step == 2
    second.run(progress=False)
    second.close()
    for tree in ("params", "opt_state"):
        got, want = getattr(second.state, tree), getattr(straight.state, tree)
        for a, b in zip(_leaves(got), _leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
    saved = [p.name for p in (tmp_path / "resumed" / "checkpoints" / "4").iterdir()]
    assert "params" in saved and "opt_state" in saved


@pytest.mark.slow
def test_a_changed_base_is_refused(tmp_path, capsys):
    init = tmp_path / "init"  # a full fine-tuning run: its weights are the base
    full = [*TINY, "logging.tensorboard=false", f"logging.run_dir={init}"]
    assert main(["train", *sets([*full, "train.steps=1"])]) == 0
    lora_run = [
        *TINY,
        *LORA,
        f"train.init_checkpoint={init}",
        f"logging.run_dir={tmp_path / 'lora'}",
    ]
    assert main(["train", *sets([*lora_run, "train.steps=1"])]) == 0
    assert main(["train", *sets([*full, "train.steps=2"])]) == 0  # the base moves on
    capsys.readouterr()
    assert main(["train", *sets([*lora_run, "train.steps=2"])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{init}: its weights changed" in err, err
    # a LoRA run's checkpoints hold adapters: one line, not a restore error
    from_lora = [*full[:-1], f"logging.run_dir={tmp_path / 'full'}"]
    assert main(["train", *sets([*from_lora, f"train.init_checkpoint={tmp_path / 'lora'}"])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a LoRA run (model.lora_rank = 4)" in err, err


def test_a_changed_hf_file_is_named(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"weights")
    cfg = load_config(None, [])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_checkpoint=str(hf)))
    saved = base_identity(cfg)
    check_same_base(saved, base_identity(cfg), 7)
    (hf / "model.safetensors").write_bytes(b"weights, changed")
    with pytest.raises(ConfigError) as err:
        check_same_base(saved, base_identity(cfg), 7)
    assert f"{hf / 'model.safetensors'}: changed since the checkpoint of step 7" in str(err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.lora_targets=[q_proj,qkv_proj]", "model.lora_targets = 'qkv_proj' is not allowed"),
        ("model.lora_rank=-1", "model.lora_rank = -1 is out of range"),
        ("model.lora_alpha=0", "model.lora_alpha = 0.0 is out of range"),
        ("model.lora_dropout=1.0", "model.lora_dropout = 1.0 is out of range"),
        ("model.lora_targets=[]", "model.lora_targets is empty"),
    ],
)
def test_bad_lora_keys_give_one_line_errors(tmp_path, capsys, override, message):
    run = [*TINY, "model.lora_rank=4", override, f"logging.run_dir={tmp_path / 'run'}"]
    assert main(["train", *sets(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_lora_keys_cannot_change_on_resume(tmp_path, capsys):
    run = [*TINY, *LORA, "train.steps=1", f"logging.run_dir={tmp_path / 'run'}"]
    assert main(["train", *sets(run)]) == 0
    capsys.readouterr()
    assert main(["train", *sets([*run, "model.lora_alpha=32"])]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "model.lora_alpha" in err and err.count("\n") == 1


# ---------------------------------------------------------------------- a mesh of 8 devices

MESH_RUN = [
    *TINY,
    *LORA,
    "train.prompts_per_step=4",
    "loss.kl_beta=0.05",
    "train.checkpoint_every=2",
]


def _train_on(devices: int, run_dir, extra=()):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["PYTHONPATH"] = PYTHONPATH
    overrides = [f"--set={o}" for o in [*MESH_RUN, *extra, f"logging.run_dir={run_dir}"]]
    cmd = [sys.executable, "-m", "sagc_jax", "train", "--set=train.steps=2", *overrides]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _saved_adapters(run_dir):
    import orbax.checkpoint as ocp

    path = Path(run_dir) / "checkpoints" / "2" / "params"
    checkpointer = ocp.StandardCheckpointer()
    meta = checkpointer.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
    return _leaves(checkpointer.restore(path, target))


def _lengths(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["lengths"] for r in map(json.loads, lines) if "lengths" in r]


@pytest.mark.heavy
def test_eight_devices_train_like_one(tmp_path):
    _train_on(1, tmp_path / "one")
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    out = _train_on(8, tmp_path / "eight", mesh)
    assert "data=2, fsdp=2, tensor=2 over 8 cpu devices" in out
    assert _lengths(tmp_path / "eight") == _lengths(tmp_path / "one")  # the same rollouts
    eight, one = _saved_adapters(tmp_path / "eight"), _saved_adapters(tmp_path / "one")
    for got, want in zip(eight, one, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_adapters_are_split_by_the_weights_rules():
    """On a mesh the adapters' dimensions shared with their weight are split like the weight's
    (the rank dimension stays whole)."""
    script = """
import json
import jax
from flax import nnx
from sagc_jax.config import MeshConfig
from sagc_jax.models import Decoder, get_preset
from sagc_jax.models.lora import LoRAParam
from sagc_jax.parallel import ShardingPlan
plan = ShardingPlan.from_config(MeshConfig(1, 2, 4))
cfg = get_preset("tiny", lora_rank=4)
model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
_, adapters, weights = nnx.split(model, LoRAParam, ...)
a, w = plan.params(adapters)["layers"][0], plan.params(weights)["layers"][0]
spec = lambda s: [list(x) if isinstance(x, tuple) else x for x in s.spec]
print(json.dumps({k: spec(v) for k, v in {
    "q_dnh": w["attn"]["q_dnh"], "q_a": a["attn"]["q_lora_a_dr"], "q_b": a["attn"]["q_lora_b_rnh"],
    "down_fd": w["mlp"]["down_fd"], "down_a": a["mlp"]["down_lora_a_fr"],
    "down_b": a["mlp"]["down_lora_b_rd"]}.items()}))
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    specs = json.loads(out.stdout.strip().splitlines()[-1])
    assert specs["q_a"] == [specs["q_dnh"][0], None]
    assert specs["q_b"] == [None, *specs["q_dnh"][1:]]
    assert specs["down_a"] == [specs["down_fd"][0], None]
    assert specs["down_b"] == [None, specs["down_fd"][1]]
    assert specs["q_dnh"] != [None, None, None]  # the mesh does split the weight


@pytest.mark.heavy
def test_lora_learns_the_demo_task(tmp_path):
    """From the CPU demo's supervised warm start, 10 steps of LoRA (rank 8, the demo's learning
    rate times 10, docs/lora.md) raise the held-out accuracy by at least 0.1 (64 prompts; the
    run gives 0.094 -> 0.31)."""
    demo = "configs/demo.yaml"
    sft = [f"logging.run_dir={tmp_path / 'sft'}", "logging.progress=false"]
    assert main(["sft", "--config", demo, *sets(sft)]) == 0
    run = [
        f"train.init_checkpoint={tmp_path / 'sft'}",
        "model.lora_rank=8",
        "train.learning_rate=1e-3",
        "train.steps=10",
        "train.eval_every=10",
        "train.eval_size=64",
        "logging.tensorboard=false",
        "logging.progress=false",
    ]
    trainer = Trainer(load_config(demo, run), tmp_path / "lora")
    trainer.run(progress=False)
    trainer.close()
    lines = [json.loads(x) for x in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval/accuracy"] for r in lines if "eval/accuracy" in r]
    assert len(accuracy) == 2 and accuracy[1] >= accuracy[0] + 0.1, accuracy
