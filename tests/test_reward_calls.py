"""Rewards are called exactly as TRL 1.16's GRPOTrainer calls them, and checked against that call before a
model loads. TRL is in requirements-dev.txt, which CI installs: these tests run there, they do not skip."""

import math
import types

import pytest
import torch
from transformers import TrainerState

from rewards import get_reward
from utils.core.config import ConfigError
from utils.core.reward_calls import RewardLog, as_conversation, call_rewards, check_reward_call


def recording_reward(calls):
    def reward(**kwargs):
        calls.append(kwargs)
        return [float(len(c[0]["content"])) for c in kwargs["completions"]]

    return reward


def test_the_keywords_are_trls_own():
    """Run TRL's `_calculate_rewards` and ours on the same inputs: the same keywords reach the reward."""
    from trl import GRPOTrainer

    prompts = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]] * 2
    texts = ["three", "2"]
    inputs = [{"prompt": prompts[0], "answer": "3", "reference_steps": ["a"], "image": None}] * 2
    theirs, ours = [], []
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        reward_funcs=[recording_reward(theirs)],
        reward_processing_classes=[None], reward_func_names=["r"], environments=None,
        state=TrainerState(global_step=3), args=types.SimpleNamespace(report_to=[]),
        _log_completion_extra=lambda column, values: None, _log_metric=lambda name, value: None)
    trl_rewards = GRPOTrainer._calculate_rewards(trainer, inputs, prompts, as_conversation(texts), [[5, 6], [7]])
    columns = {k: [row[k] for row in inputs] for k in ("answer", "reference_steps", "image")}
    mine = call_rewards([recording_reward(ours)], ["r"], prompts=prompts, completions=as_conversation(texts),
                        completion_ids=[[5, 6], [7]], columns=columns, trainer_state=TrainerState(global_step=3))
    assert set(ours[0]) == set(theirs[0])
    for key in ("prompts", "completions", "completion_ids", "answer", "reference_steps"):
        assert ours[0][key] == theirs[0][key], key
    assert torch.equal(mine, trl_rewards.cpu())


def test_trl_reward_functions_plug_in_unchanged():
    from trl.rewards import accuracy_reward, think_format_reward

    texts = ["<think>count</think> so \\boxed{3}", "no think, \\boxed{4}"]
    columns = {"solution": ["3", "3"], "answer": ["3", "3"]}
    fns = [get_reward("trl.rewards:think_format_reward"), get_reward("trl.rewards:accuracy_reward")]
    names = ["trl.rewards:think_format_reward", "trl.rewards:accuracy_reward"]
    for fn, name in zip(fns, names):
        check_reward_call(fn, name, columns)
    log = RewardLog()
    got = call_rewards(fns, names, prompts=[[]] * 2, completions=as_conversation(texts), completion_ids=[[1], [2]],
                       columns=columns, log=log)
    conversation = as_conversation(texts)
    assert got[:, 0].tolist() == think_format_reward(conversation)
    assert got[:, 1].tolist() == accuracy_reward(conversation, columns["solution"]) == [1.0, 0.0]
    assert log.extra["solution"] == ["3", "3"]  # TRL's accuracy_reward logs extra columns through log_extra


def test_a_trl_reward_without_its_column_fails_before_any_model():
    fn = get_reward("trl.rewards:accuracy_reward")
    with pytest.raises(ConfigError, match=r"reward 'trl.rewards:accuracy_reward' needs 'solution'.*columns: answer"):
        check_reward_call(fn, "trl.rewards:accuracy_reward", ["answer", "image", "question"])


def test_signature_checks_name_the_reward():
    def strict(completions, answer):  # no **kwargs: TRL's call would pass prompts etc. and fail
        return [0.0] * len(completions)

    def positional(completions, /, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match=r"reward 'strict' takes no \*\*kwargs and would refuse.*completion_ids"):
        check_reward_call(strict, "strict", ["answer"])
    with pytest.raises(ConfigError, match="positional-only"):
        check_reward_call(positional, "positional", [])
    # options bound by --reward_kwargs are not asked of the data set; our built-ins all pass
    check_reward_call(get_reward("cpr", answer_weight=0.7), "cpr", ["answer", "reference_steps"])
    check_reward_call(get_reward("overlong_penalty", max_completion_length=8), "overlong_penalty", [])


def test_none_is_nan_and_bad_returns_are_errors():
    def half(completions, **kw):
        return [1.0 if i % 2 else None for i in range(len(completions))]

    got = call_rewards([half], ["half"], prompts=[None] * 4, completions=as_conversation(["a"] * 4),
                       completion_ids=[[1]] * 4, columns={})
    assert math.isnan(got[0, 0]) and got[1, 0] == 1.0 and math.isnan(got[2, 0])
    with pytest.raises(ValueError, match="reward 'short' returned 1 rewards for 2 completions"):
        call_rewards([lambda completions, **kw: [1.0]], ["short"], prompts=[None] * 2,
                     completions=as_conversation(["a", "b"]), completion_ids=[[1], [1]], columns={})
    with pytest.raises(ValueError, match="reward 'word' returned 'good' for completion 0"):
        call_rewards([lambda completions, **kw: ["good"]], ["word"], prompts=[None],
                     completions=as_conversation(["a"]), completion_ids=[[1]], columns={})


def test_log_metric_is_averaged_into_the_step():
    def chatty(completions, log_metric, **kw):
        log_metric("chatty/calls", len(completions))
        return [0.0] * len(completions)

    log = RewardLog()
    for n in (2, 4):
        call_rewards([chatty], ["chatty"], prompts=[None] * n, completions=as_conversation(["a"] * n),
                     completion_ids=[[1]] * n, columns={}, log=log)
    assert log.metric_means() == {"chatty/calls": 3.0}
