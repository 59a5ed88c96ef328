from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from utils.core.config import ConfigError, config_to_dict, parse_config, save_config


@dataclass
class Config:
    """A train script's hyper-parameters."""

    model_name_or_path: str = "tiny"
    learning_rate: float = 1e-6
    num_generations: int = 8
    beta: float = 0.0
    epsilon_high: Optional[float] = None
    loss_type: str = field(default="dapo", metadata={"choices": ["grpo", "bnpo", "dr_grpo", "dapo"],
                                                     "help": "how the token losses are normalised"})
    scale_rewards: Literal["group", "batch", "none"] = "group"
    gradient_checkpointing: bool = False
    push_to_hub: bool = True
    reward_funcs: list[str] = field(default_factory=lambda: ["accuracy", "format"])
    reward_weights: Optional[list[float]] = None
    model_init_kwargs: Optional[dict] = None
    image_size: tuple[int, int] = (84, 84)


def write(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_arguments():
    cfg = parse_config(Config, [])
    assert cfg == Config()


def test_yaml_sets_values_and_cli_overrides_it(tmp_path):
    recipe = write(tmp_path, "learning_rate: 1e-5\nnum_generations: 4\nbeta: 0.04\nreward_funcs: [cpr]\n")
    cfg = parse_config(Config, ["--config", str(recipe), "--num_generations", "16"])
    # "1e-5" without a dot is a *string* to PyYAML: it must still become a float
    assert cfg.learning_rate == pytest.approx(1e-5) and isinstance(cfg.learning_rate, float)
    assert cfg.num_generations == 16  # CLI wins over the YAML
    assert cfg.beta == pytest.approx(0.04)
    assert cfg.reward_funcs == ["cpr"]


def test_unknown_yaml_key_names_file_key_and_suggestion(tmp_path):
    recipe = write(tmp_path, "num_generation: 4\n", name="my_recipe.yaml")
    with pytest.raises(ConfigError) as err:
        parse_config(Config, ["--config", str(recipe)])
    message = str(err.value)
    assert "my_recipe.yaml" in message and "'num_generation'" in message and "'num_generations'" in message


def test_bad_yaml_value_names_file_and_key(tmp_path):
    recipe = write(tmp_path, "num_generations: lots\n")
    with pytest.raises(ValueError, match=r"recipe.yaml: key 'num_generations'.*'lots'"):
        parse_config(Config, ["--config", str(recipe)])


def test_unknown_cli_flag_is_an_error():
    with pytest.raises(SystemExit, match=r"unrecognized arguments: --num_generationz.*did you mean --num_generations"):
        parse_config(Config, ["--num_generationz", "4"])


def test_bool_flag_forms():
    assert parse_config(Config, ["--gradient_checkpointing"]).gradient_checkpointing is True
    assert parse_config(Config, ["--gradient_checkpointing", "true"]).gradient_checkpointing is True
    assert parse_config(Config, ["--push_to_hub", "false"]).push_to_hub is False
    assert parse_config(Config, ["--push-to-hub", "no"]).push_to_hub is False
    with pytest.raises(ConfigError, match="--push_to_hub"):
        parse_config(Config, ["--push_to_hub", "maybe"])


def test_list_fields_space_or_comma_separated():
    assert parse_config(Config, ["--reward_funcs", "a", "b", "c"]).reward_funcs == ["a", "b", "c"]
    assert parse_config(Config, ["--reward_funcs", "a,b", "c"]).reward_funcs == ["a", "b", "c"]
    cfg = parse_config(Config, ["--reward_weights", "0.65,0.35"])
    assert cfg.reward_weights == [0.65, 0.35] and all(isinstance(w, float) for w in cfg.reward_weights)
    cfg = parse_config(Config, ["--reward_weights", "1", "-0.5"])
    assert cfg.reward_weights == [1.0, -0.5]
    with pytest.raises(ConfigError, match="--reward_weights"):
        parse_config(Config, ["--reward_weights", "0.5,heavy"])


def test_yaml_list_and_optional_none(tmp_path):
    recipe = write(tmp_path, "reward_weights: [0.6, 0.4]\nepsilon_high: 0.28\n")
    cfg = parse_config(Config, ["--config", str(recipe), "--epsilon_high", "none"])
    assert cfg.reward_weights == [0.6, 0.4]
    assert cfg.epsilon_high is None
    assert parse_config(Config, ["--reward_weights", "null"]).reward_weights is None
    with pytest.raises(ConfigError, match="--num_generations"):
        parse_config(Config, ["--num_generations", "none"])  # not Optional


def test_choices_enforced_on_cli_and_yaml(tmp_path):
    assert parse_config(Config, ["--loss_type", "grpo"]).loss_type == "grpo"
    with pytest.raises(ConfigError, match=r"--loss_type.*'dr-grpo'.*did you mean 'dr_grpo'"):
        parse_config(Config, ["--loss_type", "dr-grpo"])
    recipe = write(tmp_path, "scale_rewards: groups\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml: key 'scale_rewards'.*'groups'"):
        parse_config(Config, ["--config", str(recipe)])


def test_help_shows_field_help_choices_and_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(Config, ["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "how the token losses are normalised" in out
    assert "dr_grpo" in out and "--config" in out and "(default: 8)" in out


def test_tuple_field_stays_a_tuple():
    assert parse_config(Config, ["--image_size", "64,48"]).image_size == (64, 48)


def test_dict_field_from_json_on_cli():
    cfg = parse_config(Config, ["--model_init_kwargs", '{"torch_dtype": "bfloat16"}'])
    assert cfg.model_init_kwargs == {"torch_dtype": "bfloat16"}


def test_missing_recipe_file_names_path(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        parse_config(Config, ["--config", str(tmp_path / "nope.yaml")])


def test_save_config_round_trips(tmp_path):
    cfg = parse_config(Config, ["--reward_weights", "0.7", "0.3", "--beta", "0.01", "--push_to_hub", "false"])
    as_dict = config_to_dict(cfg)
    assert as_dict["reward_weights"] == [0.7, 0.3] and as_dict["push_to_hub"] is False
    path = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert parse_config(Config, ["--config", str(path)]) == cfg
