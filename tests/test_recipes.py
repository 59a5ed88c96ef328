"""Every recipe parses into its script's config with the published settings."""

import glob
import os

import pytest
import yaml

from utils.core.config import config_to_dict, parse_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def grpo_config(name):
    from train_grpo import GRPOConfig

    return parse_config(GRPOConfig, ["--config", os.path.join(REPO, "recipes", name)])


def config_classes():
    """Every script's config class, as the Makefile lists them for the flag reference (module:Class)."""
    import importlib

    with open(os.path.join(REPO, "Makefile")) as f:
        line = next(line for line in f if line.startswith("FLAG_SOURCES"))
    entries = [entry.split(":") for entry in line.split(":=", 1)[1].split()]
    return [getattr(importlib.import_module(module), name) for module, name in entries]


def script_of(path):
    """(config class, parsed config as a dict) of the first script whose config reads the recipe."""
    for Config in config_classes():
        try:
            return Config, config_to_dict(parse_config(Config, ["--config", path]))
        except ValueError:  # a recipe of another script (unknown keys)
            continue
    raise AssertionError(f"{os.path.basename(path)} is a recipe of no script")


def assert_values_arrive(path, cfg):
    with open(path) as f:
        written = yaml.safe_load(f)
    for key, value in written.items():
        got = cfg[key]
        if got is None and isinstance(value, str) and value.lower() == "none":
            value = None  # how the config reads an explicit 'none'
        if isinstance(got, float) or (isinstance(got, list) and got and isinstance(got[0], float)):
            value = [float(v) for v in value] if isinstance(value, list) else float(value)  # YAML reads 1e-5 as text
        assert got == value, (os.path.basename(path), key, got, value)
    return written


RECIPES = sorted(glob.glob(os.path.join(REPO, "recipes", "*.yaml")))
STAGES = sorted(glob.glob(os.path.join(REPO, "recipes", "stages", "*.yaml")))


@pytest.mark.parametrize("path", RECIPES)
def test_every_recipe_parses_to_the_values_it_writes(path):
    """Each recipe is a recipe of some script: each key it sets reaches that script's config with the value
    written there, and it names its own output folder (so two recipes never write into a default one)."""
    Config, cfg = script_of(path)
    written = assert_values_arrive(path, cfg)
    assert "output_dir" in written and written["output_dir"] != Config.output_dir, os.path.basename(path)


@pytest.mark.parametrize("path", STAGES)
def test_every_stage_recipe_parses_to_the_values_it_writes(path):
    """Stage recipes (recipes/stages/) are run by iterate.py or the tiny cache, which pass the model, the data
    and the output folder; what they do set must still arrive unchanged."""
    _, cfg = script_of(path)
    assert_values_arrive(path, cfg)


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
    # training/scripts/train_cpr_internvl.sh: InternVL3.5-4B, lr 5e-6, 12 tiles, the InternVL phase-2 CPR weights
    internvl = grpo_config("crystal_cpr_internvl.yaml")
    assert (internvl.model_name_or_path, internvl.learning_rate, internvl.max_anyres_num, internvl.max_pixels) == (
        "OpenGVLab/InternVL3_5-4B-HF", 5e-6, 12, None)
    assert internvl.reward_funcs == ["format", "accuracy", "cpr"] and internvl.reward_weights == [2.0, 2.0, 2.0]
    assert internvl.reward_kwargs == {"cpr": {"answer_weight": 0.65, "step_weight": 0.35}}
    assert (internvl.num_generations, internvl.per_device_train_batch_size, internvl.gradient_accumulation_steps,
            internvl.num_train_epochs, internvl.save_steps, internvl.seed) == (5, 5, 2, 2, 100, 42)


def test_openvlthinker_grpo_recipes():
    for stage in ("medium", "hard"):
        cfg = grpo_config(f"openvlthinker_grpo_{stage}.yaml")
        assert cfg.curriculum == [stage]
        assert (cfg.num_generations, cfg.learning_rate, cfg.beta) == (5, 1e-6, 0.01)
        assert (cfg.epsilon, cfg.epsilon_high, cfg.temperature, cfg.top_p) == (0.2, 0.3, 1.0, 0.99)


GRPO_RECIPES = [p for p in RECIPES if script_of(p)[0].__name__ == "GRPOConfig"]


@pytest.mark.parametrize("path", GRPO_RECIPES)
def test_grpo_recipes_set_what_they_rely_on(path):
    """Defaults a TRL user knows (loss_type, max_completion_length) changed to TRL's; a recipe never leans on them."""
    with open(path) as f:
        written = yaml.safe_load(f)
    for key in ("loss_type", "max_completion_length", "num_generations", "learning_rate", "beta", "temperature",
                "reward_funcs", "prompt_template", "dataset_name"):
        assert key in written, (os.path.basename(path), key)


def test_crystal_recipes_read_the_crystal_data_set_with_its_own_columns():
    for name in ("crystal_answer_only", "crystal_cpr", "crystal_phase2", "crystal_spr", "crystal_cpr_internvl"):
        cfg = grpo_config(f"{name}.yaml")
        assert cfg.dataset_name == "waybarrios/CRYSTAL"
        assert (cfg.image_column, cfg.question_column, cfg.answer_column, cfg.steps_column, cfg.choices_column) == (
            "image", "question", "answer", "reference_steps", None)
