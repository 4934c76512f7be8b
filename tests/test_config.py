"""Config loading, overrides and the one-line errors users see."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sagc_jax.cli import main
from sagc_jax.config import (
    Config,
    ConfigError,
    from_dict,
    load_config,
    to_dict,
)
from sagc_jax.planning.choices import check_names, reference_markdown

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert from_dict(to_dict(cfg)) == cfg  # round trip through plain data


def test_defaults_and_overrides():
    cfg = load_config(None, ["controller.delta=0.2", "controller.candidates=[2,4,8]"])
    assert cfg.controller.delta == 0.2
    assert cfg.controller.candidates == (2, 4, 8)
    assert cfg.sim == Config().sim
    # YAML 1.1 reads 4e-5 as a string; a float field still accepts it
    assert load_config(None, ["sim.update_token_seconds=4e-5"]).sim.update_token_seconds == 4e-5


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def error_of(path, overrides=()):
    """The one-line error of the config as a command loads it (its kinds checked too)."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, check=check_names)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_key_names_file_line_and_closest_key(tmp_path):
    path = write(tmp_path, "controller:\n  kind: sagc\n  delta: 0.2\n  dleta: 0.3\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}:4: unknown key 'controller.dleta'")
    assert "did you mean 'delta'?" in msg


def test_unknown_section(tmp_path):
    msg = error_of(write(tmp_path, "controler:\n  kind: sagc\n"))
    assert ":1: unknown key 'controler'" in msg and "did you mean 'controller'?" in msg


def test_wrong_type(tmp_path):
    msg = error_of(write(tmp_path, "sim:\n  steps: many\n"))
    assert msg == f"{path_of(tmp_path)}:2: sim.steps = 'many' has the wrong type; expected int"
    msg = error_of(write(tmp_path, "controller:\n  candidates: [4, 8.5]\n"))
    assert "controller.candidates = 8.5 has the wrong type; expected int" in msg
    msg = error_of(write(tmp_path, "logging:\n  tensorboard: 1\n"))
    assert "expected bool" in msg


def path_of(tmp_path):
    return tmp_path / "run.yaml"


def test_out_of_range_and_choices(tmp_path):
    msg = error_of(write(tmp_path, "controller:\n  kind: sagc\n  delta: 1.5\n"))
    assert msg.endswith("controller.delta = 1.5 is out of range; allowed: > 0.0 and < 1.0")
    assert ":3:" in msg
    msg = error_of(None, ["controller.scope=prompt"])
    assert msg.startswith("--set controller.scope=prompt: ")
    assert "choose one of ['group', 'batch']" in msg
    msg = error_of(None, ["controller.g_init=6"])
    assert "g_init = 6 is not a candidate; allowed: [4, 8, 16]" in msg
    msg = error_of(None, ["controller.candidates=[8,4]"])
    assert "strictly increasing" in msg
    msg = error_of(None, ["controller.hybrid.radius=0"])
    assert msg.endswith("controller.hybrid.radius = 0 is out of range; allowed: >= 1")
    msg = error_of(None, ["sim.controllers=[fixed:8,adaptive]"])
    assert "controller spec 'adaptive' is not allowed" in msg


def test_bad_yaml_and_missing_file(tmp_path):
    msg = error_of(write(tmp_path, "sim:\n  steps: [1,\n"))
    assert "not valid YAML" in msg
    msg = error_of(tmp_path / "nope.yaml")
    assert "cannot read the config file" in msg
    assert "must be a mapping" in error_of(write(tmp_path, "- 1\n- 2\n"))


