"""The scripts' command lines: without --config the tiny recipe runs under the flags given (each flag changes only
itself), --config replaces it, a model of one's own starts from the defaults; --help opens with a paragraph and
lists every flag in a group; the image/video flag group and the model loader's flags are shared."""

import dataclasses

import pytest
import yaml

import distill
import evaluate
import iterate
import train_grpo
import train_mixgrpo
import train_sft
from utils.core.config import build_parser, flag_groups, parse_config
from utils.core.config_notes import GROUPS, group_topics
from utils.core.flags import ImageVideoFlags
from utils.core.models import model_flags

# script, its config class, its tiny recipe, a model flag and a model of one's own for it
SCRIPTS = [
    (train_grpo, train_grpo.GRPOConfig, train_grpo.TINY_RECIPE, "model_name_or_path"),
    (train_sft, train_sft.SFTConfig, train_sft.TINY_SFT_RECIPE, "model_name_or_path"),
    (train_mixgrpo, train_mixgrpo.MixGRPOConfig, train_mixgrpo.TINY_MIXGRPO_RECIPE, "generator_name_or_path"),
    (iterate, iterate.IterateConfig, iterate.TINY_CYCLES_RECIPE, "base_model"),
    (distill, distill.DistillConfig, distill.TINY_DISTILL_RECIPE, "reasoner_base_url"),
]
IDS = [script.__name__ for script, *_ in SCRIPTS]


def recipe_of(path):
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("script,config,recipe,_", SCRIPTS, ids=IDS)
def test_a_flag_changes_only_itself_over_the_tiny_recipe(script, config, recipe, _):
    tiny = parse_config(config, ["--config", recipe])
    assert script.parse_args([]) == tiny  # no flags: the tiny recipe
    seeded = script.parse_args(["--seed", "7"])
    assert seeded == dataclasses.replace(tiny, seed=7) and tiny.seed != 7
    if "max_steps" in recipe_of(recipe):  # the demo for longer: the same recipe, more steps
        assert script.parse_args(["--max_steps", "100"]) == dataclasses.replace(tiny, max_steps=100)


@pytest.mark.parametrize("script,flag,value,follower", [
    (train_grpo, "reward_funcs", "accuracy", "reward_weights"),
    (train_mixgrpo, "reward_fn", "pickscore", "reward_kwargs")], ids=["train_grpo", "train_mixgrpo"])
def test_a_flag_takes_the_recipe_values_that_only_fit_its_old_value_with_it(script, flag, value, follower):
    """The tiny GRPO recipe weighs its two rewards [0.5, 1.0]; --reward_funcs with one reward of one's own gets it
    at weight 1 (not "2 weights for 1 reward"); Mix-GRPO's recipe passes its tiny scorer's options, which another
    reward would refuse. Given with the flag, or under a --config, they stay."""
    config = type(script.parse_args([]))
    default = getattr(config(), follower)
    assert getattr(script.parse_args([]), follower) != default  # the recipe sets it
    changed = script.parse_args([f"--{flag}", value])
    assert getattr(changed, flag) in (value, [value]) and getattr(changed, follower) == default
    kept = {"reward_weights": ["2"], "reward_kwargs": ['{"divisor": 26}']}[follower]
    both = script.parse_args([f"--{flag}", value, f"--{follower}", *kept])
    assert getattr(both, follower) in ([2.0], {"divisor": 26})


@pytest.mark.parametrize("script,config,recipe,model_flag", SCRIPTS, ids=IDS)
def test_a_model_of_ones_own_or_a_config_starts_from_the_defaults(script, config, recipe, model_flag, tmp_path):
    own = script.parse_args([f"--{model_flag}", "/models/mine", "--seed", "7"])
    assert own == dataclasses.replace(config(), **{model_flag: "/models/mine", "seed": 7})
    other = tmp_path / "other.yaml"
    other.write_text("seed: 5\n")
    assert script.parse_args(["--config", str(other)]) == dataclasses.replace(config(), seed=5)
    # the tiny recipe's own model names keep it
    if model_flag != "reasoner_base_url":
        tiny = parse_config(config, ["--config", recipe])
        assert script.parse_args([f"--{model_flag}", "tiny"]) == dataclasses.replace(tiny, **{model_flag: "tiny"})


