"""Every recipe parses into its script's config with the published settings."""

import glob
import os

import pytest
import yaml

from utils.config import config_to_dict, parse_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def grpo_config(name):
    from train_grpo import GRPOConfig

    return parse_config(GRPOConfig, ["--config", os.path.join(REPO, "recipes", name)])


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "recipes", "*.yaml"))))
def test_every_recipe_parses_to_the_values_it_writes(path):
    """Each key a recipe sets reaches its script's config with the value written there, and every recipe
    names its own output folder (so two recipes never write into the default one)."""
    name = os.path.basename(path)
    if "sft" in name:
        from train_sft import SFTConfig as Config
    elif "mixgrpo" in name or name.startswith("r3_"):
        from train_mixgrpo import MixGRPOConfig as Config
    else:
        from train_grpo import GRPOConfig as Config
    with open(path) as f:
        written = yaml.safe_load(f)
    cfg = config_to_dict(parse_config(Config, ["--config", path]))
    assert "output_dir" in written and written["output_dir"] != Config.output_dir, name
    for key, value in written.items():
        if key == "config":
            continue
        got = cfg[key]
        if isinstance(value, str) and value.lower() == "none":
            value = None  # how the config reads an explicit 'none'
        if isinstance(got, float) or (isinstance(got, list) and got and isinstance(got[0], float)):
            value = [float(v) for v in value] if isinstance(value, list) else float(value)  # YAML reads 1e-5 as text
        assert got == value, (name, key, got, value)


def test_crystal_recipes_carry_the_published_settings():
    phase1 = grpo_config("crystal_answer_only.yaml")
    assert (phase1.reward_funcs, phase1.learning_rate, phase1.num_generations) == (["format", "accuracy"], 1e-5, 5)
    assert phase1.reward_weights == [2.0, 2.0] and phase1.per_device_train_batch_size == 5
    cpr = grpo_config("crystal_cpr.yaml")
    assert cpr.reward_kwargs == {"cpr": {"answer_weight": 0.6, "step_weight": 0.4}} and cpr.allow_double_accuracy
    phase2 = grpo_config("crystal_phase2.yaml")
    assert phase2.learning_rate == 5e-6 and phase2.reward_kwargs["cpr"] == {"answer_weight": 0.65, "step_weight": 0.35}
    assert "accuracy" not in phase2.reward_funcs  # CPR carries the answer term: counted once
    spr = grpo_config("crystal_spr.yaml")
    assert spr.reward_weights == [3.0, 1.0, 3.0] and spr.reward_kwargs["spr"]["threshold"] == 0.70


def test_openvlthinker_grpo_recipes():
    for stage in ("medium", "hard"):
        cfg = grpo_config(f"openvlthinker_grpo_{stage}.yaml")
        assert cfg.curriculum == [stage]
        assert (cfg.num_generations, cfg.learning_rate, cfg.beta) == (5, 1e-6, 0.01)
        assert (cfg.epsilon, cfg.epsilon_high, cfg.temperature, cfg.top_p) == (0.2, 0.3, 1.0, 0.99)
