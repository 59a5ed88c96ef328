"""The R3 recipes parse to R3's published settings; the tiny recipe is what the script runs without arguments."""

import os

import pytest

import train_mixgrpo as tm
from utils.core.config import parse_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
R3 = dict(ce_weight=1.0, mse_weight=2.0, kl_weight_text=1e-3, kl_weight_image=1e-3, learning_rate=5e-6,
          lr_scheduler_type="constant_with_warmup", warmup_steps=10, adam_beta1=0.9, adam_beta2=0.95,
          adam_epsilon=1e-8, max_grad_norm=1.0, clip_range_text=0.2, clip_range_image=0.2, group_size=16,
          policy_group_size=4, cfg_scale_gen=4.0, cfg_interval=[0.4, 1.0], noise_level_gen=0.7, timestep_shift=3.0,
          temperature=0.9, scale_advantages=False, enable_sde_gen=True, tune_text_cot=True, tune_image_cot=True,
          model_name_or_path="Qwen/Qwen2.5-VL-7B-Instruct", generator_name_or_path="Qwen/Qwen-Image",
          reflect_refine=True, edit_generator_name_or_path="Qwen/Qwen-Image-Edit", noise_level_edit=1.0,
          cfg_scale_edit=4.0, cfg_img_scale_edit=1.5, max_sde_timestep_idx_for_edit=2, perfect_buffer_prob=0.15,
          enable_sde_edit=True, image_size=512,
          # sen-ye/R3's scripts/train_rl.sh at its latest commit (its first: warm-up 30, temperature 0.8, 15 / 18 steps)
          num_timesteps_gen=16, num_timesteps_edit=21, cfg_renorm_type_gen="global",
          cfg_renorm_type_edit="text_channel", cfg_renorm_min=0.0, eval_temperature=0.3, eval_steps=50,
          eval_num_timesteps=50, eval_refine_rounds=3)


@pytest.mark.parametrize("name, dataset, reward", [
    ("r3_geneval.yaml", "geneval", "geneval"),
    ("r3_geneval_plus.yaml", "geneval_plus", "judge_geneval_plus"),
    ("r3_tiif.yaml", "tiif", "judge_tiif"),
])
def test_r3_recipes_hold_r3_settings(name, dataset, reward):
    cfg = parse_config(tm.MixGRPOConfig, ["--config", os.path.join(REPO, "recipes", name)])
    for key, value in R3.items():
        got = getattr(cfg, key)
        assert got == (pytest.approx(value) if isinstance(value, float) else value), key
    assert (cfg.dataset_name, cfg.reward_fn) == (dataset, reward)
    # The prompt files must be given: the tiny shapes set is refused for these schemas, before anything loads.
    with pytest.raises(ValueError, match="--train_data_path tiny"):
        tm.validate(cfg, 4)
    cfg.train_data_path = cfg.val_data_path = "prompts.jsonl"
    tm.validate(cfg, 8)


def test_the_tiny_recipe_is_the_default_and_validates_on_one_process():
    assert tm.TINY_MIXGRPO_RECIPE.endswith("recipes/tiny_mixgrpo.yaml") and os.path.isfile(tm.TINY_MIXGRPO_RECIPE)
    cfg = parse_config(tm.MixGRPOConfig, ["--config", tm.TINY_MIXGRPO_RECIPE])
    tm.validate(cfg, 1)
    assert (cfg.model_name_or_path, cfg.generator_name_or_path, cfg.dataset_name, cfg.reward_fn) == \
        ("tiny", "tiny", "shapes_t2i", "shapes_t2i")
    assert cfg.reward_kwargs == {"key": "score", "behaviour": "tiny"}
    assert cfg.reflect_refine and cfg.edit_generator_name_or_path == "tiny" and cfg.eval_refine_rounds == 4  # R3's
    reason_only = parse_config(tm.MixGRPOConfig, ["--config", tm.TINY_MIXGRPO_RECIPE, "--reflect_refine", "false",
                                                  "--edit_generator_name_or_path", "none"])  # as the recipe says
    tm.validate(reason_only, 1)
    assert not reason_only.reflect_refine and reason_only.edit_generator_name_or_path is None
