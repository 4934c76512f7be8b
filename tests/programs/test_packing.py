"""Packed update: the host packer, segment-causal attention, and packed == padded for the loss,
gradients and parameters (GRPO / DAPO / Dr. GRPO, KL, micro-batches, a mesh), one program per
rung; and an update without the rollouts of no signal == one with them.
``python tests/programs/test_packing.py mesh`` is the 8-simulated-device part (run in a
subprocess).
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import PYTHONPATH

from sagc_jax.models import Decoder, get_preset
from sagc_jax.models.layers import _attend_dot_product, _attend_splash, attend, resolve_attention
from sagc_jax.models.lora import LoRAParam
from sagc_jax.programs.packing import (
    PACKED_KEYS,
    pack_update_batch,
    packed_rows_needed,
    padded_update_batch,
    resolve_pack_len,
    row_ladder,
    row_multiple,
    rung_for,
)
from sagc_jax.programs.state import PolicyState
from sagc_jax.programs.update import (
    PACKED,
    PADDED,
    PolicyPrograms,
    StateShardings,
    UpdateSettings,
    chunk_loss,
    completion_logprobs,
    packed_logprobs,
)
from sagc_jax.rl import completion_mask, loss_normalizer
from sagc_jax.rl.losses import AGGREGATIONS, Aggregation

P, L = 8, 8  # prompt bucket, max new tokens
ALGOS = {"grpo": "seq_mean", "dapo": "token_mean", "dr_grpo": "constant"}


def rollouts(n: int, seed: int = 0, drop: bool = True) -> dict:
    """A padded update batch of ``n`` rollouts (some fully masked when ``drop``)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, P + 1, n)
    ids = np.zeros((n, P), np.int32)
    for b, k in enumerate(lens):
        ids[b, P - k :] = rng.integers(3, 64, k)
    lengths = rng.integers(1, L + 1, n)
    truncated = (rng.random(n) < 0.2) if drop else None
    return {
        "prompt_ids": ids,
        "prompt_lens": lens.astype(np.int32),
        "completion": rng.integers(3, 64, (n, L)).astype(np.int32),
        "old_logp": rng.normal(-4.0, 0.3, (n, L)).astype(np.float32),
        "mask": completion_mask(lengths, L, truncated),
        "adv": rng.normal(size=n).astype(np.float32),
    }


def _inputs(b: dict) -> tuple:
    keys = ("prompt_ids", "prompt_lens", "completion", "old_logp", "adv", "mask")
    return tuple(b[k] for k in keys)


def pack(b: dict, aggregation: str, rows: int, pack_len: int = P + L, trained=None) -> dict:
    return pack_update_batch(
        *_inputs(b),
        aggregation=aggregation,
        max_new_tokens=L,
        pack_len=pack_len,
        rows=rows,
        trained_b=trained,
    )


def padded(b: dict, aggregation: str, rows: int | None = None, trained=None) -> dict:
    """``b`` as the padded update batch (``PADDED_KEYS``): the trained rollouts in ``rows``."""
    rows = len(b["adv"]) if rows is None else rows
    return padded_update_batch(
        *_inputs(b), aggregation=aggregation, max_new_tokens=L, rows=rows, trained_b=trained
    )


def settings(aggregation: str, kl_beta: float = 0.0, micro: int = 1) -> UpdateSettings:
    return UpdateSettings(
        aggregation=aggregation,
        eps_low=0.2,
        eps_high=0.28,
        kl_beta=kl_beta,
        temperature=0.9,
        microbatches=micro,
    )


