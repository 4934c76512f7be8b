"""The sampler's outputs pinned over every path of its decode loop, so that a rewrite of the loop
(issue 46: the decode as functions over an explicit state, ``sampling/decode.py``) keeps the
tokens, the log-probabilities and the counters of the code before it (commit 7fc62d4).

Each configuration of CONFIGS takes a path: every row to the cap without an end token (all
rollouts together: in lockstep; through fewer slots: refilled), end tokens with all slots at one
rung, with the tail's rungs and phases, rollouts streamed through fewer slots (ending at their
first token included), the exit test of ``keep_groups``; on two host devices the rows split over
the batch shards (data) or the weights over fsdp. The golden file holds their outputs for three
keys and settings (greedy, the policy, filtered), written by this module run as a script:

    PYTHONPATH=$PWD python tests/sampling/test_sampler_golden.py            # one device
    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=$PWD \\
        python tests/sampling/test_sampler_golden.py --devices 2            # two (appended)

The tests run the same code and compare: tokens, lengths, flags and counters equal,
log-probabilities within 1e-5.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).resolve().parent / "data" / "sampler_golden.npz"
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [20]]
INDEX_R = np.array([2, 0, 0, 1, 2, 1, 0, 2, 1, 1, 0, 2], np.int32)
WIDTH, MAX_NEW = 8, 8
CALLS = [
    (0, dict(temperature=0.0)),
    (1, dict(temperature=1.0)),
    (2, dict(temperature=0.8, top_k=20, top_p=0.9)),
]
# name -> (end tokens, slots, row_buckets, decode_chunk, keep_groups, mesh (data, fsdp) or None)
CONFIGS = {
    "forced/all-slots/one-rung": (False, 0, 1, 0, 0, None),
    "forced/all-slots/rungs-phases": (False, 0, 3, 3, 0, None),
    "forced/refill/rungs-phases": (False, 4, 3, 3, 0, None),
    "eos/all-slots/one-rung": (True, 0, 1, 0, 0, None),
    "eos/all-slots/rungs-phases": (True, 0, 3, 3, 0, None),
    "eos/refill/one-rung": (True, 4, 1, 0, 0, None),
    "eos/refill/rungs-phases": (True, 4, 3, 3, 0, None),
    "eos/refill-8/rungs-phases": (True, 8, 2, 2, 0, None),
    "keep1/all-slots/rungs-phases": (True, 0, 3, 3, 1, None),
    "keep2/refill/rungs-phases": (True, 4, 3, 3, 2, None),
    "keep1/refill/one-rung": (True, 4, 1, 0, 1, None),
    "data2/forced/all-slots": (False, 0, 1, 3, 0, (2, 1)),
    "data2/eos/refill/rungs-phases": (True, 4, 2, 3, 0, (2, 1)),
    "data2/keep1/all-slots/rungs": (True, 0, 3, 3, 1, (2, 1)),
    "fsdp2/eos/all-slots/rungs": (True, 0, 3, 3, 0, (1, 2)),
}
FIELDS = ("tokens_bt", "logprobs_bt", "lengths_b", "truncated_b", "cut_b")
COUNTERS = ("num_decode_steps", "rows_decoded", "live_rows_decoded", "prefill_rows")


def end_tokens(model_state):
    """End tokens from the free run (no end token, seeds 0 and 1): the first tokens of two
    rollouts (rollouts that end at once free their slots at once) and tokens met later in some
    rows, never in others."""
    g_rl, s_rl = (outputs(*model_state, (), 0, 1, 0, 0, None, seed)[0][0] for seed in (0, 1))
    ends = {int(s_rl[0, 0]), int(s_rl[5, 0]), int(g_rl[1, 2]), int(s_rl[2, 3]), int(s_rl[4, 5])}
    return tuple(sorted(ends))


def model_and_state():
    """(graphdef, state) of the tiny model, weights from nnx.Rngs(0)."""
    from flax import nnx

    from sagc_jax.models import Decoder, get_preset

    return nnx.split(Decoder(get_preset("tiny", **SMALL), rngs=nnx.Rngs(0)))


_SAMPLERS: dict = {}


def outputs(graphdef, state, eos_ids, slots, row_buckets, chunk, keep, mesh, seed):
    """(fields, counters) of one call, numpy: FIELDS' arrays and COUNTERS' values."""
    import jax

    from sagc_jax.models import get_preset
    from sagc_jax.sampling import Sampler, left_pad

    key = (eos_ids, slots, row_buckets, chunk, mesh)
    if key not in _SAMPLERS:
        kw = dict(eos_ids=eos_ids, pad_id=0, slots=slots, row_buckets=row_buckets)
        params = state
        if mesh is not None:
            from sagc_jax.config import MeshConfig
            from sagc_jax.parallel import ShardingPlan

            plan = ShardingPlan.from_config(MeshConfig(data=mesh[0], fsdp=mesh[1]))
            shardings = plan.params(state)
            params = jax.device_put(state, shardings)
            kw |= dict(plan=plan, state_shardings=shardings)
        config = get_preset("tiny", **SMALL)
        _SAMPLERS[key] = Sampler(graphdef, config, decode_chunk=chunk, **kw), params
    sampler, params = _SAMPLERS[key]
    ids_pt, lens_p = left_pad(PROMPTS, pad_id=0, buckets=(WIDTH,))
    out = sampler(
        params,
        ids_pt,
        lens_p,
        jax.random.key(seed),
        max_new_tokens=MAX_NEW,
        prompt_index_r=INDEX_R,
        keep_groups=keep,
        **dict(CALLS)[seed],
    )
    out = sampler.to_host(out)
    return tuple(np.asarray(getattr(out, f)) for f in FIELDS), [
        int(getattr(out, c)) for c in COUNTERS
    ]


def run_configs(devices: int, eos_ids=None) -> dict:
    """Every configuration for ``devices`` host devices (one: those without a mesh; two: those
    with one), every call, as arrays keyed '<devices>|<field>' of shape [configs, calls, ...]
    ('<devices>|counters': COUNTERS' values), with '<devices>|names' and 'eos_ids'."""
    graphdef, state = model_and_state()
    eos_ids = end_tokens((graphdef, state)) if eos_ids is None else tuple(eos_ids)
    names = [n for n, (*_, mesh) in CONFIGS.items() if (mesh is not None) == (devices > 1)]
    got: dict = {f: [] for f in (*FIELDS, "counters")}
    for name in names:
        eos, slots, row_buckets, chunk, keep, mesh = CONFIGS[name]
        calls = [
            outputs(
                graphdef, state, eos_ids if eos else (), slots, row_buckets, chunk, keep, mesh, s
            )
            for s, _ in CALLS
        ]
        for i, field in enumerate(FIELDS):
            got[field].append(np.stack([fields[i] for fields, _ in calls]))
        got["counters"].append(np.asarray([counters for _, counters in calls], np.int32))
    arrays = {f"{devices}|{f}": np.stack(v) for f, v in got.items()}
    arrays[f"{devices}|tokens_bt"] = arrays[f"{devices}|tokens_bt"].astype(np.int8)  # vocab 64
    arrays[f"{devices}|names"] = np.asarray(names)
    return arrays | {"eos_ids": np.asarray(eos_ids, np.int32)}


def assert_matches(got: dict, want: dict) -> None:
    """``got`` holds ``want``'s keys with equal values (log-probabilities within 1e-5)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key in sorted(want):
        if key.endswith("logprobs_bt"):
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _golden(devices: int) -> dict:
    with np.load(GOLDEN) as data:
        return {k: v for k, v in data.items() if k == "eos_ids" or k.startswith(f"{devices}|")}


def test_the_golden_file_covers_every_path():
    """The pinned outputs take every path: rows ending early and at the cap, at their first
    token (with refill), calls cut by keep_groups, rungs below all slots."""
    want = _golden(1)
    names = want["1|names"].tolist()
    lengths = want["1|lengths_b"]
    assert (lengths == 1).any() and (lengths == MAX_NEW).any()
    assert ((lengths > 1) & (lengths < MAX_NEW)).any()
    keep_c = np.asarray([n.startswith("keep") for n in names])
    # each keep_groups configuration stops some call early; the others stop none
    assert want["1|cut_b"][keep_c].any(axis=(1, 2)).all() and not want["1|cut_b"][~keep_c].any()
    steps, rows = want["1|counters"][names.index("eos/all-slots/rungs-phases"), 1, :2]
    assert rows < steps * INDEX_R.size  # rows left the batch


def test_one_device_reproduces_the_golden_outputs():
    want = _golden(1)
    assert_matches(run_configs(1, want["eos_ids"]), want)


@pytest.mark.heavy
def test_two_host_devices_reproduce_the_golden_outputs(tmp_path):
    from helpers import PYTHONPATH

    want = _golden(2)
    out = tmp_path / "two.npz"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env |= dict(JAX_PLATFORMS="cpu", PYTHONPATH=PYTHONPATH)
    cmd = [sys.executable, __file__, "--devices", "2", "--out", str(out)]
    cmd += ["--eos", ",".join(map(str, want["eos_ids"].tolist()))]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(out) as data:
        assert_matches(dict(data), want)


def main() -> None:
    parser = argparse.ArgumentParser(description="write (or append to) the golden file")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write here, not the golden file")
    parser.add_argument("--eos", default=None, help="end tokens (default: the golden file's)")
    args = parser.parse_args()
    eos = None if args.eos is None else [int(t) for t in args.eos.split(",")]
    if eos is None and args.devices > 1:
        eos = _golden(1)["eos_ids"].tolist()
    arrays = run_configs(args.devices, eos)
    if args.out is not None:
        np.savez_compressed(args.out, **arrays)
        return
    old = {}
    if args.devices > 1:
        with np.load(GOLDEN) as data:
            old = dict(data)
    GOLDEN.parent.mkdir(exist_ok=True)
    np.savez_compressed(GOLDEN, **(old | arrays))


if __name__ == "__main__":
    main()
