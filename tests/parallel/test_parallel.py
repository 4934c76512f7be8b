"""Scale-out: mesh resolution, sharding rules, sharded programs on 8 simulated CPU devices, and a
two-process run over gloo that must equal a one-process run."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import PEER_TIMEOUT_S, PYTHONPATH, TINY, dead_peer_said, stopped_with_one_line
from jax.sharding import AbstractMesh, PartitionSpec

from sagc_jax.config import ConfigError, MeshConfig, load_config
from sagc_jax.models import axes as ax
from sagc_jax.parallel import EXIT_PEER_LOST, RULES, initialize, mesh_shape
from sagc_jax.programs.shapes import check_batch_shapes

WORKER = Path(__file__).parent / "sharded_worker.py"


def _env(devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["PYTHONPATH"] = PYTHONPATH
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def _worker(*args) -> dict:
    out = subprocess.run(
        [sys.executable, str(WORKER), *args],
        env=_env(8),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- mesh and rules


def test_mesh_shape_resolves_the_free_axis():
    assert mesh_shape(MeshConfig(data=1, fsdp=-1, tensor=1), 8) == {
        "data": 1,
        "fsdp": 8,
        "tensor": 1,
    }
    assert mesh_shape(MeshConfig(data=2, fsdp=-1, tensor=2), 8)["fsdp"] == 2
    assert mesh_shape(MeshConfig(data=-1, fsdp=1, tensor=4), 8)["data"] == 2


@pytest.mark.parametrize(
    ("mesh", "devices", "message"),
    [
        (MeshConfig(data=1, fsdp=-1, tensor=3), 8, "not divisible by the fixed axes (3)"),
        (MeshConfig(data=2, fsdp=2, tensor=1), 8, "needs 4 devices but 8 are available"),
    ],
)
def test_mesh_shape_rejects_impossible_meshes(mesh, devices, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mesh_shape(mesh, devices)


def test_rules_skip_axes_that_do_not_divide_or_are_taken():
    mesh = AbstractMesh((1, 2, 4), ("data", "fsdp", "tensor"))
    spec = lambda names, shape: ax.mesh_spec(names, shape, mesh, RULES)  # noqa: E731
    assert spec((ax.EMBED, ax.MLP), (64, 176)) == PartitionSpec("fsdp", "tensor")
    # 2 KV heads cannot be split 4 ways: replicated instead of an invalid sharding
    assert spec((ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), (64, 2, 16)) == PartitionSpec(
        "fsdp", None, None
    )
    # rows go over data x fsdp; size-1 axes are dropped
    assert spec((ax.BATCH, ax.LENGTH), (8, 5)) == PartitionSpec("fsdp", None)
    # one mesh axis is used once per array
    assert spec((ax.Q_HEADS, ax.HEAD_DIM, ax.MLP), (4, 16, 8)) == PartitionSpec(
        "tensor", None, None
    )


def test_batch_shapes_must_split_over_the_mesh_and_the_processes():
    cfg = load_config(None, [*TINY, "train.prompts_per_step=3"])
    with pytest.raises(ConfigError, match="6 rollouts, 6 per microbatch, which the 4 batch"):
        check_batch_shapes(cfg, (2, 4), batch_shards=4)
    split = load_config(None, [*TINY, "train.prompts_per_step=4", "train.microbatches=4"])
    with pytest.raises(ConfigError, match="8 rollouts, 2 per microbatch, which the 4 batch"):
        check_batch_shapes(split, (2,), batch_shards=4)
    with pytest.raises(ConfigError, match="3 prompts, which 2 processes cannot share evenly"):
        check_batch_shapes(cfg, (2,), batch_shards=2, processes=2)
    with pytest.raises(ConfigError, match="batch shards is not a multiple of the 2 processes"):
        check_batch_shapes(cfg, (2,), batch_shards=1, processes=2)


def test_coordinator_flags_are_checked_before_starting(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert initialize(None, None, None) is False
    with pytest.raises(ConfigError, match="needs --num-processes N and --process-id I"):
        initialize("localhost:1234", 2, None)
    with pytest.raises(ConfigError, match=r"--process-id 2 is outside \[0, 2\)"):
        initialize("localhost:1234", 2, 2)
    with pytest.raises(ConfigError, match="expected HOST:PORT or auto"):
        initialize("localhost", 2, 0)
    with pytest.raises(ConfigError, match="need --coordinator"):
        initialize(None, 2, 0)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
    monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
    with pytest.raises(ConfigError, match="JAX_PROCESS_ID is not"):
        initialize(None, None, None)


# ---------------------------------------------------------------------- 8 simulated devices


@pytest.fixture(scope="module")
def sharded():
    return _worker("update", "0.04")  # with a KL term: the reference model is sharded too


@pytest.mark.heavy
def test_sharded_update_matches_one_device(sharded):
    base = sharded["single"]
    names = ("fsdp2", "fsdp8", "tensor4", "mixed")
    for name in names:
        run = sharded[name]
        np.testing.assert_allclose(run["loss"], base["loss"], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(run["grad_norm"], base["grad_norm"], rtol=1e-4, err_msg=name)
    chex.assert_trees_all_close(
        {name: sharded[name]["params"] for name in names},
        {name: base["params"] for name in names},
        rtol=1e-7,
        atol=1e-5,
    )


@pytest.mark.heavy
def test_sharded_generation_matches_one_device(sharded):
    base = sharded["single"]
    for name in ("fsdp2", "fsdp8", "tensor4", "mixed"):
        assert sharded[name]["tokens"] == base["tokens"], name
        np.testing.assert_allclose(sharded[name]["logprobs"], base["logprobs"], atol=1e-4)


@pytest.mark.heavy
def test_parameters_and_optimizer_state_are_really_split(sharded):
    nbytes = {name: run["param_bytes"] for name, run in sharded.items()}
    assert nbytes["single"] > nbytes["fsdp2"] > nbytes["fsdp8"]
    assert nbytes["fsdp2"] < 0.55 * nbytes["single"] and nbytes["fsdp8"] < 0.15 * nbytes["single"]
    assert nbytes["tensor4"] < 0.4 * nbytes["single"]
    assert nbytes["mixed"] < 0.3 * nbytes["single"]
    for name in ("fsdp2", "fsdp8", "tensor4", "mixed"):
        assert sharded[name]["opt_bytes"] < sharded["single"]["opt_bytes"], name
    # the KV cache is split by rows, its per-row write index too
    assert sharded["fsdp8"]["cache_bytes"] * 8 == sharded["single"]["cache_bytes"]
    assert sharded["mixed"]["param_spec"] == ["fsdp", "tensor"]


@pytest.mark.heavy
def test_sharded_programs_compile_once_per_shape(sharded):
    for name, run in sharded.items():
        assert run["update_traces"] == 1 and run["sampler_traces"] == 1, name


@pytest.mark.heavy
def test_trainer_on_a_mesh_compiles_one_program_per_candidate(tmp_path):
    result = _worker("trainer", str(tmp_path / "run"))
    assert result["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    assert result["steps"] == 4
    assert result["sampler_traces"] == 2 and result["update_traces"] == result["update_rungs"]


# ---------------------------------------------------------------------- two processes


RUN = [
    *TINY,
    "train.prompts_per_step=4",
    "logging.tensorboard=false",
    "logging.plots=false",
    "train.checkpoint_every=2",
    # prompts of 5 to 9 tokens: the processes' halves of a batch fall in different buckets
    # unless they agree on one width
    "sampling.prompt_buckets=[8,16]",
    # frequent stragglers and a fast-moving lambda: SAGC (and the hybrid, SAGC with a
    # predictor) leaves G = 4 for 2 within 4 steps
    "controller.tau=1.2",
    "controller.delta=0.05",
    "controller.sagc.eta=10",
    "controller.hybrid.eta=10",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(run_dir, steps, processes, extra=(), crash_at=None, crashing=None):
    """Start ``processes`` processes of one device each (--peer-timeout PEER_TIMEOUT_S); process
    ``crashing`` gets SAGC_JAX_CRASH_AT=``crash_at``. Returns their exit codes and (stdout,
    stderr), once every process but a stopped one (``...:SIGSTOP``, then killed) has ended."""
    run = [*RUN, *extra, f"train.steps={steps}", f"logging.run_dir={run_dir}"]
    cmd = [sys.executable, "-m", "sagc_jax", "train", *[f"--set={o}" for o in run]]
    port = _free_port()
    procs = []
    for i in range(processes):
        env = _env(1)
        if crash_at and i == crashing:
            env["SAGC_JAX_CRASH_AT"] = crash_at
        flags = [f"--coordinator=localhost:{port}", f"--num-processes={processes}"]
        flags += [f"--process-id={i}", f"--peer-timeout={PEER_TIMEOUT_S}"]
        procs.append(
            subprocess.Popen(
                [*cmd, *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    stalled = procs[crashing] if crash_at and crash_at.endswith("SIGSTOP") else None
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in procs if p is not stalled):
        assert time.monotonic() < deadline, "the processes did not end"
        time.sleep(0.5)
    if stalled is not None:
        stalled.kill()
    outs = [p.communicate(timeout=60) for p in procs]
    return [p.returncode for p in procs], outs


def _train(run_dir, steps, processes=1, devices=1, extra=()):
    if processes == 1:
        run = [*RUN, *extra, f"train.steps={steps}", f"logging.run_dir={run_dir}"]
        cmd = [sys.executable, "-m", "sagc_jax", "train", *[f"--set={o}" for o in run]]
        out = subprocess.run(cmd, env=_env(devices), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return [out.stdout]
    codes, outs = _launch(run_dir, steps, processes, extra)
    for code, (_, err) in zip(codes, outs, strict=True):
        assert code == 0, err[-3000:]
    return [out for out, _ in outs]


def _metrics(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _params(run_dir, step):
    path = Path(run_dir) / "checkpoints" / str(step) / "params"
    checkpointer = ocp.StandardCheckpointer()
    meta = checkpointer.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
    return [np.asarray(x) for x in jax.tree.leaves(checkpointer.restore(path, target))]


def _group_sizes(run_dir):
    return [r["group_size"] for r in _metrics(run_dir) if "group_size" in r]


@pytest.mark.heavy
@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("controller.kind=hybrid", "data.prompt_pool=8"),  # hybrid: step mode, prompt ids
        ("controller.kind=sagc_value",),  # every process's rewards, gathered
        # each process leaves its own rollouts of advantage 0 out, packed in the rung of all
        ("data.reward=helpers:half_signal_reward", "data.reward_timeout_s=0"),
    ],
    ids=["sagc", "hybrid", "sagc_value", "rollouts without signal left out"],
)
def test_two_processes_train_like_one(tmp_path, extra):
    one, two = tmp_path / "one", tmp_path / "two"
    _train(one, steps=4, devices=2, extra=extra)
    # two processes of one device each: 2 steps, then a resume (Orbax restore across processes)
    outs = _train(two, steps=2, processes=2, extra=extra)
    assert "2 process(es)" in outs[0] and "train" not in outs[1]  # only process 0 prints
    _train(two, steps=4, processes=2, extra=extra)
    sizes = _group_sizes(one)
    assert _group_sizes(two) == sizes and len(set(sizes)) == 2, sizes
    # with learning signal the processes' packing sums the gradient in another order, and Adam
    # divides that float error by small second moments: a tenth of one step (lr 1e-3) of margin
    learns = any("half_signal" in o for o in extra)
    atol = 1e-4 if learns else 1e-6
    chex.assert_trees_all_close(_params(two, 4), _params(one, 4), rtol=1e-7, atol=atol)


@pytest.mark.heavy
def test_a_run_resumes_on_a_different_mesh(tmp_path):
    moved, straight = tmp_path / "moved", tmp_path / "straight"
    _train(moved, steps=2, devices=1)
    out = _train(moved, steps=3, devices=4)[0]  # the checkpoint is split 4 ways on restore
    assert "fsdp=4, tensor=1 over 4 cpu devices" in out and "from step 2" in out
    _train(straight, steps=3, devices=1)
    assert _group_sizes(moved) == _group_sizes(straight)
    chex.assert_trees_all_close(_params(moved, 3), _params(straight, 3), rtol=1e-7, atol=1e-5)


@pytest.mark.heavy
def test_a_signal_to_one_process_stops_all_at_the_same_step(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*RUN, "train.steps=500", "train.checkpoint_every=0", f"logging.run_dir={run_dir}"]
    overrides.append("train.compile_ahead=true")  # every process compiles both G first
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sagc_jax",
                "train",
                *[f"--set={o}" for o in overrides],
                f"--coordinator=localhost:{port}",
                "--num-processes=2",
                f"--process-id={i}",
            ],
            env=_env(1),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and procs[0].poll() is None, "no steps logged"
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGTERM)  # a preemption notice reaching one host only
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, errors[0][-2000:]
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert len(steps) == 1 and 2 <= steps[0] < 500
    assert f"stopped by SIGTERM after step {steps[0]}" in errors[0]


def _tail_records(run_dir):
    return [
        {k: v for k, v in r.items() if k.startswith("tail/") or k == "group_size"}
        for r in _metrics(run_dir)
        if "group_size" in r
    ]


@pytest.mark.heavy
def test_two_processes_agree_on_tail_batching_and_resume_with_prompts_waiting(tmp_path):
    """Each process keeps its first whole groups and defers the rest; the processes' queues stay
    as long as each other's (the trainer checks every step that their controllers agree), and a
    resume with prompts waiting (step 2: two deferred on each) continues as the straight run."""
    tail = ("tail_batching.enabled=true", "tail_batching.extra=0.5")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(straight, steps=3, processes=2, extra=tail)
    _train(resumed, steps=2, processes=2, extra=tail)
    _train(resumed, steps=3, processes=2, extra=tail)
    records = _tail_records(straight)
    assert _tail_records(resumed) == records
    assert [r["tail/long_round"] for r in records] == [0, 0, 1]
    assert records[1]["tail/queue"] == 4 and records[0]["tail/prompts_started"] == 6
    chex.assert_trees_all_equal(_params(resumed, 3), _params(straight, 3))


# ---------------------------------------------------------------------- three and four processes


@pytest.mark.heavy
def test_three_processes_outlive_a_middle_rank_resume_and_train_like_one(tmp_path):
    """Three processes share 3 prompts a step and split the 4 held-out prompts unevenly (the
    evaluation pads them to 6); 4 prompts a step cannot be shared and are refused in one line.
    Process 1 dies in step 3: processes 0 and 2 stop with the one line, the rerun resumes from
    step 2 and ends where one process ends."""
    three = ("train.prompts_per_step=3", "train.async_checkpoint=false")
    one, run_dir = tmp_path / "one", tmp_path / "three"
    codes, outs = _launch(tmp_path / "refused", 4, 3)  # RUN's 4 prompts a step
    assert codes == [2, 2, 2]
    assert outs[2][1].strip() == (
        "error: at G = 2 a step has 8 rollouts, 8 per microbatch, which the 3 batch shards of "
        "the mesh (mesh.data x mesh.fsdp) do not divide; change train.minibatches / "
        "train.microbatches or train.prompts_per_step"
    )
    codes, outs = _launch(run_dir, 4, 3, three, crash_at="rollout:3", crashing=1)
    assert codes == [EXIT_PEER_LOST, -signal.SIGKILL, EXIT_PEER_LOST], outs[0][1][-3000:]
    said = dead_peer_said(1, 3)
    assert stopped_with_one_line(outs[0][1], run_dir, said)
    assert stopped_with_one_line(outs[2][1], run_dir, said)

    outs = _train(run_dir, steps=4, processes=3, extra=three)
    assert f"resuming {run_dir} from step 2" in outs[0]
    _train(one, steps=4, devices=3, extra=three)
    assert _group_sizes(run_dir) == _group_sizes(one)
    evals = [[r[k] for k in sorted(r) if k.startswith("eval/")] for r in _metrics(one)]
    assert [[r[k] for k in sorted(r) if k.startswith("eval/")] for r in _metrics(run_dir)] == evals
    chex.assert_trees_all_close(_params(run_dir, 4), _params(one, 4), rtol=1e-7, atol=1e-6)


@pytest.mark.heavy
def test_a_stalled_coordinator_of_four_processes_ends_the_others_with_one_line(tmp_path):
    """Process 0 stops (SIGSTOP) in step 3: its coordination service neither answers nor fails,
    so the others' calls to it hang; each of them still ends within --peer-timeout with the one
    line (not the runtime's heartbeat abort, a C++ stack dump)."""
    run_dir = tmp_path / "run"
    extra = ("train.async_checkpoint=false",)
    codes, outs = _launch(run_dir, 4, 4, extra, crash_at="rollout:3:SIGSTOP", crashing=0)
    assert codes[1:] == [EXIT_PEER_LOST] * 3, outs[1][1][-3000:]
    what = (
        f"process 0 of 4 (the jax.distributed coordinator) stopped answering ({PEER_TIMEOUT_S} s, "
    )
    what += "--peer-timeout)"
    wrong = [err[-3000:] for _, err in outs[1:] if not stopped_with_one_line(err, run_dir, (what,))]
    assert not wrong, "\n---\n".join(wrong)
