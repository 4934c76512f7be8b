"""`sagc-jax plan`: per-device memory from shapes, on the paper's 3B configs."""

import math
from pathlib import Path

import jax.numpy as jnp
import pytest

from sagc_jax.cli import main
from sagc_jax.config import load_config
from sagc_jax.train.plan import memory_plan

PAPER = Path(__file__).parent.parent / "configs" / "paper"


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
    assert plan.per_device == sum(i.per_device for i in plan.items)


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


def test_plan_command_says_whether_it_fits(capsys):
    config = str(PAPER / "llama-3.2-3b-grpo-gpu80.yaml")
    assert main(["plan", "--config", config, "--device-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "3,212,749,824 x bfloat16" in out and "fits in 80.0 GiB" in out
    assert main(["plan", "--config", config, "--device-memory", "40"]) == 0
    assert "does NOT fit in 40.0 GiB" in capsys.readouterr().out
    assert main(["plan", "--config", "configs/demo.yaml"]) == 0  # this machine: a CPU verdict too
    assert " GiB per device (" in capsys.readouterr().out
    assert main(["plan", "--config", config, "--devices", "3", "--set", "mesh.fsdp=2"]) == 2
    assert "needs 2 devices but 3 are available" in capsys.readouterr().err