@pytest.mark.parametrize("config", [c for _, c, *_ in SCRIPTS] + [evaluate.EvalConfig], ids=IDS + ["evaluate"])
def test_help_opens_with_a_paragraph_then_groups(config, capsys):
    with pytest.raises(SystemExit):  # what `python <script>.py --help` prints (its parse_args builds this parser)
        parse_config(config, ["--help"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].endswith("[-h] [--config RECIPE.yaml] [--FLAG VALUE ...]") and lines[1] == ""
    paragraph = lines[2:lines.index("", 2)]
    assert len(paragraph) >= 2 and "Config(" not in out  # a description, not the dataclass's signature
    headings = [line for line in lines if line.endswith(":") and line[:1].isalpha() and line != "options:"]
    assert len(headings) >= 4  # flags under group headings


@pytest.mark.parametrize("config", [c for _, c, *_ in SCRIPTS] + [evaluate.EvalConfig],
                         ids=IDS + ["evaluate"])
def test_every_flag_is_in_a_named_group_with_a_help(config):
    groups = flag_groups(config)
    assert all(heading for heading, _ in groups), [names for heading, names in groups if not heading]
    parser_help = {a.dest: a.help for a in build_parser(config)._actions}
    assert all(parser_help[name].split(" (default:")[0] for _, names in groups for name in names)


def test_the_image_and_video_flags_are_one_group_the_three_scripts_include():
    shared = [f.name for f in dataclasses.fields(ImageVideoFlags)]
    for config in (train_grpo.GRPOConfig, train_sft.SFTConfig, evaluate.EvalConfig):
        assert issubclass(config, ImageVideoFlags)
        data = dict(flag_groups(config))["data"]  # in the data group, together, told in its description
        assert data[data.index(shared[0]):][:len(shared)] == shared
        assert "image and video inputs" in group_topics(config)["data"]


def test_model_flags_spell_the_loaders_arguments_once():
    cfg = train_grpo.GRPOConfig(dtype="float32", attn_implementation="eager", freeze_vision_tower=True,
                                max_pixels=1000, min_pixels=10, max_anyres_num=2)
    assert model_flags(cfg) == dict(dtype="float32", attn_implementation="eager", freeze_vision_tower=True,
                                    max_pixels=1000, min_pixels=10, max_anyres_num=2)
    # a script without --freeze_vision_tower loads unfrozen; overrides win
    assert model_flags(evaluate.EvalConfig())["freeze_vision_tower"] is False
    assert model_flags(cfg, freeze_vision_tower=False)["freeze_vision_tower"] is False


@pytest.mark.parametrize("config,own", [(train_grpo.GRPOConfig, []), (train_sft.SFTConfig, []),
                                        (train_mixgrpo.MixGRPOConfig, []), (evaluate.EvalConfig, ["scoring"])],
                         ids=["train_grpo", "train_sft", "train_mixgrpo", "evaluate"])
def test_help_groups_are_the_shared_ones_in_their_order(config, own, capsys):
    headings = [heading for heading, _ in flag_groups(config)]
    assert headings == [g for g in GROUPS if g in headings] + own  # a script's own groups only after them
    if config is train_grpo.GRPOConfig:
        assert headings == list(GROUPS)
    with pytest.raises(SystemExit):
        parse_config(config, ["--help"])
    out = capsys.readouterr().out
    positions = [out.index(f"\n{heading}:\n") for heading in headings]
    assert positions == sorted(positions)
    # the run skeleton's flags land in their groups
    if config is not evaluate.EvalConfig:
        groups = dict(flag_groups(config))
        assert {"ddp_timeout", "cpu_threads"} <= set(groups["distributed"])
        assert {"push_to_hub", "hub_model_id", "hub_private_repo"} == set(groups["hub"])
        assert {"max_skipped_steps", "learning_rate"} <= set(groups["training"])
        assert {"save_steps", "overwrite_output_dir", "output_dir"} <= set(groups["logging"])
