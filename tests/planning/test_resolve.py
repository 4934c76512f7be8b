"""A run resolved once (planning/resolve.py) and a memory plan that reads the builder
(planning/memory.py): every "auto" made concrete in one pass at start-up, the memory model built
once, and the state's bytes those of ``build_run``'s state, whatever its optimizer."""

import dataclasses
import json

import jax
import optax
import pytest
from helpers import TINY

import sagc_jax.planning.memory as memory
import sagc_jax.planning.resolve as resolve
import sagc_jax.train.loop as loop
from sagc_jax.config import load_config, to_dict
from sagc_jax.parallel import ShardingPlan
from sagc_jax.planning.memory import MemoryModel, device_bytes
from sagc_jax.programs.policy import architecture
from sagc_jax.programs.shapes import training_settings
from sagc_jax.train.loop import Trainer
from sagc_jax.train.safety.run_state import RunState

FAST = [*TINY, "logging.tensorboard=false", "train.async_checkpoint=false", "train.steps=1"]


def _counting(monkeypatch, module, name):
    """Count the calls of ``module.name`` (still calling it)."""
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_the_trainer_resolves_every_auto_once_and_keeps_one_config(tmp_path, monkeypatch):
    models = _counting(monkeypatch, memory.MemoryModel, "__init__")
    resolved = _counting(monkeypatch, loop, "resolve_run")
    controllers = _counting(monkeypatch, resolve, "controller_for_run")
    overrides = [*FAST, "sampling.prompt_buckets=auto", "sampling.slots=auto"]
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    try:
        assert (len(models), len(resolved), len(controllers)) == (1, 1, 1)
        assert trainer.programs.settings is trainer.shape.training.update  # derived once
        cfg = trainer.cfg
        assert cfg is trainer.shape.cfg  # one config after start-up
        assert isinstance(cfg.sampling.prompt_buckets, tuple)
        assert isinstance(cfg.sampling.slots, int) and cfg.sampling.slots == trainer.shape.slots
        assert trainer.controller is trainer.shape.controller
        assert trainer.sampler.slots == trainer.shape.slots
        trainer.run()
    finally:
        trainer.close()
    # the checkpoint holds the config as resolved: eval and a resume read concrete values
    meta = json.loads(next((tmp_path / "run" / "checkpoints").glob("1/meta/metadata")).read_text())
    saved = meta["config"]["sampling"]
    assert saved["prompt_buckets"] == list(cfg.sampling.prompt_buckets)
    assert saved["slots"] == cfg.sampling.slots


def test_a_checkpoint_saved_with_auto_buckets_resumes(tmp_path):
    """Runs saved their config as given before 2026-12-06: "auto" takes this run's buckets."""
    raw = load_config(None, [*FAST, "sampling.prompt_buckets=auto"])
    resolved = load_config(None, [*FAST, "sampling.prompt_buckets=[24,40]"])
    state = RunState(resolved, tmp_path, None, None, data_id={}, base_id=None, report=print)
    state.check_resumable({"config": to_dict(raw), "step": 1})  # no refusal
    other = to_dict(load_config(None, [*FAST, "sampling.prompt_buckets=[16]"]))
    with pytest.raises(Exception, match="sampling.prompt_buckets"):
        state.check_resumable({"config": other, "step": 1})


def test_plan_what_if_keeps_the_memory_and_names_the_refusal():
    cfg = load_config(None, [*TINY, "train.prompts_per_step=3"])  # 12 rollouts at G = 4
    plan = ShardingPlan.abstract(cfg.mesh, 8)
    with pytest.raises(Exception, match="batch shards"):
        resolve.resolve_run(cfg, plan)
    shape = resolve.resolve_run(cfg, plan, what_if=True)
    assert "batch shards" in shape.refused and shape.memory_plan.per_device > 0


@pytest.mark.parametrize("lora", [0, 4])
def test_the_plan_reads_the_state_build_run_makes(lora):
    """A new optimizer (here one more moment) or LoRA cannot make the plan lie: the state's
    rows are the bytes of ``build_run``'s abstract state on the run's mesh."""
    cfg = load_config(None, [*TINY, "mesh.fsdp=2", "loss.kl_beta=0.1", f"model.lora_rank={lora}"])
    plan = ShardingPlan.abstract(cfg.mesh, 2)

    def items(model):
        return {i.name: i for i in model.plan(0).items}

    training = training_settings(cfg)
    before = MemoryModel(cfg, plan, 4, architecture(cfg), training)
    moment = dataclasses.replace(training, tx=optax.chain(training.tx, optax.trace(0.9)))
    after = MemoryModel(cfg, plan, 4, architecture(cfg), moment)
    trained = after.state.params
    assert items(after)["optimizer state"].per_device == device_bytes(after.state.opt_state)
    grown = items(after)["optimizer state"].per_device - items(before)["optimizer state"].per_device
    assert grown == device_bytes(trained)  # the extra moment, sharded as its parameters
    assert items(after)["parameters"].per_device == device_bytes(after.decoded)
    assert ("LoRA adapters" in items(after)) == bool(lora)
    reference = items(after)["reference model"]
    assert reference.total == (0 if lora else memory.whole_bytes(after.state.ref_params))
    shards = {x.sharding.shard_shape(x.shape) != x.shape for x in jax.tree.leaves(trained)}
    assert True in shards  # fsdp = 2 splits the large matrices: per device is not whole