def test_cli_config_prints_the_resolved_config(tmp_path, capsys):
    path = write(tmp_path, "controller:\n  tau: 2.0\n")
    assert main(["config", "--config", str(path), "--set", "sim.steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["controller"]["tau"] == 2.0
    assert printed["sim"]["steps"] == 7


def test_cli_bad_input_is_one_line_exit_2_no_traceback(tmp_path):
    path = write(tmp_path, "sim:\n  stepz: 3\n")
    for args in (["config", "--config", str(path)], ["simulate", "--set", "sim.steps=-1"]):
        proc = subprocess.run(
            [sys.executable, "-m", "sagc_jax", *args], capture_output=True, text=True
        )
        assert proc.returncode == 2
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert "Traceback" not in proc.stderr


MOVED = [
    ("controller.sagc.candidates", "[2, 4]", "controller.candidates"),
    ("controller.sagc.delta", "0.2", "controller.delta"),
    ("controller.sagc.tau", "2.5", "controller.tau"),
    ("controller.sagc.scope", "batch", "controller.scope"),
    ("controller.sagc.g_init", "4", "controller.g_init"),
    ("controller.sagc.gamma", "0.9", "controller.sagc.posterior_gamma"),
    ("controller.sagc_plus.gamma", "0.8", "controller.sagc_plus.trial_gamma"),
    ("controller.hybrid.rollout_budget", "128", "controller.hybrid.rows_per_step"),
]


@pytest.mark.parametrize(("old", "value", "new"), MOVED, ids=[m[0] for m in MOVED])
def test_a_moved_key_fails_naming_its_new_key(tmp_path, old, value, new):
    section, own, key = old.split(".")
    path = write(tmp_path, f"train:\n  steps: 5\n{section}:\n  {own}:\n    {key}: {value}\n")
    assert error_of(path) == f"{path}:5: {old} moved to {new}"
    assert error_of(None, [f"{old}={value}"]) == f"--set {old}={value}: {old} moved to {new}"
    node = to_dict(load_config(None, [f"{new}={value}"]))  # the new key takes the same value
    for part in new.split("."):
        node = node[part]
    assert node == yaml.safe_load(value)


def test_every_moved_key_is_gone_and_its_new_key_exists():
    from sagc_jax.config import MOVED_KEYS

    assert {old: new for old, _, new in MOVED} == MOVED_KEYS
    keys, stack = set(), [("", to_dict(Config()))]
    while stack:
        prefix, values = stack.pop()
        for k, v in values.items():
            if isinstance(v, dict):
                stack.append((f"{prefix}{k}.", v))
            else:
                keys.add(prefix + k)
    for old, new in MOVED_KEYS.items():
        assert old not in keys and new in keys, (old, new)


def test_the_controllers_share_the_budget_and_own_their_knobs():
    """The ladder, tau, scope, delta and g_init of controller.* reach every controller; each
    controller's own knobs come from its own section, and no knob name has two defaults."""
    import dataclasses

    from sagc_jax.config import (
        ControllerConfig,
        HybridConfig,
        SAGCConfig,
        SAGCPlusConfig,
        SAGCValueConfig,
    )
    from sagc_jax.controller import make_controller

    shared = ["controller.candidates=[2,4,8,16]", "controller.tau=2.5", "controller.scope=batch"]
    cfg = load_config(None, [*shared, "controller.delta=0.2", "controller.g_init=4"]).controller
    for spec in ("sagc", "sagc_plus", "sagc_value", "hybrid", "hybrid:per_prompt"):
        ctrl = make_controller(spec, cfg)
        assert (ctrl.candidates, ctrl.tau, ctrl.scope) == ((2, 4, 8, 16), 2.5, "batch"), spec
        assert (ctrl.delta, ctrl.candidates[ctrl.rung]) == (0.2, 4), spec  # g_init
    fixed = make_controller("fixed:8", cfg)
    assert (fixed.tau, fixed.scope) == (2.5, "batch")

    cfg = load_config(None, ["controller.sagc.radius=2", "controller.hybrid.radius=3"]).controller
    assert make_controller("sagc", cfg).config.radius == 2
    assert make_controller("hybrid", cfg).config.radius == 3
    cfg = load_config(None, ["controller.sagc_plus.trial_gamma=0.5"]).controller
    assert make_controller("sagc_plus", cfg).plus.trial_gamma == 0.5

    defaults: dict[str, set] = {}
    for cls in (ControllerConfig, SAGCConfig, SAGCPlusConfig, SAGCValueConfig, HybridConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:  # the subsections have factories
                defaults.setdefault(f.name, set()).add(repr(f.default))
    assert {k: v for k, v in defaults.items() if len(v) > 1} == {}


def test_unknown_section_in_a_set_blames_the_set(tmp_path):
    path = write(tmp_path, "train:\n  steps: 5\n")
    for config in (None, path):
        msg = error_of(config, ["train.seed=1", "trian.steps=3"])
        assert msg.startswith("--set trian.steps=3: unknown key 'trian'; did you mean 'train'?")


def test_prompt_buckets_auto_or_a_list():
    assert load_config(None, ["sampling.prompt_buckets=auto"]).sampling.prompt_buckets == "auto"
    assert load_config(None, ["sampling.prompt_buckets=[8,16]"]).sampling.prompt_buckets == (8, 16)
    msg = error_of(None, ["sampling.prompt_buckets=automatic"])
    assert "prompt_buckets = 'automatic' is not allowed" in msg and "or 'auto'" in msg
    assert "must be strictly increasing" in error_of(None, ["sampling.prompt_buckets=[16,8]"])
    assert "choose one of ['error', 'skip']" in error_of(None, ["data.on_long_prompt=drop"])


def test_the_commands_without_config_are_the_ones_the_docs_name():
    import sagc_jax.cli as cli

    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    without = sorted(n for n, p in commands.items() if "--config" not in p._option_string_actions)
    assert without == ["export", "fetch-model", "report", "tokenizer"]
    doc = " ".join(cli.__doc__.split())
    said = "Every subcommand but ``report RUN``, ``export RUN OUT``, ``tokenizer`` and "
    assert said + "``fetch-model`` takes" in doc
    readme = " ".join((ROOT / "README.md").read_text().split())
    said = (
        "Every subcommand but `report RUN`, `export RUN OUT`, `tokenizer` and `fetch-model` takes "
        "`--config FILE`"
    )
    assert said in readme


def test_the_config_reference_page_is_current_and_every_key_has_a_meaning(capsys):
    page = reference_markdown()  # the kinds' names and help from their tables
    assert (ROOT / "docs" / "config.md").read_text() == page, (
        "docs/config.md is stale: run `sagc-jax config --reference > docs/config.md`"
    )
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    keys = {row.split("`")[1] for row in rows}
    for section, values in to_dict(load_config(None)).items():  # every key, nested ones too
        stack = [(section, values)]
        while stack:
            prefix, value = stack.pop()
            if isinstance(value, dict):
                stack += [(f"{prefix}.{k}", v) for k, v in value.items()]
            else:
                assert prefix in keys, prefix
    assert len(keys) == len(rows)
    assert [row.split("`")[1] for row in rows if row.rstrip().endswith("|  |")] == []
    assert main(["config", "--reference"]) == 0
    assert capsys.readouterr().out == page


def test_what_a_changed_key_means_is_a_property_of_its_option():
    from sagc_jax.config import changed_keys, config_over_saved

    saved = to_dict(load_config(None))
    cfg = load_config(
        None,
        [
            "train.steps=7",  # a resume may change it
            "mesh.fsdp=2",  # the whole section may
            "train.learning_rate=0.5",  # not resumable, not the warm start's
            "sft.checkpoint_every=3",  # the warm start's section, but not the warm start
            "sampling.max_new_tokens=9",  # shapes the warm start, outside its sections
            "model.param_dtype=bfloat16",  # shapes the stored parameters
        ],
    )
    assert changed_keys(saved, cfg, "unresumable") == [
        "model.param_dtype",
        "sampling.max_new_tokens",
        "sft.checkpoint_every",
        "train.learning_rate",
    ]
    assert changed_keys(saved, cfg, "warm_start") == [
        "model.param_dtype",
        "sampling.max_new_tokens",
    ]
    assert changed_keys(saved, cfg, "params") == ["model.param_dtype"]
    # a key since removed: not resumable, the warm start's when its section is
    saved["data"]["retired"], saved["logging"]["retired"] = 1, 1
    assert "data.retired" in changed_keys(saved, cfg, "unresumable")
    assert "data.retired" in changed_keys(saved, cfg, "warm_start")
    assert "logging.retired" not in changed_keys(saved, cfg, "unresumable")
    with pytest.raises(ValueError, match="allowed: unresumable, warm_start, params"):
        changed_keys(saved, cfg, "resumable")

    del saved["data"]["retired"], saved["logging"]["retired"]
    assert config_over_saved(saved, ["train.steps=3"], "RUN").train.steps == 3
    with pytest.raises(ConfigError, match="^--set over the config saved in RUN: train.steps"):
        config_over_saved(saved, ["train.steps=0"], "RUN")


def test_hybrid_rules_across_sections_are_config_errors():
    with pytest.raises(ConfigError, match="needs train.batch_mode = prompts"):
        load_config(None, ["controller.kind=hybrid", "train.batch_mode=budget"])
    per_prompt = ["controller.kind=hybrid", "controller.hybrid.mode=per_prompt"]
    assert load_config(None, per_prompt).controller.hybrid.rows_per_step == 0  # P x G rows
    with pytest.raises(ConfigError, match="rows_per_step = 20 cannot be split into"):
        load_config(None, [*per_prompt, "controller.hybrid.rows_per_step=20"])
