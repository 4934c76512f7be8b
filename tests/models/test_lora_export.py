"""LoRA export: merged Hugging Face weights and PEFT-layout adapters, checked against
transformers + PEFT's own LoRA forward (CPU torch); ``sagc-jax export`` of LoRA and full
fine-tuning runs."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from helpers import RAW_ROWS, TINY, sets, write_word_tokenizer
from hf_tiny import COMMON, forward, hf_logits, randomize

from sagc_jax.cli import main
from sagc_jax.config import load_config
from sagc_jax.models import Decoder, load_hf_checkpoint, lora
from sagc_jax.models.hf_lora import save_merged, save_peft_adapters
from sagc_jax.tasks import CharTokenizer
from sagc_jax.train.loop import Trainer

CASES = {
    # GQA, untied embeddings, every projection adapted
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
        tuple(lora.TARGETS),
    ),
    # q/k/v biases (not adapted: bias "none"), tied embeddings, a subset of projections
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
        ("q_proj", "v_proj", "o_proj", "down_proj"),
    ),
}
TOKENS_BT = np.random.RandomState(0).randint(0, COMMON["vocab_size"], (2, 16)).astype(np.int32)
RANK, ALPHA = 4, 8.0


def _adapted_model(base_dir: str, targets: tuple[str, ...], seed: int) -> Decoder:
    """The model of ``base_dir`` with adapters on ``targets``: A as initialised, B drawn too
    (LoRA's zero B would make every check below pass trivially)."""
    base, cfg = load_hf_checkpoint(base_dir)
    model = Decoder(
        cfg.replace(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=targets), rngs=nnx.Rngs(seed)
    )
    nnx.update(model, nnx.state(base))
    adapters = nnx.state(model, lora.LoRAParam)
    key = jax.random.key(seed)
    for path, var in nnx.to_flat_state(adapters):
        if "_lora_b_" in path[-1]:
            key, sub = jax.random.split(key)
            var.set_value(0.5 * jax.random.normal(sub, var.shape) / RANK**0.5)
    nnx.update(model, adapters)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    """A random transformers model, random adapters on it, and both exports of them."""
    config_cls, model_cls, kwargs, targets = CASES[request.param]
    torch.manual_seed(0)
    hf_model = model_cls(config_cls(**COMMON, **kwargs)).eval()
    randomize(hf_model, seed=1)
    root = tmp_path_factory.mktemp(request.param)
    base_dir, adapter_dir, merged_dir = (str(root / d) for d in ("base", "adapter", "merged"))
    hf_model.save_pretrained(base_dir)
    model = _adapted_model(base_dir, targets, seed=2)
    _, adapters, base = nnx.split(model, lora.LoRAParam, nnx.Param)
    save_peft_adapters(adapters, model.config, adapter_dir, base=base_dir)
    save_merged(base, adapters, model.config, merged_dir)
    return dict(
        logits=np.asarray(forward(model, jnp.asarray(TOKENS_BT))),
        base_dir=base_dir,
        adapter_dir=adapter_dir,
        merged_dir=merged_dir,
        model_cls=model_cls,
        base_logits=hf_logits(hf_model, TOKENS_BT),
        name=request.param,
    )


def test_peft_loads_the_adapters_and_agrees_with_the_merged_export(exported):
    base = exported["model_cls"].from_pretrained(exported["base_dir"]).eval()
    peft_model = peft.PeftModel.from_pretrained(base, exported["adapter_dir"]).eval()
    assert isinstance(peft_model.peft_config["default"], peft.LoraConfig)
    want_btv = hf_logits(peft_model, TOKENS_BT)
    # the adapters change the logits (so the comparisons below can fail)
    assert np.abs(want_btv - exported["base_logits"]).max() > 0.5, exported["name"]

    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(exported["merged_dir"]).eval()
    assert np.abs(hf_logits(merged_hf, TOKENS_BT) - want_btv).max() <= 1e-4
    merged, _ = load_hf_checkpoint(exported["merged_dir"])
    got_btv = np.asarray(forward(merged, jnp.asarray(TOKENS_BT)))
    assert np.abs(got_btv - want_btv).max() <= 1e-4, exported["name"]
    # and our adapted model (the adapters unmerged) computes the same
    assert np.abs(exported["logits"] - want_btv).max() <= 1e-4, exported["name"]


# ---------------------------------------------------------------------- sagc-jax export RUN OUT

# Rewarded by length, which differs within a group: non-zero advantages move the adapters off
# their zero B in one update (the task's own reward is 0 for every rollout of a random model).
LORA_RUN = [
    *TINY,
    "model.lora_rank=4",
    "train.learning_rate=1e-2",
    "data.reward=lora_export_rewards:length",
    "logging.tensorboard=false",
]


@pytest.fixture
def length_reward(tmp_path, monkeypatch):
    (tmp_path / "lora_export_rewards.py").write_text(
        "def length(prompts, completions, answers):\n"
        "    return [float(len(c)) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def _train(overrides: list[str], run_dir: Path) -> list[str]:
    overrides = [*overrides, f"logging.run_dir={run_dir}"]
    assert main(["train", *sets(overrides)]) == 0
    return overrides


def _adapted_logits(overrides: list[str], tokens_bt) -> np.ndarray:
    """Logits of a finished LoRA run as its trainer restores it: adapters over the base."""
    trainer = Trainer(load_config(None, overrides), overrides[-1].split("=", 1)[1])
    trainer.close()
    model = nnx.merge(trainer.programs.graphdef, trainer.state.params, trainer.state.base)
    return np.asarray(forward(model, jnp.asarray(tokens_bt)))


@pytest.mark.slow
def test_export_of_a_lora_run_over_an_hf_checkpoint(tmp_path, capsys, length_reward):
    """merged weights, PEFT adapters over the HF base and the trainer's own adapted model agree;
    the tokenizer comes along; --adapters-only writes the PEFT layout alone."""
    config_cls, model_cls, kwargs, _ = CASES["llama"]
    hf_model = model_cls(config_cls(**COMMON, **kwargs)).eval()
    randomize(hf_model, seed=1)
    hf_model.save_pretrained(tmp_path / "hf")
    write_word_tokenizer(tmp_path / "tok")
    rows = [
        {"prompt": f"what is {a} plus {b}", "answer": str(a + b)}
        for a in range(4)
        for b in range(4)
    ]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dataset = [
        "data.task=dataset",
        *RAW_ROWS,
        f"data.path={tmp_path / 'train.jsonl'}",
        f"model.hf_checkpoint={tmp_path / 'hf'}",
        f"model.tokenizer={tmp_path / 'tok'}",
        "model.lora_targets=[q_proj,o_proj,up_proj,down_proj]",
    ]
    run = _train([*LORA_RUN, *dataset, "train.steps=1"], tmp_path / "run")
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert "PEFT adapters over" in capsys.readouterr().out

    want_btv = _adapted_logits(run, TOKENS_BT)
    # one update moved the adapters' B off zero: the checks below can fail
    assert np.abs(want_btv - hf_logits(hf_model, TOKENS_BT)).max() > 1e-3
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert np.abs(hf_logits(merged, TOKENS_BT) - want_btv).max() <= 1e-4
    base = model_cls.from_pretrained(tmp_path / "hf").eval()
    peft_model = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    assert np.abs(hf_logits(peft_model, TOKENS_BT) - want_btv).max() <= 1e-4
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("what is 1 plus 2")["input_ids"][-5:] == [4, 5, 12, 6, 13]

    assert main(["export", str(tmp_path / "run"), str(tmp_path / "only"), "--adapters-only"]) == 0
    assert sorted(p.name for p in (tmp_path / "only").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((tmp_path / "only" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "hf").absolute())
    assert config["target_modules"] == ["q_proj", "o_proj", "up_proj", "down_proj"]


@pytest.mark.slow
def test_export_of_a_lora_run_over_a_preset_writes_its_base(tmp_path, capsys, length_reward):
    run = _train([*LORA_RUN, "train.steps=1"], tmp_path / "run")
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert "no tokenizer: the synthetic task's characters" in capsys.readouterr().out
    tokens_bt = TOKENS_BT % CharTokenizer().vocab_size  # the synthetic task's vocabulary
    want_btv = _adapted_logits(run, tokens_bt)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert np.abs(hf_logits(merged, tokens_bt) - want_btv).max() <= 1e-4
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base").eval()
    assert np.abs(hf_logits(base, tokens_bt) - want_btv).max() > 1e-3
    peft_model = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    assert np.abs(hf_logits(peft_model, tokens_bt) - want_btv).max() <= 1e-4
    # eval samples the same merged weights (the base rebuilt, the adapters merged in)
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--num", "4"]) == 0
    assert "eval/accuracy=" in capsys.readouterr().out

    capsys.readouterr()  # transformers' loading bars
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "x"), "--adapters-only"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its base (preset tiny) is not a Hugging Face" in err, err


@pytest.mark.slow
def test_export_of_a_full_fine_tuning_run_and_one_line_errors(tmp_path, capsys):
    run = [*TINY, "train.steps=2", "train.checkpoint_every=1", "logging.tensorboard=false"]
    run = _train(run, tmp_path / "run")
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert "(full fine-tuning)" in capsys.readouterr().out
    trainer = Trainer(load_config(None, run), tmp_path / "run")
    trainer.close()
    tokens_bt = TOKENS_BT % CharTokenizer().vocab_size
    want_btv = np.asarray(
        forward(nnx.merge(trainer.programs.graphdef, trainer.state.params), tokens_bt)
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert np.abs(hf_logits(merged, tokens_bt) - want_btv).max() <= 1e-4

    capsys.readouterr()  # transformers' loading bars
    shutil.copytree(tmp_path / "run", tmp_path / "stopped")
    shutil.rmtree(tmp_path / "stopped" / "checkpoints" / "2")  # as if stopped after step 1
    (tmp_path / "empty").mkdir()
    cases = [
        (["run", "out"], "out: exists and is not an empty directory"),
        (["run", "x", "--adapters-only"], "full fine-tuning (model.lora_rank = 0) has no adapters"),
        (["nothere", "x"], "nothere: no such directory"),
        (["empty", "x"], "empty: no checkpoints/ directory"),
        (["stopped", "x"], "its newest checkpoint is step 1, before train.steps = 2"),
    ]
    for args, message in cases:
        assert (
            main(["export", *(str(tmp_path / a) if i < 2 else a for i, a in enumerate(args))]) == 2
        )
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert main(["export", str(tmp_path / "stopped"), str(tmp_path / "x"), "--unfinished"]) == 0
