"""The roofline step-time model (sim/roofline.py) and `sagc-jax plan --hardware`, by hand."""

import json
import re

import numpy as np
import pytest
from helpers import ROOT

from sagc_jax.cli import main
from sagc_jax.config import ConfigError, load_config
from sagc_jax.config.sim import HARDWARE_NAMES, SimConfig
from sagc_jax.models import get_preset
from sagc_jax.planning.timing import step_prediction, step_timer, timed_architecture
from sagc_jax.programs.policy import architecture
from sagc_jax.sim import StepTimer
from sagc_jax.sim.roofline import (
    HARDWARE,
    Efficiency,
    Hardware,
    ModelCosts,
    decode_step,
    model_costs,
    rollout_seconds,
    update_seconds,
)
from sagc_jax.sim.steptime import Engine

PAPER = ROOT / "configs" / "paper"
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
    # two slots: the straggler first holds one slot for 100 steps while the other runs ten 10s,
    # then the last five 10s share both (100, 100, 110, 110, 120): 130 steps
    first = rollout_seconds(
        COSTS, HW, [100] + [10] * 15, prompt_tokens=0, regime="continuous", slots=2, eff=EFF
    )
    assert first["decode_steps"] == 130
    # in arrival order the straggler starts last, at step 70, and ends at 170
    last = rollout_seconds(COSTS, HW, lengths, prompt_tokens=0, regime="continuous", slots=2)
    assert last["decode_steps"] == 170
    # lengths 3, 1, 2 on two slots: row 2 takes row 1's slot at step 1; contexts of the active
    # rows per step: 1 + 1, 2 + 1, 3 + 2 (prompt 4 adds 4 per active row: 2 rows every step)
    small = rollout_seconds(
        COSTS, HW, [3, 1, 2], prompt_tokens=4, regime="continuous", slots=2, eff=EFF
    )
    assert small["decode_steps"] == 3
    decode = sum((2e9 + 1e5 * (c + 8)) / 0.5e12 + 1e-4 for c in (2, 3, 5))
    assert small["seconds"] - small["prefill_seconds"] == pytest.approx(decode)
    with pytest.raises(ValueError, match="regime"):
        rollout_seconds(COSTS, HW, lengths, prompt_tokens=0, regime="async")


def compacting(lengths, prompts, **kwargs) -> dict:
    """``rollout_seconds`` of the compacting regime on the test chip."""
    return rollout_seconds(COSTS, HW, lengths, prompts, regime="compacting", eff=EFF, **kwargs)


def test_compacting_rollouts_by_hand():
    # lengths 1, 3 | 5, 9 (two prompts of two rollouts), prompts of 4 tokens, chunk 2, rungs
    # 4, 2, 1 (tests/sampling/test_schedule.py): rows 4, 4, 2, 2, 1, 1, 1, 1, running 3, 3, 2, 2,
    # 1, 1, 1, 1 of ages summing to 3, 6, 6, 8, 5, 6, 7, 8
    lengths = [[1, 3], [5, 9]]
    r = compacting(lengths, 4, max_new_tokens=9, chunk=2, row_buckets=3)
    assert (r["decode_steps"], r["rows_decoded"], r["live_rows_decoded"]) == (8, 16, 14)
    assert r["limit"] == "bandwidth"
    # contexts: rows / running x (4 x running + age sum); finished rows cost the running mean
    context = [4 / 3 * 15, 4 / 3 * 18, 14, 16, 9, 10, 11, 12]
    decode = sum((2e9 + 1e5 * c) / 0.5e12 + 1e-4 for c in context)  # compute is smaller
    assert r["seconds"] - r["prefill_seconds"] == pytest.approx(decode)
    # one prefill per prompt: two prompts of 4 tokens (contexts 1 + 2 + 3 + 4 each)
    assert r["prefill_seconds"] == pytest.approx((2e9 * 8 + 1e4 * 2 * 10) / 25e12)
    sync = rollout_seconds(COSTS, HW, lengths, 4, eff=EFF)  # four prefills
    assert sync["prefill_seconds"] == pytest.approx(2 * r["prefill_seconds"])
    with pytest.raises(ValueError, match="longer than max_new_tokens = 8"):
        compacting(lengths, 4, max_new_tokens=8)


@pytest.mark.parametrize("chunk", [0, 2, 5])
def test_compacting_with_one_rung_is_synchronous_less_its_last_step(chunk):
    """All rows in every iteration (row_buckets 1, slots 0), a prompt per row of one length:
    the same steps as synchronous but the last (synchronous decodes the longest row's last token
    too, which the schedule draws in its previous iteration), the same prefill."""
    lengths = np.random.default_rng(0).integers(1, 40, size=12)
    lengths[3] = 40
    sync = rollout_seconds(COSTS, HW, lengths, 6, devices=2, eff=EFF)
    comp = compacting(lengths, 6, devices=2, max_new_tokens=40, chunk=chunk, row_buckets=1)
    last, _ = decode_step(COSTS, HW, rows=12, context=12 * (6 + 40), devices=2, eff=EFF)
    assert comp["prefill_seconds"] == sync["prefill_seconds"]
    assert comp["decode_steps"] == sync["decode_steps"] - 1 == 39
    assert comp["seconds"] == pytest.approx(sync["seconds"] - last)