# One layer (a leak across segments already shows there) and small widths: fast to compile.
TINY = get_preset(
    "tiny",
    vocab_size=64,
    num_layers=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@functools.partial(jax.jit, static_argnums=0)
def _init_params(seed: int):
    return nnx.split(Decoder(TINY, rngs=nnx.Rngs(seed)))[1]


def tiny_policy(seed: int = 0):
    """(graphdef, params), initialised in one program (eager init compiles once per shape)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(TINY, rngs=nnx.Rngs(seed))))
    return graphdef, _init_params(seed)


# ---------------------------------------------------------------------- the packer


def test_every_token_placed_once_with_its_segment_and_positions():
    b = rollouts(13, seed=1)
    out = pack(b, "seq_mean", rows=13, pack_len=20)
    assert set(out) == set(PACKED_KEYS)
    live = np.flatnonzero(b["mask"].sum(1) > 0)
    found = []
    for r in range(13):
        seg_t = out["segment_ids"][r]
        ids = [s for s in dict.fromkeys(seg_t.tolist()) if s]
        assert ids == list(range(1, len(ids) + 1))  # 1..n along the row, contiguous
        for s in ids:
            cols = np.flatnonzero(seg_t == s)
            assert np.all(np.diff(cols) == 1)
            np.testing.assert_array_equal(out["positions"][r, cols], np.arange(len(cols)))
            found.append((r, cols))
        assert np.all(out["tokens"][r, seg_t == 0] == 0)
    assert len(found) == len(live)
    # each live rollout is exactly one segment: prompt (no padding), completion to its length
    seqs = {tuple(out["tokens"][r, c]) for r, c in found}
    for i in live:
        n = int(b["mask"][i].sum())
        want = np.concatenate(
            [b["prompt_ids"][i, P - b["prompt_lens"][i] :], b["completion"][i, :n]]
        )
        assert tuple(want) in seqs
    assert out["mask"].sum() == b["mask"].sum()
    # completion token j scored at the token before it; seq_mean weights sum to 1 per rollout
    np.testing.assert_allclose(out["weight"].sum(), len(live), rtol=1e-6)
    assert out["norm"].sum() == len(live)
    np.testing.assert_allclose(
        np.sort(out["old_logp"][out["mask"] > 0]), np.sort(b["old_logp"][b["mask"] > 0])
    )


def test_packing_is_deterministic_and_normalisers_match():
    b = rollouts(16, seed=2)
    for agg in ALGOS.values():
        one, two = pack(b, agg, rows=16), pack(b, agg, rows=16)
        for k in PACKED_KEYS:
            np.testing.assert_array_equal(one[k], two[k])
    live = int((b["mask"].sum(1) > 0).sum())
    assert pack(b, "token_mean", 16)["norm"].sum() == b["mask"].sum()
    assert pack(b, "constant", 16)["norm"].sum() == 16 * L  # dropped rollouts still count
    assert pack(b, "seq_mean", 16)["norm"].sum() == live


def test_ladder_rungs_and_rows_needed():
    ladder = row_ladder(4, 64)
    assert ladder[0] == 4 and ladder[-1] == 64 and all(r % 4 == 0 for r in ladder)
    assert row_ladder(4, 128)[: len(ladder) - 1] == ladder[:-1]  # lower rungs shared by every G
    assert row_ladder(4, 30)[-1] == 32
    assert row_multiple(1, 2, 8, processes=2) == 8
    assert row_multiple(2, 1, 2) == 4
    b = rollouts(32, seed=3, drop=False)
    rows = packed_rows_needed(b["prompt_lens"], b["mask"], pack_len=P + L, multiple=4, max_rows=32)
    assert rows in row_ladder(4, 32) and rows < 32
    pack(b, "token_mean", rows)  # fits
    smaller = [r for r in row_ladder(4, 32) if r < rows]
    if smaller:
        with pytest.raises(ValueError, match="packed rows"):
            pack(b, "token_mean", smaller[-1])
    # one long rollout per row: the top rung is the padded row count
    full = {**b, "prompt_lens": np.full(32, P, np.int32), "mask": np.ones((32, L), np.float32)}
    assert (
        packed_rows_needed(
            full["prompt_lens"], full["mask"], pack_len=P + L, multiple=4, max_rows=32
        )
        == 32
    )
    with pytest.raises(ValueError, match="pack_len"):
        resolve_pack_len(10, (8,), L)
    assert resolve_pack_len(0, (4, 8), L) == P + L


# ---------------------------------------------------------------------- the model


@pytest.mark.slow
def test_segment_attention_paths_agree():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 2, 8, 16)), jnp.float32)  # [B, K, H, S]
    v = jnp.asarray(rng.normal(size=(2, 2, 16, 8)), jnp.float32)  # [B, K, S, H]
    seg = jnp.asarray([[1] * 5 + [2] * 9 + [0] * 2, [1] * 16], jnp.int32)
    einsum = attend(q, k, v, segment_ids_bt=seg)
    # the cuDNN path's arguments, run by XLA's reference implementation on CPU
    np.testing.assert_allclose(_attend_dot_product(q, k, v, seg, "xla"), einsum, atol=1e-5)
    # segment 2 sees nothing of segment 1: equal to attending over it alone
    alone = attend(q[:1, 5:14], k[:1, :, :, 5:14], v[:1, :, 5:14], segment_ids_bt=seg[:1, 5:14])
    np.testing.assert_allclose(einsum[:1, 5:14], alone, atol=1e-5)
    assert resolve_attention("auto", jnp.float32, 128, "cpu") == "einsum"
    assert resolve_attention("auto", jnp.bfloat16, 100, "gpu") == "cudnn"
    assert resolve_attention("auto", jnp.float32, 100, "gpu") == "einsum"
    assert resolve_attention("auto", jnp.float32, 256, "tpu") == "splash"
    assert resolve_attention("auto", jnp.float32, 100, "tpu") == "einsum"
    with pytest.raises(ValueError, match="multiple of 128"):
        attend(q, k, v, segment_ids_bt=seg, implementation="splash")


@pytest.mark.slow
def test_splash_kernel_in_interpret_mode_equals_einsum():
    """The TPU path, run by the Pallas interpreter on CPU (128 tokens: one splash tile)."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 128, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 2, 8, 128)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 2, 128, 8)), jnp.float32)
    seg = jnp.asarray([[1] * 50 + [2] * 70 + [0] * 8], jnp.int32)
    np.testing.assert_allclose(
        _attend_splash(q, k, v, seg, interpret=True), attend(q, k, v, segment_ids_bt=seg), atol=1e-5
    )


@pytest.mark.slow
def test_packed_logprobs_equal_padded_completion_logprobs():
    graphdef, params = tiny_policy()
    b = rollouts(8, seed=4, drop=False)
    out = pack(b, "token_mean", rows=8)

    @jax.jit
    def both(params, b, out):
        model = nnx.merge(graphdef, params)
        padded = completion_logprobs(model, b["prompt_ids"], b["prompt_lens"], b["completion"], 0.9)
        packed = packed_logprobs(model, out["tokens"], out["positions"], out["segment_ids"], 0.9)
        return padded, packed

    padded, logp = both(params, b, out)
    live = out["mask"] > 0
    # same values, rollout by rollout: compare through the old_logp field as a tag
    tag = {float(x): i for i, x in enumerate(b["old_logp"].ravel())}
    order = [tag[float(x)] for x in out["old_logp"][live]]
    np.testing.assert_allclose(np.asarray(logp)[live], np.asarray(padded).ravel()[order], atol=1e-5)


# ---------------------------------------------------------------------- packed == padded


@pytest.mark.slow
def test_loss_and_gradients_equal_padded_for_every_aggregation():
    """grpo / dapo / dr_grpo (with KL): the padded loss of the whole batch against the packed
    loss summed over two micro-batches of packed rows (rows c, c + 2, ...)."""
    _padded_equals_packed(list(ALGOS.values()))


def test_a_new_aggregation_is_one_entry(monkeypatch):
    """The recipe of docs/architecture.md ("Add a loss aggregation"): an entry in
    ``rl.AGGREGATIONS`` alone, here a sum over each sequence's tokens over the sequences with
    one, and the padded loss, the packed rows and the normaliser all follow it."""
    toy = Aggregation(per_sequence=False, share=lambda tokens_b, _: (tokens_b > 0) * 1.0)
    monkeypatch.setitem(AGGREGATIONS, "seq_sum", toy)
    b = rollouts(8, seed=5)
    assert float(loss_normalizer(b["mask"], "seq_sum")) == float((b["mask"].sum(1) > 0).sum())
    _padded_equals_packed(["seq_sum"])


def _padded_equals_packed(aggregations: list[str]) -> None:
    graphdef, params = tiny_policy()
    b = rollouts(8, seed=5)
    ref = jax.tree.map(lambda x: x + 0.01, params)
    rows = packed_rows_needed(b["prompt_lens"], b["mask"], pack_len=P + L, multiple=2, max_rows=8)
    packed = {agg: pack(b, agg, rows) for agg in aggregations}

    @jax.jit
    def both(params, ref, b, packed):
        """Losses and gradients ({agg: ...} each): padded, then packed."""
        pad_l, pad_g, pack_l, pack_g = {}, {}, {}, {}
        for agg in aggregations:
            s = settings(agg, kl_beta=0.05 if agg == "constant" else 0.0)
            norm = loss_normalizer(b["mask"], agg, L)
            norm_packed = jnp.maximum(jnp.sum(packed[agg]["norm"]), 1.0)

            def padded_loss(p, s=s, norm=norm):
                return chunk_loss(PADDED, graphdef, p, ref, b, norm, s)

            def packed_loss(p, s=s, norm=norm_packed, batch=packed[agg]):
                losses = [
                    chunk_loss(
                        PACKED,
                        graphdef,
                        p,
                        ref,
                        jax.tree.map(lambda x, c=c: x[c::2], batch),
                        norm,
                        s,
                    )[0]
                    for c in range(2)
                ]
                return losses[0] + losses[1], None

            (pad_l[agg], _), pad_g[agg] = jax.value_and_grad(padded_loss, has_aux=True)(params)
            (pack_l[agg], _), pack_g[agg] = jax.value_and_grad(packed_loss, has_aux=True)(params)
        return pad_l, pad_g, pack_l, pack_g

    pad_l, pad_g, pack_l, pack_g = both(params, ref, b, packed)
    chex.assert_trees_all_close(pack_l, pad_l, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(pack_g, pad_g, rtol=1e-7, atol=1e-5)


@pytest.mark.slow
def test_update_equals_padded_with_kl_and_microbatches():
    """One update of two micro-batches (GRPO, KL): metrics and parameters, packed vs padded."""
    graphdef, params = tiny_policy()
    b = rollouts(8, seed=6)
    rows = packed_rows_needed(b["prompt_lens"], b["mask"], pack_len=P + L, multiple=2, max_rows=8)
    packed = pack(b, "seq_mean", rows)
    s = settings("seq_mean", kl_beta=0.05, micro=2)
    ref = jax.tree.map(lambda x: x + 0.01, params)
    # plain SGD at rate 1: the parameter change is the (accumulated) gradient itself
    tx = optax.sgd(1.0)
    programs = PolicyPrograms(graphdef, tx)
    key = jax.random.key(0)
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (the update donates its inputs)
    b = padded(b, "seq_mean")
    p1, _, u1 = programs.update(PolicyState(copy(params), tx.init(params), ref), b, key, s)
    p2, _, u2 = programs.update(PolicyState(copy(params), tx.init(params), ref), packed, key, s)
    assert set(u1) == set(u2) >= {"loss", "grad_norm", "kl", "clip_fraction", "ratio_mean"}
    # loss, gradient norm and the per-token metrics; then the parameters
    chex.assert_trees_all_close(u2, u1, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(p2, p1, rtol=1e-7, atol=1e-5)


@pytest.mark.slow
def test_one_update_program_per_rung():
    graphdef, params = tiny_policy()
    tx = optax.sgd(0.1)
    programs = PolicyPrograms(graphdef, tx)
    s = settings("token_mean")
    opt_state = tx.init(params)
    rungs = []
    for i, (prompts, g) in enumerate([(2, 2), (2, 8), (1, 4), (2, 4), (1, 8), (2, 2)]):
        b = rollouts(prompts * g, seed=10 + i)
        rows = packed_rows_needed(
            b["prompt_lens"], b["mask"], pack_len=P + L, multiple=2, max_rows=prompts * g
        )
        rungs.append(rows)
        batch = pack(b, "token_mean", rows)
        state = PolicyState(params, opt_state)
        params, opt_state, _ = programs.update(state, batch, jax.random.key(i), s)
    assert programs.compiled_programs()["update"] == len(set(rungs)) < 6


# ---------------------------------------------------------------------- rollouts without signal


def without_signal(n: int, seed: int) -> tuple[dict, np.ndarray]:
    """(rollouts, trained bool [n]): groups of 4 rollouts, every other group's advantages 0
    (rewards all equal), as ``UpdateBatcher.trained`` leaves them out."""
    b = rollouts(n, seed=seed)
    zero = (np.arange(n) // 4) % 2 == 0
    b["adv"] = np.where(zero, 0.0, b["adv"]).astype(np.float32)
    return b, ~zero


def test_left_out_rollouts_take_no_row_but_count_in_the_normaliser():
    b, trained = without_signal(16, seed=8)
    for agg in ALGOS.values():
        full = loss_normalizer(b["mask"], agg, L)
        rows = packed_rows_needed(
            b["prompt_lens"], b["mask"], pack_len=P + L, multiple=1, max_rows=16, trained_b=trained
        )
        every = packed_rows_needed(
            b["prompt_lens"], b["mask"], pack_len=P + L, multiple=1, max_rows=16
        )
        assert rows < every  # the rung shrinks with the rollouts
        packed = pack(b, agg, rows, trained=trained)
        pad = padded(b, agg, rows=int(trained.sum()), trained=trained)
        for out in (packed, pad):
            np.testing.assert_allclose(out["norm"].sum(), full, rtol=1e-6)
            assert out["mask"].sum() == b["mask"][trained].sum()  # only trained tokens scored
        assert np.all(packed["adv"][packed["mask"] > 0] != 0)
        assert np.all(pad["adv"][pad["mask"].sum(1) > 0] != 0)
        np.testing.assert_array_equal(pad["completion"], b["completion"][trained])
        with pytest.raises(ValueError, match="rows = 3"):
            padded(b, agg, rows=3, trained=trained)


@pytest.mark.slow
def test_an_update_without_the_rollouts_of_no_signal_equals_the_full_one():
    """GRPO / DAPO / Dr. GRPO, two micro-batches: one update on every rollout (padded) against
    one on the trained rollouts only, padded and packed: the same loss, gradient norm and
    parameters (plain SGD at rate 1: the change is the gradient itself)."""
    graphdef, params = tiny_policy()
    b, trained = without_signal(16, seed=9)
    tx = optax.sgd(1.0)
    programs = PolicyPrograms(graphdef, tx)
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (the update donates its inputs)
    kept = int(trained.sum())
    for agg in ALGOS.values():
        s = settings(agg, micro=2)
        rows = packed_rows_needed(
            b["prompt_lens"], b["mask"], pack_len=P + L, multiple=2, max_rows=16, trained_b=trained
        )
        batches = {
            "full": padded(b, agg),
            "padded": padded(b, agg, rows=kept, trained=trained),
            "packed": pack(b, agg, rows, trained=trained),
        }
        out = {}
        for name, batch in batches.items():
            state = PolicyState(copy(params), tx.init(params))
            new, _, metrics = programs.update(state, batch, jax.random.key(0), s)
            out[name] = (new, {k: metrics[k] for k in ("loss", "grad_norm")})
        assert float(out["full"][1]["grad_norm"]) > 0
        for name in ("padded", "packed"):
            chex.assert_trees_all_close(out[name][1], out["full"][1], rtol=1e-5, atol=1e-7)
            chex.assert_trees_all_close(out[name][0], out["full"][0], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_lora_dropout_draws_by_rollout_not_by_row():
    """LoRA dropout keys each token's masks by its rollout and its position in it, not by the
    row, column or micro-batch it lands in: an update on every rollout (one or two micro-batches)
    and one on the trained rollouts only, padded or packed, give the same loss, gradient and
    adapters (plain SGD at rate 1: the change is the gradient itself)."""
    cfg = TINY.replace(lora_rank=4, lora_dropout=0.5)
    graphdef, adapters, base = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), LoRAParam, ...)
    # B non-zero, so the dropped inputs reach the loss, not only B's gradient
    adapters = jax.tree.map(lambda x: 0.1 * jax.random.normal(jax.random.key(1), x.shape), adapters)
    b, trained = without_signal(16, seed=9)
    tx = optax.sgd(1.0)
    programs = PolicyPrograms(graphdef, tx)
    rows = packed_rows_needed(
        b["prompt_lens"], b["mask"], pack_len=P + L, multiple=2, max_rows=16, trained_b=trained
    )
    runs = {
        "full": (padded(b, "seq_mean"), 1, 0.5),
        "full, two micro-batches": (padded(b, "seq_mean"), 2, 0.5),
        "padded": (padded(b, "seq_mean", rows=int(trained.sum()), trained=trained), 2, 0.5),
        "packed": (pack(b, "seq_mean", rows, trained=trained), 2, 0.5),
        "no dropout": (padded(b, "seq_mean"), 1, 0.0),
    }
    out = {}
    for name, (batch, micro, rate) in runs.items():
        s = dataclasses.replace(settings("seq_mean", micro=micro), lora_dropout=rate)
        state = PolicyState(jax.tree.map(jnp.copy, adapters), tx.init(adapters), base=base)
        new, _, metrics = programs.update(state, batch, jax.random.key(0), s)
        out[name] = (new, {k: metrics[k] for k in ("loss", "grad_norm")})
    full_grad_norm = float(out["full"][1]["grad_norm"])
    assert abs(float(out["no dropout"][1]["grad_norm"]) - full_grad_norm) > 1e-2 * full_grad_norm
    for name in ("full, two micro-batches", "padded", "packed"):
        chex.assert_trees_all_close(out[name][1], out["full"][1], rtol=1e-5, atol=1e-7)
        chex.assert_trees_all_close(out[name][0], out["full"][0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: {**b, "adv": b["adv"][:, None] * b["mask"]}, "adv"),  # per token: [N, L]
        (lambda b: {**b, "mask": b["mask"].astype(np.int32)}, "int32"),
        (lambda b: {**b, "old_logp": b["old_logp"][:, :-1]}, "old_logp"),
    ],
    ids=["advantage per token", "integer mask", "ragged log-probs"],
)
def test_an_update_batch_off_its_spec_is_refused(change, message):
    """The update checks its batch against ``batch_spec`` when traced."""
    graphdef, params = tiny_policy()
    tx = optax.sgd(0.1)
    programs = PolicyPrograms(graphdef, tx)
    batch = change(padded(rollouts(4, seed=3), "seq_mean"))
    with pytest.raises(AssertionError, match=message):
        state = PolicyState(params, tx.init(params))
        programs.update(state, batch, jax.random.key(0), settings("seq_mean"))


# ---------------------------------------------------------------------- on a mesh


@pytest.mark.slow
def test_packed_equals_padded_on_a_mesh():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = PYTHONPATH
    out = subprocess.run(
        [sys.executable, __file__, "mesh"], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    assert result["loss_diff"] < 1e-5 and result["param_diff"] < 1e-5, result
    # without the rollouts of no signal (padded and packed) as with them
    assert result["dropped_loss_diff"] < 1e-5 and result["dropped_param_diff"] < 1e-5, result


def _mesh_main() -> None:
    """(data 2, fsdp 2): one GRPO update of two micro-batches, padded vs packed."""
    from sagc_jax.config import MeshConfig
    from sagc_jax.parallel import ShardingPlan

    plan = ShardingPlan.from_config(MeshConfig(2, 2, 1), jax.devices()[:4])
    graphdef, params = tiny_policy()
    param_sh = plan.params(params)
    params = jax.device_put(params, param_sh)
    tx = optax.sgd(1.0)
    opt_sh = plan.opt_state(tx, jax.eval_shape(tx.init, params), param_sh)
    programs = PolicyPrograms(graphdef, tx, plan, StateShardings(param_sh, opt_sh))
    s = settings("seq_mean", micro=2)
    b = rollouts(16, seed=7)
    multiple = row_multiple(1, 2, plan.batch_shards)
    rows = packed_rows_needed(
        b["prompt_lens"], b["mask"], pack_len=P + L, multiple=multiple, max_rows=16
    )
    # the rollouts of no signal left out, padded (a rung of the row ladder) and packed
    zero = (np.arange(16) // 4) % 2 == 0
    b0 = {**b, "adv": np.where(zero, 0.0, b["adv"]).astype(np.float32)}
    kept = rung_for(int((~zero).sum()), multiple, 16)
    rows0 = packed_rows_needed(
        b0["prompt_lens"],
        b0["mask"],
        pack_len=P + L,
        multiple=multiple,
        max_rows=16,
        trained_b=~zero,
    )
    batches = [
        padded(b, "seq_mean"),
        pack(b, "seq_mean", rows),
        padded(b0, "seq_mean"),
        padded(b0, "seq_mean", rows=kept, trained=~zero),
        pack(b0, "seq_mean", rows0, trained=~zero),
    ]
    results = []
    for batch in batches:
        start = jax.tree.map(jnp.copy, params)
        state = PolicyState(start, jax.jit(tx.init, out_shardings=opt_sh)(start))
        new, _, metrics = programs.update(state, plan.global_rows(batch), jax.random.key(0), s)
        results.append((float(metrics["loss"]), jax.tree.leaves(jax.device_get(new))))

    def differences(one, two):
        (l1, p1), (l2, p2) = one, two
        diff = max(float(np.max(np.abs(x - y))) for x, y in zip(p1, p2, strict=True))
        return abs(l1 - l2), diff

    loss_diff, param_diff = differences(results[0], results[1])
    dropped = [differences(results[2], r) for r in results[3:]]
    print(
        json.dumps(
            {
                "devices": plan.mesh.size,
                "loss_diff": loss_diff,
                "param_diff": param_diff,
                "dropped_loss_diff": max(d[0] for d in dropped),
                "dropped_param_diff": max(d[1] for d in dropped),
            }
        )
    )


if __name__ == "__main__" and sys.argv[1:] == ["mesh"]:
    _mesh_main()
