"""`sagc-jax plan`: per-device memory from shapes, on the paper's 3B configs."""

import math

import jax.numpy as jnp
import pytest
from helpers import ROOT

from sagc_jax.cli import main
from sagc_jax.config import ConfigError, load_config
from sagc_jax.parallel import ShardingPlan
from sagc_jax.planning.memory import lora_comparison, memory_plan
from sagc_jax.planning.resolve import resolve_run

PAPER = ROOT / "configs" / "paper"


def _items(plan):
    return {item.name: item for item in plan.items}


@pytest.mark.parametrize(
    ("name", "devices", "count"),
    [
        ("qwen2.5-3b-grpo-tpu.yaml", 16, 3_085_938_688),
        ("llama-3.2-3b-dapo-gpu80.yaml", 1, 3_212_749_824),
    ],
)
def test_plan_figures_add_up(name, devices, count):
    cfg = load_config(PAPER / name)
    plan = memory_plan(cfg, devices)
    items = _items(plan)
    size = jnp.dtype(cfg.model.param_dtype).itemsize
    assert plan.num_params == count  # the published sizes of the two models
    assert items["parameters"].total == count * size
    # FSDP over 16 devices: every large matrix splits, so a device holds 1/16 of the bytes
    assert items["parameters"].per_device == pytest.approx(count * size / devices, rel=1e-3)
    moments = 2 * 4 * count + (4 * count if cfg.model.param_dtype == "bfloat16" else 0)
    assert items["optimizer state"].total == pytest.approx(moments, abs=1024)
    assert ("reference model" in items) == (cfg.loss.kl_beta > 0)
    # the samplers' caches and the update's gradients and activations are never held at once
    state = sum(i.per_device for i in plan.items if i.stage == "state")
    sampling, update = plan.during("sampling"), plan.during("update")
    assert sampling + update - state == sum(i.per_device for i in plan.items)
    assert plan.per_device == max(sampling, update) and min(sampling, update) > state


@pytest.mark.slow
def test_plan_levers_shrink_memory():
    base = ["model.preset=qwen2.5-0.5b", "sampling.prompt_buckets=[256]"]
    base += ["sampling.max_new_tokens=512", "train.prompts_per_step=8", "train.microbatches=4"]
    full = _items(memory_plan(load_config(None, [*base, "model.remat=full"]), 1))
    none = _items(memory_plan(load_config(None, [*base, "model.remat=none"]), 1))
    assert full["activations"].per_device < none["activations"].per_device / 3
    one = _items(memory_plan(load_config(None, base), 1))
    eight = _items(memory_plan(load_config(None, base), 8))  # mesh.fsdp = -1: all 8
    for name in ("parameters", "optimizer state", "KV cache"):
        assert eight[name].per_device < one[name].per_device / 7, name
    bf16 = _items(memory_plan(load_config(None, [*base, "model.param_dtype=bfloat16"]), 1))
    assert bf16["parameters"].per_device * 2 == one["parameters"].per_device
    assert math.isclose(
        bf16["optimizer state"].total, 1.5 * one["optimizer state"].total, rel_tol=1e-6
    )


@pytest.mark.slow
def test_slots_bound_the_kv_cache_and_auto_fills_the_memory():
    base = ["model.preset=qwen2.5-0.5b", "sampling.prompt_buckets=[256]", "mesh.fsdp=4"]
    base += ["sampling.max_new_tokens=2048", "train.prompts_per_step=64"]  # G = 16: 1,024 rows
    every = memory_plan(load_config(None, base), 4)
    quarter = memory_plan(load_config(None, [*base, "sampling.slots=256"]), 4)
    kv_every, kv_quarter = _items(every)["KV cache"], _items(quarter)["KV cache"]
    assert kv_quarter.per_device * 4 == pytest.approx(kv_every.per_device, abs=4)
    assert "256 of 1024" in kv_quarter.detail
    # one prefill per prompt: 64 prompts' caches, whole on every device
    prompt = _items(every)["prompt cache"]
    assert prompt.per_device == prompt.total == 2 * 24 * 64 * 2 * 64 * 256 * 4
    # auto: the most rows whose cache fits 90% of the device beside the rest, in whole shards
    rest = every.during("sampling") - kv_every.per_device
    budget = int(rest / 0.9 + 0.5 * kv_every.per_device / 0.9)  # room for about half the rows
    cfg = load_config(None, [*base, "sampling.slots=auto"])
    plan = ShardingPlan.abstract(cfg.mesh, 4)
    fitted = resolve_run(cfg, plan, device_bytes=budget)
    slots = fitted.slots
    assert slots % 4 == 0 and 480 <= slots <= 512
    assert fitted.cfg.sampling.slots == slots  # the run's one config holds the resolved value
    held = fitted.memory_plan.during("sampling")
    # within two rows per device of the budget (an even count: half the slots is the tail rung)
    assert held <= 0.9 * budget < held + 2 * kv_every.per_device / 256
    assert fitted.memory.auto_slots(2 * every.per_device) == 1024  # never more than the rollouts
    with pytest.raises(ConfigError, match="sampling.slots = auto: not one row"):
        fitted.memory.auto_slots(int(rest))


