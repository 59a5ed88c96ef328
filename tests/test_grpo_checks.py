"""train_grpo.py's up-front checks and small helpers, without training: every impossible flag combination fails in
validate() with one line naming the flag, bad input ends the script in one line, and the dynamic-sampling and
truncation helpers do what the docs say."""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

import train_grpo
from train_grpo import GRPOConfig, build_rewards, validate
from utils.core.config import ConfigError
from utils.core.groups import choose_groups, has_spread, refill_sizes
from utils.core.rollout import truncated_completions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (flags, processes, distributed type, the message) -- every combination that cannot work
IMPOSSIBLE = [
    (dict(per_device_train_batch_size=6, num_generations=4), 1, "NO", r"6 x 1 processes = 6 .*--num_generations 4"),
    (dict(per_device_train_batch_size=2, num_generations=4), 1, "NO", "not a multiple of --num_generations 4"),
    (dict(num_generations=1, per_device_train_batch_size=4), 1, "NO", "--num_generations 1: a group of one"),
    (dict(num_generations=1, per_device_train_batch_size=4, scale_rewards="none"), 1, "NO",
     "every --scale_rewards"),
    (dict(per_device_train_batch_size=0), 1, "NO", "--per_device_train_batch_size 0"),
    (dict(gradient_accumulation_steps=0), 1, "NO", "--gradient_accumulation_steps"),
    (dict(num_iterations=0), 1, "NO", "--num_iterations"),
    (dict(max_completion_length=0), 1, "NO", "--max_completion_length"),
    (dict(max_prompt_length=0), 1, "NO", "--max_prompt_length"),
    (dict(temperature=0.0), 1, "NO", "--temperature"),
    (dict(top_p=0.0), 1, "NO", "--top_p"),
    (dict(top_k=-1), 1, "NO", "--top_k"),
    (dict(epsilon_high=-0.1), 1, "NO", "--epsilon_high"),
    (dict(beta=-0.1), 1, "NO", "--beta"),
    (dict(max_grad_norm=-1.0), 1, "NO", "--max_grad_norm"),
    (dict(warmup_ratio=1.0), 1, "NO", "--warmup_ratio"),
    (dict(max_steps=-1, num_train_epochs=0.0), 1, "NO", "--num_train_epochs"),
    (dict(use_peft=True, lora_dropout=1.0), 1, "NO", "--lora_dropout"),
    (dict(loss_type="ppo"), 1, "NO", "--loss_type 'ppo'"),
    (dict(scale_rewards="global"), 1, "NO", "--scale_rewards 'global'"),
    (dict(importance_sampling_level="step"), 1, "NO", "--importance_sampling_level"),
    (dict(reward_funcs=[]), 1, "NO", "--reward_funcs is empty"),
    (dict(reward_funcs=["format", "format"]), 1, "NO", "names a reward twice"),
    (dict(reward_funcs=["format", "accuracy"], reward_weights=[1.0]), 1, "NO", "--reward_weights has 1 values for 2"),
    (dict(reward_kwargs={"cpr": {}}), 1, "NO", r"--reward_kwargs names \['cpr'\]"),
    (dict(reward_funcs=["format", "accuracy", "cpr"]), 1, "NO", "--allow_double_accuracy"),
    (dict(use_pcgrad=True, reward_funcs=["format", "accuracy"]), 2, "DEEPSPEED", "--use_pcgrad.*DeepSpeed"),
    (dict(dynamic_sampling=True, max_resample_rounds=-1), 1, "NO", "--max_resample_rounds"),
    (dict(curriculum=["medium", "expert"]), 1, "NO", r"--curriculum \['expert'\]"),
    (dict(curriculum=["hard"], difficulty_samples=-1), 1, "NO", "--difficulty_samples"),
    (dict(curriculum=["hard"], difficulty_samples=4, difficulty_reward="math_accuracy"), 1, "NO",
     "--difficulty_reward 'math_accuracy'"),
    (dict(difficulty_thresholds=[0.7, 0.3]), 1, "NO", "--difficulty_thresholds"),
    (dict(push_to_hub=True), 1, "NO", "--push_to_hub needs --hub_model_id"),
    (dict(save_steps=0), 1, "NO", "--save_steps"),
    (dict(num_completions_to_print=-1), 1, "NO", "--num_completions_to_print"),
    (dict(eval_samples=0), 1, "NO", "--eval_samples"),
    (dict(cpu_threads=0), 1, "NO", "--cpu_threads"),
]