@pytest.mark.parametrize(("chunk", "buckets"), [(0, 4), (4, 2), (8, 4), (3, 6)])
def test_compacting_with_all_slots_is_never_slower_than_synchronous(chunk, buckets):
    """slots 0 and one prompt length: iteration k decodes rows_k <= B rows of contexts summing
    to rows_k (prompt + k) <= B (prompt + k), synchronous's step k; and it prefills once per
    prompt. (With fewer slots than rollouts it can be slower: test below.)"""
    lengths = np.random.default_rng(1).integers(1, 60, size=(4, 8))
    sync = rollout_seconds(COSTS, HW, lengths, 5, eff=EFF)
    comp = compacting(lengths, 5, max_new_tokens=64, chunk=chunk, row_buckets=buckets)
    last, _ = decode_step(COSTS, HW, rows=32, context=32 * (5 + lengths.max()), eff=EFF)
    sync_decode = sync["seconds"] - sync["prefill_seconds"]
    assert comp["seconds"] - comp["prefill_seconds"] <= sync_decode - last + 1e-12
    assert comp["prefill_seconds"] == pytest.approx(sync["prefill_seconds"] / 8)
    if buckets > 1 and chunk:
        assert comp["rows_decoded"] < 32 * comp["decode_steps"]  # finished rows left


def test_fewer_slots_than_rollouts_can_cost_more_than_synchronous():
    # 8 rollouts of 10 tokens through 4 slots: two waves of 9 iterations, each reading the
    # weights, against 10 synchronous steps of 8 rows (bandwidth-bound: the weights dominate)
    sync = rollout_seconds(COSTS, HW, [10] * 8, 5, eff=EFF)
    comp = compacting([10] * 8, 5, slots=4)
    assert comp["decode_steps"] == 18 and comp["rows_decoded"] == 72
    assert comp["seconds"] > sync["seconds"]


def test_compacting_prefills_each_prompt_once():
    # rows 0-2 share a prompt of 4 tokens, row 3 has its own of 9
    lengths, prompts = [3, 2, 5, 4], np.array([4, 4, 4, 9])
    r = compacting(lengths, prompts, group_sizes=[3, 1])
    assert r["prefill_seconds"] == pytest.approx((2e9 * 13 + 1e4 * (10 + 45)) / 25e12)
    flat = compacting(lengths, prompts)  # a flat batch without sizes: a prompt per row
    assert flat["prefill_seconds"] == pytest.approx((2e9 * 21 + 1e4 * (30 + 45)) / 25e12)
    with pytest.raises(ValueError, match="sum to the 4 rows"):
        compacting(lengths, 4, group_sizes=[2, 1])


def test_step_timer_replays_the_sampler_settings():
    engine = Engine(max_new_tokens=64, decode_chunk="auto", row_buckets=2, slots="auto")
    # 'auto' slots are modeled as all rows; a longer completion raises the cap
    assert engine.settings([10, 70]) == {
        "slots": 0,
        "max_new_tokens": 70,
        "chunk": 32,
        "row_buckets": 2,
    }
    sim = SimConfig(hardware="h100", devices=2)
    lengths = np.array([[10, 30], [20, 64]])
    t = StepTimer(sim, COSTS, "test model", engine=engine)(lengths, 4)
    comp = rollout_seconds(
        COSTS,
        HARDWARE["h100"],
        lengths,
        4,
        2,
        "compacting",
        eff=Efficiency.of(sim),
        max_new_tokens=64,
        chunk=32,
        row_buckets=2,
    )
    assert t.compacting == pytest.approx(comp["seconds"])
    assert t.compacting < t.synchronous
    cfg = load_config(None, ["sampling.row_buckets=2", "sampling.slots=8"])
    assert step_timer(cfg, 64, max_new_tokens=512).engine == Engine(512, "auto", 2, 8)
    assert step_timer(cfg, 64).engine.max_new_tokens == cfg.sampling.max_new_tokens


def test_update_is_timed_on_the_tokens_it_processes():
    # forward + backward = 3 x (2 x 1e9 x tokens + 1e4 x context) at 25 TFLOP/s, per epoch
    seconds = update_seconds(COSTS, HW, tokens=1000, context=500_500, epochs=2, eff=EFF)
    assert seconds == pytest.approx(2 * 3 * (2e9 * 1000 + 1e4 * 500_500) / 25e12)
    # a KL term's reference policy: one more forward of every token
    kl = update_seconds(COSTS, HW, tokens=1000, context=500_500, epochs=2, eff=EFF, reference=True)
    assert kl == pytest.approx(seconds * 4 / 3)
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
    assert "rollout, synchronous" in out and "bound" in out and "update:" in out
    assert "a share s of groups with signal costs about s x this" in out  # drop_no_signal
    # the sampler's own regime first, then the two others, each named
    regimes = re.findall(r"^  rollout, (\w+) \(", out, re.M)
    assert regimes == ["compacting", "synchronous", "continuous"]
    assert "h with this sampler (compacting)" in out
    assert "measured here before" not in out  # no run of ours on an H100 yet
    assert main(["plan", "--config", config, "--hardware", "h200", "--devices", "1"]) == 0
    assert "measured here before (2026-12-01, one H200" in capsys.readouterr().out
    assert main(["plan", "--config", config, "--hardware", "b300", "--devices", "8"]) == 2
    assert "--hardware 'b300' is not known" in capsys.readouterr().err