def test_plan_command_says_whether_it_fits(capsys):
    config = str(PAPER / "llama-3.2-3b-grpo-gpu80.yaml")
    assert main(["plan", "--config", config, "--device-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "3,212,749,824 x bfloat16" in out and "fits in 80.0 GiB" in out
    assert main(["plan", "--config", config, "--device-memory", "40"]) == 0
    assert "does NOT fit in 40.0 GiB" in capsys.readouterr().out
    assert main(["plan", "--config", "configs/demo.yaml"]) == 0  # this machine: a CPU verdict too
    out = capsys.readouterr().out
    assert " GiB per device (" in out
    assert "on CPU the devices' memory is this process's own" in out  # what plan leaves out
    assert main(["plan", "--config", config, "--devices", "3", "--set", "mesh.fsdp=2"]) == 2
    assert "needs 2 devices but 3 are available" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_with_lora_trains_only_the_adapters():
    cfg = load_config(PAPER / "qwen2.5-3b-grpo-gpu80.yaml")  # bfloat16, kl_beta > 0
    full_plan, lora_plan = lora_comparison(cfg, 1, 16)
    full, lora = _items(full_plan), _items(lora_plan)
    # rank 16 on all seven projections of 36 layers (D 2048, N*H 2048, K*H 256, F 11008):
    # 16 x (2 x (2048 + 2048) + 2 x (2048 + 256) + 3 x (2048 + 11008)) per layer
    count = 36 * 16 * (2 * 4096 + 2 * 2304 + 3 * 13056)
    assert lora["LoRA adapters"].total == 4 * count  # float32
    assert lora["parameters"].total == full["parameters"].total  # the base, frozen
    # Adam's two float32 moments of the adapters only: no float32 master copy of the base
    assert lora["optimizer state"].total == pytest.approx(2 * 4 * count, abs=1024)
    assert full["optimizer state"].total == pytest.approx(12 * full_plan.num_params, abs=1024)
    assert lora["gradients"].total == 2 * 4 * count  # x2: microbatches accumulate
    assert lora["reference model"].total == 0  # the base with the adapters off
    assert full["reference model"].total == full["parameters"].total
    assert lora["merged weights"].total == full["parameters"].total  # what the samplers decode
    assert "merged weights" not in full and lora["KV cache"] == full["KV cache"]


@pytest.mark.slow
def test_plan_lora_compare_prints_what_fits(capsys):
    config = str(PAPER / "qwen2.5-3b-grpo-gpu80.yaml")
    assert main(["plan", "--config", config, "--devices", "1", "--lora-compare", "16"]) == 0
    out = capsys.readouterr().out
    assert "LoRA: rank 16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in out
    rows = {line[:28].strip(): " ".join(line[28:].split()) for line in out.splitlines()}
    assert rows["optimizer state"] == "34.49 0.22"
    # full fine-tuning's total is its update: 129% before the log-probs were chunked (the whole
    # [1536, 151936] float32 logits were a residual), 126% with loss.logprob_chunk's default
    # and the backward's temporaries and the chunk's logits counted
    assert rows["one 48 GB GPU (48 GiB)"] == "no (126%) fits (46%)"  # the prompt cache counted
    assert rows["one 80 GB GPU (80 GiB)"] == "fits (75%) fits (28%)"  # 77% before, as above
    assert main(["plan", "--config", config, "--lora-compare", "0"]) == 2
    assert "--lora-compare 0: the rank must be >= 1" in capsys.readouterr().err
