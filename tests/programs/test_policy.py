"""The trainer's policy made concrete from the model the plan traced once
(``programs.policy.build_sharded_policy`` over ``RunShape.policy``): the same params as building
the model directly, placed as the plan says, and one line for a checkpoint without config.json."""

import jax
import numpy as np
import pytest
from flax import nnx

from sagc_jax.config import ConfigError, MeshConfig, load_config
from sagc_jax.models import Decoder, get_preset, load_hf_checkpoint, save_hf_checkpoint
from sagc_jax.parallel import ShardingPlan
from sagc_jax.programs.policy import build_sharded_policy, preset_architecture
from sagc_jax.programs.state import abstract_policy


def _plan():
    return ShardingPlan.from_config(MeshConfig(1, 1, 1), jax.devices()[:1])


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_checkpoint_is_read_into_the_traced_model(tmp_path):
    arch = get_preset("tiny")
    save_hf_checkpoint(Decoder(arch, rngs=nnx.Rngs(3)), arch, str(tmp_path / "hf"))
    loaded, loaded_arch = load_hf_checkpoint(str(tmp_path / "hf"))
    abstract = abstract_policy(loaded_arch, _plan())
    policy = build_sharded_policy(abstract, str(tmp_path / "hf"), seed=0)
    _leaves_equal(policy.params, nnx.split(loaded)[1])
    assert policy.arch == loaded_arch
    placed = zip(jax.tree.leaves(policy.params), jax.tree.leaves(abstract.shardings), strict=True)
    assert all(x.sharding == s for x, s in placed)


def test_a_preset_is_initialised_from_the_seed():
    arch = preset_architecture(load_config(None, ["model.preset=tiny"]).model)
    policy = build_sharded_policy(abstract_policy(arch, _plan()), None, seed=5)
    _leaves_equal(policy.params, nnx.split(Decoder(arch, rngs=nnx.Rngs(5)))[1])


def test_a_checkpoint_directory_without_config_json_is_one_line(tmp_path):
    abstract = abstract_policy(get_preset("tiny"), _plan())
    with pytest.raises(ConfigError) as err:
        build_sharded_policy(abstract, str(tmp_path), seed=0)
    assert str(err.value) == (
        f"model.hf_checkpoint = {tmp_path}: no config.json there; a Hugging Face checkpoint "
        "directory holds config.json and its .safetensors"
    )