def test_the_sim_section_names_the_presets_and_the_default_factors():
    assert HARDWARE_NAMES == tuple(HARDWARE)
    assert Efficiency.of(SimConfig()) == Efficiency()
    with pytest.raises(
        ConfigError, match="sim.update_token_seconds applies to sim.hardware: custom"
    ):
        load_config(None, ["sim.update_token_seconds=1e-3"])
    assert load_config(None, ["sim.hardware=custom", "sim.update_token_seconds=1e-3"])


def test_step_timer_times_padded_and_packed_updates_on_their_tokens():
    sim = SimConfig(hardware="h100", devices=2, mfu=0.5)
    hw, lengths, prompts = HARDWARE["h100"], np.array([10, 30, 20]), np.array([4, 4, 6])
    packed = StepTimer(sim, COSTS, "test model")(lengths, prompts)
    width = prompts + lengths  # 14, 34, 26 real tokens
    flops = 3 * (2e9 * width.sum() + 1e4 * (width * (width + 1) / 2).sum())
    assert packed.update == pytest.approx(flops / (2 * hw.peak_flops * 0.5))
    padded = StepTimer(sim, COSTS, "test model", padded_width=50, epochs=2)(lengths, prompts)
    flops = 2 * 3 * (2e9 * 150 + 1e4 * 3 * 50 * 51 / 2)  # 3 rows of 50, two epochs
    assert padded.update == pytest.approx(flops / (2 * hw.peak_flops * 0.5))
    eff = Efficiency.of(sim)
    sync = rollout_seconds(COSTS, hw, lengths, prompts, 2, "synchronous", 512, eff)["seconds"]
    assert packed.synchronous == pytest.approx(sync)
    assert packed.continuous <= packed.synchronous  # finished rows leave the batch
    assert StepTimer(sim, COSTS, "test model").label == "test model on 2 x h100"


def test_the_update_is_timed_on_the_groups_with_signal_only():
    """train.drop_no_signal: a group whose rewards are all equal costs its rollouts only."""
    sim = SimConfig(hardware="h100")
    lengths, signal = np.array([[10, 30], [20, 64], [5, 7]]), np.array([True, False, True])
    every = StepTimer(sim, COSTS, "test model")
    only = StepTimer(sim, COSTS, "test model", signal_only=True)
    assert every(lengths, 4, signal_p=signal) == every(lengths, 4)  # every rollout trained
    step = only(lengths, 4, signal_p=signal)
    assert step.update == pytest.approx(every.update_of(lengths[signal], 4))
    assert step.update < every(lengths, 4).update
    assert step.compacting == every(lengths, 4).compacting  # the rollouts as before
    assert only(lengths, 4, signal_p=[False] * 3).update == 0.0  # the update is skipped
    assert only(lengths, 4).update == every(lengths, 4).update  # no signal known: every group
    assert step_timer(load_config(None, []), 64).signal_only
    assert not step_timer(load_config(None, ["loss.kl_beta=0.05"]), 64).signal_only
    assert not step_timer(load_config(None, ["train.drop_no_signal=false"]), 64).signal_only


def test_the_timed_model_is_a_preset_an_hf_config_or_the_run_s_own(tmp_path):
    arch, name = timed_architecture(load_config(None, ["sim.model=llama-3.2-3b"]))
    assert name == "llama-3.2-3b" and arch.compute_dtype == "bfloat16"
    assert timed_architecture(load_config(None, []))[1] == "tiny"  # the model section's preset
    # an HF checkpoint is named by its directory, not by its path on this machine
    checkpoint = tmp_path / "models" / "My-Model-1B"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_config()))
    for where in (checkpoint, checkpoint / "config.json"):
        assert timed_architecture(load_config(None, [f"sim.model={where}"]))[1] == "My-Model-1B"
    own = load_config(None, [f"model.hf_checkpoint={checkpoint}"])  # the run's own model
    assert timed_architecture(own)[1] == "My-Model-1B"
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="sim.model: .*config.json"):
        timed_architecture(load_config(None, [f"sim.model={tmp_path}"]))
    with pytest.raises(ConfigError, match="neither a model preset"):
        timed_architecture(load_config(None, ["sim.model=gpt-5"]))
    assert step_timer(load_config(None, ["sim.hardware=custom"]), 64).costs is None
