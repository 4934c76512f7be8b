"""`sagc-jax plan --compile`: every program of a run compiled ahead of time for a target (this
host's CPU devices here; a TPU slice where libtpu is installed), its memory and FLOPs beside
plan's formula."""

import importlib.util
import re

import pytest
from helpers import TINY

from sagc_jax.cli import main
from sagc_jax.config import ConfigError
from sagc_jax.planning.aot import parse_topology, windowed_matmuls

ARGS = ["plan", "--config", "configs/demo.yaml", *(a for kv in TINY for a in ("--set", kv))]
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _rows(out: str) -> dict[str, dict[str, str]]:
    """The table's rows by program name, each cell by its column name."""
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [
        dict(zip(names, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[1:]
        if not line.startswith("| ---")
    ]
    return {row["program"]: row for row in rows}


@pytest.mark.parametrize(
    ("name", "topology", "preset"),
    [
        ("v5p-32", "v5p:2x2x4", "tpu-v5p"),
        ("v4-32", "v4:2x2x4", "tpu-v4"),
        ("v5litepod-16", "v5e:4x4", "tpu-v5e"),
        ("v6e-16", "v6e:4x4", "tpu-v6e"),
        ("V5P:2x2x2", "v5p:2x2x2", "tpu-v5p"),
        ("v5e:2x2", "v5e:2x2", "tpu-v5e"),
    ],
)
def test_topology_and_cloud_names(name, topology, preset):
    assert parse_topology(name) == (topology, preset)


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("v5p-31", "use one of v5p-8, v5p-16"),
        ("v5e:2x2x2", "a v5e slice has 2 dimensions"),
        ("v5p:4x4", "a v5p slice has 3 dimensions"),
        ("h100", "or cpu"),
    ],
)
def test_bad_target_names_say_what_is_allowed(name, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        parse_topology(name)


# Two loops as libtpu 0.0.42.1 wrote them for the FSDP update of a Qwen2.5-0.5B on v5p:2x2x4
# (shapes cut short), and a while loop of the program's own (the microbatch scan).
_HLO = """
  %while.10221 = (bf16[1,768,896], u32[]) while(%tuple.29064), condition=%wide.windowed_dot_gen\
eral_cond_ag.clone, body=%wide.windowed_dot_general_body_ag.clone.sunk, metadata={op_name="dot"}
  %while.10300 = (bf16[1,768,896], u32[]) while(%tuple.3), condition=%wide.windowed_dot_genera\
l_cond_rs.168.clone, body=%wide.windowed_dot_general_body_rs.168.clone.sunk
  %while.2 = (s32[], f32[8]) while(%tuple.1), condition=%region_1.cond, body=%region_2.1087_spmd
"""


def test_matmuls_the_partitioner_split_into_windows_are_counted():
    # the cost analysis counts a loop body once: these matmuls' FLOPs count one window each
    assert windowed_matmuls(_HLO) == 2
    assert windowed_matmuls("%dot.1 = f32[8,8] dot(f32[8,4] %a, f32[4,8] %b)") == 0


@pytest.mark.slow
def test_compile_for_cpu_prints_every_program_beside_the_formula(capsys):
    assert main([*ARGS, "--compile", "cpu", "--device-memory", "1", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert set(rows) == {"sampler G=2", "sampler G=4", "update G=2", "update G=4", "eval sampler"}
    # the held-out prompts decode through the trainer's eval slots (G = 4's 8 rows): all 4
    assert rows["eval sampler"]["shapes"] == "4 held-out prompts, greedy, 16 + 12 tokens, 4 at once"
    for name, row in rows.items():
        assert float(row["compile s"]) > 0 and float(row["peak MiB"]) > 0, name
        assert float(row["TFLOPs (compiler)"]) > 0 and row["fits"] == "yes", name
    for g in (2, 4):
        update = rows[f"update G={g}"]
        # the compiled update's FLOPs and memory are what the formula says, within 20%
        assert 0.8 < float(update["compiler / roofline"]) < 1.2
        assert 0.8 < float(update["peak / estimate"]) < 1.2
        sampler = rows[f"sampler G={g}"]
        assert 0.8 < float(sampler["peak / estimate"]) < 1.25
    assert "5 programs compiled in" in out
    # on CPU the programs' memory is the process's own: the run's peak RSS is estimated as this
    # process before compiling, what each compile kept, and the largest program's peak
    host = re.search(
        r"resident memory is about ([0-9.]+) GiB: this process before compiling "
        r"\(([0-9.]+) GiB",
        out,
    )
    assert host and float(host[1]) > float(host[2]) > 0, out[-2000:]
    # --hardware times the step's update by the compiled program's FLOPs (every loop trip)
    assert re.search(r"update: .*; [0-9.e-]+ TFLOPs of the compiled update G=4 \(8 packed", out)


def test_a_kl_update_with_remat_compiles_and_its_reference_forward_is_counted(capsys):
    # the paper's GRPO configs: a KL term (one more forward, of the reference policy) and remat
    kl = ["--set", "loss.kl_beta=0.01", "--set", "model.remat=dots"]
    assert main([*ARGS, *kl, "--compile", "cpu", "--programs", "update"]) == 0
    for name, row in _rows(capsys.readouterr().out).items():
        assert 0.8 < float(row["compiler / roofline"]) < 1.2, name


def test_compile_names_the_program_that_does_not_fit(capsys):
    # the update of G=4 holds twice the activations of G=2's: a budget between the two
    args = [*ARGS, "--compile", "cpu", "--programs", "update", "--device-memory", "0.01"]
    assert main(args) == 2
    captured = capsys.readouterr()
    rows = _rows(captured.out)
    assert rows["update G=2"]["fits"] == "yes" and rows["update G=4"]["fits"] == "NO"
    (line,) = captured.err.strip().splitlines()
    assert "update G=4" in line and "GiB per device" in line and "train.microbatches" in line


def test_compile_refuses_an_unknown_program_filter(capsys):
    assert main([*ARGS, "--compile", "cpu", "--programs", "decoder"]) == 2
    assert "start each name with sampler, tail, update, eval or merge" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: pip install -e '.[tpu-aot]'")
def test_compile_for_a_tpu_slice_without_a_tpu(capsys):
    demo = ["plan", "--config", "configs/demo.yaml", "--compile", "v5e:2x2"]
    assert main([*demo, "--programs", "sampler G=16,update G=16"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"sampler G=16", "update G=16"}
    for row in rows.values():
        assert float(row["peak MiB"]) > 0 and float(row["TFLOPs (compiler)"]) > 0
        assert row["fits"] == "yes"
    # 65,536 rollouts of 1,024 tokens: a KV cache of about 17 GiB per chip, over v5e's 16
    big = ["--set", "train.prompts_per_step=4096", "--set", "sampling.max_new_tokens=1000"]
    assert main([*demo, *big, "--programs", "sampler G=16"]) == 2
    # the TPU compiler itself refuses a program over the chip's HBM: one line names it
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "sampler G=16 (65536 rollouts" in line and "does not fit v5e:2x2" in line
    assert "RESOURCE_EXHAUSTED" in line


@pytest.mark.skipif(HAS_LIBTPU, reason="libtpu is installed here")
def test_a_tpu_target_without_libtpu_says_how_to_install_it(capsys):
    assert main([*ARGS, "--compile", "v5p-32"]) == 2
    err = capsys.readouterr().err
    assert "cannot describe v5p:2x2x4; libtpu is not installed" in err and "tpu-aot" in err
