"""The roofline step-time model (sim/roofline.py) and `sagc-jax plan --hardware`, by hand."""

from pathlib import Path

import pytest

from sagc_jax.cli import main
from sagc_jax.config import load_config
from sagc_jax.sim.roofline import (
    Efficiency,
    Hardware,
    ModelCosts,
    decode_step,
    model_costs,
    rollout_seconds,
    update_seconds,
)
from sagc_jax.train.plan import architecture, step_prediction

PAPER = Path(__file__).parent.parent / "configs" / "paper"
HW = Hardware("test chip", peak_flops=100e12, hbm_bandwidth=1e12, memory_gib=16, source="-")
EFF = Efficiency(bandwidth=0.5, decode_flops=0.5, mfu=0.25, launch_seconds=1e-4)
COSTS = ModelCosts(
    params=10**9,
    matmul_params=10**9,
    weight_bytes=2 * 10**9,
    kv_bytes_per_token=10**5,
    attention_flops_per_context=10**4,
)


@pytest.mark.parametrize(
    ("name", "count"),
    [("qwen2.5-3b-grpo-tpu.yaml", 3_085_938_688), ("llama-3.2-3b-dapo-gpu80.yaml", 3_212_749_824)],
)
def test_model_costs_count_the_published_parameters(name, count):
    arch = architecture(load_config(PAPER / name))[0]
    costs = model_costs(arch)
    assert costs.params == count  # the same figure plan's eval_shape gives (test_plan)
    assert costs.weight_bytes == 2 * count  # bfloat16 compute weights
    assert costs.kv_bytes_per_token == 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2


def test_a_small_decode_step_is_bandwidth_bound():
    # 4 rows at 1,000 tokens of context each: weights 2e9 B + KV 4e3 x 1e5 B = 2.4e9 B at
    # 0.5 TB/s -> 4.8 ms; compute 2e9 x 4 + 1e4 x 4e3 = 8.04e9 FLOPs at 50 TFLOP/s -> 0.16 ms
    seconds, limit = decode_step(COSTS, HW, rows=4, context=4_000, eff=EFF)
    assert limit == "bandwidth"
    assert seconds == pytest.approx(2.4e9 / 0.5e12 + 1e-4)


def test_a_large_decode_step_is_compute_bound_and_devices_split_the_rows():
    # 8,192 rows at 100 tokens each: memory (2e9 + 8.192e7 B) / 0.5e12 = 4.16 ms; compute
    # (2e9 x 8192 + 1e4 x 819200) / 50e12 = 0.328 s
    seconds, limit = decode_step(COSTS, HW, rows=8192, context=819_200, eff=EFF)
    assert limit == "compute"
    assert seconds == pytest.approx((2e9 * 8192 + 1e4 * 819_200) / 50e12 + 1e-4)
    split, _ = decode_step(COSTS, HW, rows=8192, context=819_200, devices=4, eff=EFF)
    assert split == pytest.approx((seconds - 1e-4) / 4 + 1e-4)


def test_synchronous_rollouts_wait_for_the_longest_and_continuous_ones_for_the_total():
    lengths = [10] * 15 + [100]
    sync = rollout_seconds(COSTS, HW, lengths, prompt_tokens=0, eff=EFF)
    assert sync["decode_steps"] == 100 and sync["limit"] == "bandwidth"
    # every step reads the weights and the 16 rows' caches of 1..100 tokens
    by_hand = sum((2e9 + 1e5 * 16 * t) / 0.5e12 + 1e-4 for t in range(1, 101))  # compute is smaller
    assert sync["seconds"] == pytest.approx(by_hand)
    few_slots = rollout_seconds(
        COSTS, HW, lengths, prompt_tokens=0, regime="continuous", slots=2, eff=EFF
    )
    assert few_slots["decode_steps"] == 125  # 250 tokens over 2 slots beats the longest (100)
    with pytest.raises(ValueError, match="regime"):
        rollout_seconds(COSTS, HW, lengths, prompt_tokens=0, regime="async")


def test_update_is_timed_on_the_tokens_it_processes():
    # forward + backward = 3 x (2 x 1e9 x tokens + 1e4 x context) at 25 TFLOP/s, per epoch
    seconds = update_seconds(COSTS, HW, tokens=1000, context=500_500, epochs=2, eff=EFF)
    assert seconds == pytest.approx(2 * 3 * (2e9 * 1000 + 1e4 * 500_500) / 25e12)
    cfg = load_config(PAPER / "llama-3.2-3b-dapo-gpu80.yaml")
    packed = step_prediction(cfg, "h100", 8, mean_new_tokens=100)
    padded = step_prediction(
        load_config(PAPER / "llama-3.2-3b-dapo-gpu80.yaml", ["train.packing=false"]),
        "h100",
        8,
        mean_new_tokens=100,
    )
    rows, prompt, cap = packed["rows"], packed["prompt"], packed["cap"]
    assert packed["update_tokens"] == rows * (prompt + packed["generated"] // rows)
    assert padded["update_tokens"] == rows * (prompt + cap)
    assert padded["update_seconds"] > packed["update_seconds"]


def test_plan_predicts_a_step(capsys):
    config = str(PAPER / "llama-3.2-3b-dapo-gpu80.yaml")
    assert main(["plan", "--config", config, "--hardware", "h100", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "step on 8 x NVIDIA H100 SXM" in out and "fits in 80.0 GiB" in out
    assert "rollout, synchronous:" in out and "bound" in out and "update:" in out
    assert main(["plan", "--config", config, "--hardware", "b300", "--devices", "8"]) == 2
    assert "--hardware 'b300' is not known" in capsys.readouterr().err
