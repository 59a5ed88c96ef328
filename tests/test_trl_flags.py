"""A TRL user's GRPOConfig, flag for flag, on train_grpo.py: every TRL flag is ours, handed to ours, accepted where it
runs as in TRL, or refused in one line with the reason (utils/core/trl_flags.py) - never an unknown flag."""

import dataclasses
import json

import pytest
import transformers
from packaging.version import Version

import train_grpo
from utils.core.config import ConfigError, parse_config
from utils.core.trl_flags import TRL_ONLY_FLAGS

trl = pytest.importorskip("trl")  # a dev-only install (requirements-dev.txt)

TINY = dict(max_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=8, logging_steps=1,
            use_cpu=True)


def translate(args, style):
    """TRL's GRPOConfig as a command line: every field of to_dict(), None included; lists and dicts as JSON, or
    everything through str() (Python's reprs)."""
    argv = []
    for name, value in args.to_dict().items():
        if style == "json":
            text = "None" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)
        else:
            text = str(value)
        argv += [f"--{name}", text]
    return argv


def test_every_trl_flag_is_ours_or_has_a_rule():
    ours = {f.name for f in dataclasses.fields(train_grpo.GRPOConfig)}
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig) if f.init}
    assert sorted(theirs - ours - set(TRL_ONLY_FLAGS)) == []
    stale = set(TRL_ONLY_FLAGS) - theirs  # no rule for a flag TRL does not have
    if Version(transformers.__version__) < Version("5.24"):  # the vLLM set's transformers (5.20) predates these two
        stale -= {"activation_checkpointing", "activation_checkpointing_kwargs"}  # TrainingArguments fields
    assert not stale


@pytest.mark.parametrize("style", ["json", "str"])
def test_trls_default_config_parses_and_validates(tmp_path, style):
    args = trl.GRPOConfig(output_dir=str(tmp_path), **TINY)
    cfg = parse_config(train_grpo.GRPOConfig, translate(args, style))
    train_grpo.validate(cfg, 1)
    # TRL's values where they differ from ours by default
    assert (cfg.optim, cfg.gradient_checkpointing, cfg.use_bias_correction_kl, cfg.report_to) == (
        "adamw_torch_fused", True, True, "none")
    assert (cfg.cache_implementation, cfg.top_k, cfg.disable_dropout, cfg.bf16) == (None, 0, False, True)
    assert (cfg.steps_per_generation, cfg.generation_batch_size) == (1, 8)


@pytest.mark.slow
def test_trls_config_trains_the_tiny_model(tmp_path):
    args = trl.GRPOConfig(output_dir=str(tmp_path / "run"), beta=0.04, steps_per_generation=2, bf16=False, **TINY)
    cfg = parse_config(train_grpo.GRPOConfig, translate(args, "json") + ["--eval_dataset_name", "none"])
    try:
        train_grpo.main(cfg)
    finally:
        from tests.launch_helpers import fresh_accelerate_state

        fresh_accelerate_state()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


@pytest.mark.parametrize("flag, value, message", [
    ("use_liger_kernel", "true", "Liger is not used"),
    ("eval_strategy", "steps", "held-out evaluation runs before and after training"),
    ("save_strategy", "epoch", "a checkpoint is written every --save_steps"),
    ("repetition_penalty", "1.1", "the training log-probs do not score"),
    ("hub_token", "hf_abc", "HF_TOKEN"),
    ("deepspeed", "ds.json", "accelerate_configs/zero2.yaml"),
    ("torch_compile", "True", "--cache_implementation static"),
    ("multi_objective_aggregation", "normalize_then_sum", "weighted and summed, then normalised"),
    ("label_smoothing_factor", "0.1", "GRPO's loss has no labels"),
])
def test_a_value_that_cannot_run_as_in_trl_is_refused_with_the_reason(flag, value, message):
    with pytest.raises(ConfigError, match=f"--{flag} {value}: .*{message}.*TRL's flag; only"):
        parse_config(train_grpo.GRPOConfig, [f"--{flag}", value])


def test_trls_default_values_and_inert_flags_are_accepted():
    cfg = parse_config(train_grpo.GRPOConfig, [
        "--logging_strategy", "steps", "--save_strategy", "IntervalStrategy.STEPS", "--label_smoothing_factor", "0",
        "--dataloader_num_workers", "4", "--run_name", "mine", "--debug", "--include_for_metrics", "[]",
        "--hub_token", "<HUB_TOKEN>", "--ddp_timeout", "1800"])
    assert cfg == train_grpo.GRPOConfig()


def test_flags_handed_to_ours(tmp_path):
    cfg = parse_config(train_grpo.GRPOConfig, [
        "--activation_checkpointing", "true", "--eval_on_start", "false", "--per_device_eval_batch_size", "16",
        "--vllm_importance_sampling_clip_max", "2.5", "--vllm_importance_sampling_cap", "None"])
    assert (cfg.gradient_checkpointing, cfg.eval_before, cfg.eval_batch_size, cfg.vllm_importance_sampling_cap) == (
        True, False, 16, 2.5)
    with pytest.raises(ConfigError, match="--activation_checkpointing sets --gradient_checkpointing"):
        parse_config(train_grpo.GRPOConfig, ["--activation_checkpointing", "true", "--gradient_checkpointing", "false"])
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("activation_checkpointing: true\nlogging_strategy: steps\nlearning_rate: 3.0e-6\n")
    cfg = parse_config(train_grpo.GRPOConfig, ["--config", str(recipe)])
    assert (cfg.gradient_checkpointing, cfg.learning_rate) == (True, 3e-6)
    recipe.write_text("use_liger_kernel: true\n")
    with pytest.raises(ConfigError, match="Liger is not used"):
        parse_config(train_grpo.GRPOConfig, ["--config", str(recipe)])