@pytest.mark.parametrize("flags,processes,distributed,message", IMPOSSIBLE)
def test_every_impossible_combination_fails_in_validate(flags, processes, distributed, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(GRPOConfig(**flags), processes, distributed)
    assert "\n" not in str(err.value)


def test_a_valid_configuration_passes():
    validate(GRPOConfig(), 1)
    validate(GRPOConfig(per_device_train_batch_size=4, num_generations=8), 2)  # a group may span processes
    validate(GRPOConfig(use_pcgrad=True), 2, "MULTI_CPU")


def test_main_refuses_before_loading_a_model(monkeypatch, tmp_path):
    def no_model(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(train_grpo, "load_model_and_processor", no_model)
    from accelerate.state import AcceleratorState, GradientState

    try:
        with pytest.raises(ConfigError, match="--num_generations 1"):
            train_grpo.main(GRPOConfig(num_generations=1, per_device_train_batch_size=4, output_dir=str(tmp_path),
                                       report_to="none"))
        # a reward written for TRL that needs a column the data does not have: refused before the model loads
        with pytest.raises(ConfigError, match="needs 'solution'"):
            train_grpo.main(GRPOConfig(reward_funcs=["trl.rewards:accuracy_reward"], output_dir=str(tmp_path),
                                       model_name_or_path="tiny", report_to="none"))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_overlong_penalty_gets_the_generation_budget():
    fn, = build_rewards(GRPOConfig(reward_funcs=["overlong_penalty"], max_completion_length=40), ["answer"])
    assert fn.options["max_completion_length"] == 40 and fn.options["buffer_length"] == 10
    assert fn(["x"] * 3, completion_ids=[[1] * 30, [1] * 35, [1] * 40]) == pytest.approx([0.0, -0.5, -1.0])
    with pytest.raises(ConfigError, match="--reward_funcs overlong_penalty: .*buffer_length"):
        build_rewards(GRPOConfig(reward_funcs=["overlong_penalty"], max_completion_length=40,
                                 reward_kwargs={"overlong_penalty": {"buffer_length": 50}}), [])
    with pytest.raises(ConfigError, match="--reward_funcs nope: unknown reward 'nope'"):
        build_rewards(GRPOConfig(reward_funcs=["nope"]), [])


def test_spread_is_judged_on_the_scorable_weighted_rewards():
    nan = math.nan
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0],     # constant: no spread
                            [1.0, 0.0], [0.0, 0.0],     # varies
                            [2.0, nan], [nan, nan],     # one scorable completion: no spread
                            [1.0, 0.0], [0.0, 1.0]])    # weighted 1 vs 1: no spread, but each reward varies
    weights = torch.tensor([1.0, 1.0])
    assert has_spread(rewards, weights, 2).tolist() == [False, True, False, False]
    assert has_spread(rewards, weights, 2, per_objective=True).tolist() == [False, True, False, True]
    groups = [dict(name=i, spread=s) for i, s in enumerate([False, True, False, True, True])]
    assert [g["name"] for g in choose_groups(groups, 2)] == [1, 3]
    # resample rounds ran out: groups without spread fill the rest, in order
    assert [g["name"] for g in choose_groups(groups, 5)] == [1, 3, 4, 0, 2]


def test_refills_draw_as_many_prompts_as_groups_are_missing():
    assert refill_sizes(3, 8, 8, 1) == [3]
    assert refill_sizes(19, 8, 8, 1) == [8, 8, 3]
    assert refill_sizes(1, 2, 4, 8) == [2]  # 1 prompt x 4 completions cannot split over 8 processes
    assert refill_sizes(1, 4, 2, 4) == [2]
    assert refill_sizes(0, 8, 8, 1) == []


def test_truncated_means_no_stop_token_at_the_end():
    ids = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [2, 0, 0, 0], [5, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    assert truncated_completions(ids, mask, [2, 9]).tolist() == [False, True, False, False]


def cli(*args):
    env = {**os.environ, "MMGRPO_TINY_CACHE": os.environ.get("MMGRPO_TINY_CACHE", os.path.join(REPO, "outputs",
                                                                                              "tiny-cache"))}
    return subprocess.run([sys.executable, os.path.join(REPO, "train_grpo.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


# Launches of the scripts as a user types them (imports included: ~10 s each): the full tier. The fast tier checks
# the same refusals in-process (test_main_refuses_before_loading_a_model and each script's validate tests).
PROGRESS_BAR = re.compile(r"\| *\d+/\d+ \[")  # tqdm's "| 256/256 [00:00<00:00, ...]"


@pytest.mark.slow
@pytest.mark.full
def test_bad_input_ends_the_script_in_one_line(tmp_path):
    """As a new user would try it: a recipe whose data file is not here, a reward that needs a missing column."""
    missing = tmp_path / "crystal_train.jsonl"
    proc = cli("--config", "recipes/crystal_cpr.yaml", "--dataset_name", str(missing), "--output_dir", str(tmp_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"train_grpo.py: error: {missing}: no such file or folder"]
    proc = cli("--reward_funcs", "trl.rewards:accuracy_reward", "--output_dir", str(tmp_path), "--report_to", "none")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # on a fresh clone the default recipe first builds its tiny data set: datasets' progress bars come before the error
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip() and not PROGRESS_BAR.search(line)]
    assert len(lines) == 1 and "reward 'trl.rewards:accuracy_reward' needs 'solution'" in lines[0], lines


@pytest.mark.parametrize("script, args, message", [
    ("iterate.py", ["--num_cycles", "0"], "--num_cycles must be >= 1, got 0"),
    pytest.param("distill.py", ["--chain_source", "model"], "--chain_source model needs exactly one of --model",
                 marks=[pytest.mark.slow, pytest.mark.full]),
    pytest.param("train_mixgrpo.py", ["--group_size", "1"], "--group_size must be >= 2",
                 marks=[pytest.mark.slow, pytest.mark.full]),
])
def test_other_scripts_refuse_bad_flags_in_one_line(tmp_path, script, args, message):
    proc = subprocess.run([sys.executable, os.path.join(REPO, script), *args, "--output_dir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
