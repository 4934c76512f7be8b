"""``train.compile_ahead`` compiles what the run then runs: every candidate's rollout, every
row count the update can take and the evaluation, so the steps and evaluations trace nothing."""

import pytest
from helpers import TINY, CyclingController

from sagc_jax.config import load_config
from sagc_jax.train.loop import Trainer


@pytest.mark.slow
@pytest.mark.parametrize("packing", [True, False])
def test_compile_ahead_leaves_nothing_to_compile(tmp_path, capsys, packing):
    overrides = [
        *TINY,
        "train.steps=4",
        "train.eval_every=2",
        "logging.tensorboard=false",
        "train.compile_ahead=true",
        f"train.packing={packing}",
    ]
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    trainer.controller = CyclingController((2, 4))
    trainer.compile_ahead()
    printed = capsys.readouterr().out
    assert "compiled G=2" in printed and "compiled the evaluation (4 prompts)" in printed
    traced = (
        trainer.sampler.num_traces,
        trainer.programs.compiled_programs()["update"],
        trainer.eval_sampler.num_traces,
    )
    rows = printed.split("compiled the update at ")[1].split(" rows")[0].split(", ")
    assert traced[1] == len(rows) and traced[2] == 1
    trainer.run(progress=False)  # compile_ahead again, the steps, three evaluations
    trainer.close()
    assert (
        trainer.sampler.num_traces,
        trainer.programs.compiled_programs()["update"],
        trainer.eval_sampler.num_traces,
    ) == traced
