"""Difficulty curriculum and PCGrad: unit behaviour, and train_grpo.py runs that use them."""


import pytest
import torch

from tests.grpo_helpers import shapes_assets
from tiny.shapes import KINDS
from utils.core.curriculum import combine_with_rating, levels_from_scores, stage_indices
from utils.core.pcgrad import pcgrad_backward, pcgrad_combine
from utils.core.samplers import CurriculumSampler


def test_tertiles_and_thresholds():
    scores = [0.0, 0.1, 0.2, 0.5, 0.5, 0.6, 0.9, 1.0, 1.0]
    assert levels_from_scores(scores) == ["easy"] * 3 + ["medium"] * 3 + ["hard"] * 3
    assert levels_from_scores(scores, split="thresholds", thresholds=(0.25, 0.75)) == (
        ["easy"] * 3 + ["medium"] * 3 + ["hard"] * 3)
    with pytest.raises(ValueError, match="--difficulty_split"):
        levels_from_scores(scores, split="quartiles")


def test_rating_is_averaged_into_the_error_rate():
    assert combine_with_rating([1.0, 0.0, 0.5], [1.0, 0.0, 0.5]) == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="row 1"):
        combine_with_rating([0.1, 0.2], [0.5, 1.5])


def test_curriculum_sampler_trains_stages_in_order_and_resumes():
    levels = ["easy", "medium", "hard", "medium", "hard", "hard"]
    stages = stage_indices(levels, ["medium", "hard"])
    assert stages == {"medium": [1, 3], "hard": [2, 4, 5]}
    sampler = CurriculumSampler(stages, seed=0, total_steps=4)
    drawn = [sampler.take(2, step) for step in range(4)]
    assert all(set(d) <= {1, 3} for d in drawn[:2]) and all(set(d) <= {2, 4, 5} for d in drawn[2:])
    # Resume after step 2: a fresh sampler with the saved state draws the same questions.
    again = CurriculumSampler(stages, seed=0, total_steps=4)
    [again.take(2, step) for step in range(2)]
    state = again.state_dict()
    resumed = CurriculumSampler(stages, seed=0, total_steps=4)
    resumed.load_state_dict(state)
    assert [resumed.take(2, step) for step in (2, 3)] == drawn[2:]
    with pytest.raises(ValueError, match="'easy' has no questions"):
        stage_indices(["medium", "hard"], ["easy"])
    with pytest.raises(ValueError, match="not one of"):
        stage_indices(levels, ["trivial"])


def test_pcgrad_removes_the_conflict_between_two_gradients():
    g1 = torch.tensor([1.0, 0.0])
    g2 = torch.tensor([-1.0, 1.0])  # g1 . g2 = -1 < 0: conflicting
    combined = pcgrad_combine(torch.stack([g1, g2]))
    # projected g1 = g1 - (-1/2) g2 = [0.5, 0.5]; projected g2 = g2 - (-1/1) g1 = [0, 1]
    assert torch.allclose(combined, torch.tensor([0.5, 1.5]))
    # The combined step no longer works against either objective (the plain sum [0, 1] is orthogonal to g1 at best).
    assert combined @ g1 > 0 and combined @ g2 > 0
    # Non-conflicting gradients are summed untouched.
    assert torch.allclose(pcgrad_combine(torch.stack([g1, torch.tensor([1.0, 1.0])])), torch.tensor([2.0, 1.0]))


def test_pcgrad_backward_writes_projected_gradients_into_params():
    w = torch.nn.Parameter(torch.tensor([0.0, 0.0]))
    # loss1 = -w0 (gradient [-1, 0]); loss2 = w0 - w1 (gradient [1, -1]): they conflict.
    loss1 = -w[0]
    loss2 = w[0] - w[1]
    cos = pcgrad_backward([loss1, loss2], [w])
    assert cos[0, 1] < 0
    assert torch.allclose(w.grad, torch.tensor([-0.5, -1.5]))
    # A gradient step now decreases both objectives (the plain sum would leave loss1 unchanged).
    step = -0.1 * w.grad
    assert -step[0] < 0 and step[0] - step[1] < 0


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shapes_assets(tmp_path_factory, "tests/test_curriculum_pcgrad.py", 60, kinds=KINDS)


def grpo(assets, out, **kw):
    from tests.test_train_grpo import config, run

    return run(config({"qwen": assets["qwen"], "data": assets["data"]}, out, **kw))


@pytest.mark.slow
def test_curriculum_from_column_trains_medium_then_hard(assets, tmp_path):
    import json

    from datasets import load_from_disk

    from utils.core.tracking import read_jsonl

    grpo(assets, tmp_path, curriculum=["medium", "hard"], max_steps=2, save_steps=1, log_completions=True,
         reward_funcs=["tests.grpo_helpers:completion_length"])
    difficulty = dict(zip(*[load_from_disk(assets["data"])[c] for c in ("id", "difficulty")]))
    rows = read_jsonl(tmp_path / "completions.jsonl")
    assert {difficulty[r["id"]] for r in rows if r["step"] == 1} == {"medium"}
    assert {difficulty[r["id"]] for r in rows if r["step"] == 2} == {"hard"}
    # The stage is part of each checkpoint.
    assert json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())["stage"] == "medium"
    assert json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["stage"] == "hard"


@pytest.mark.slow
def test_estimated_difficulty_with_rollouts_is_checkpointed(assets, tmp_path):
    import json

    grpo(assets, tmp_path, curriculum=["hard"], difficulty_samples=2, difficulty_split="thresholds",
         difficulty_thresholds=[0.25, 0.75], max_steps=1, save_steps=1, reward_funcs=["format", "accuracy"])
    levels = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())["difficulty_levels"]
    assert len(levels) == 60 and set(levels) <= {"easy", "medium", "hard"}
    # An untrained model answers nothing right: every question is hard.
    assert set(levels) == {"hard"}


@pytest.mark.slow
def test_pcgrad_with_a_constant_second_reward_equals_plain_grpo(assets, tmp_path):
    """A constant reward has zero advantage, hence a zero gradient that PCGrad projects nothing against: the
    PCGrad run must take exactly the plain run's steps on the first reward (the losses, rewards and the KL
    term through --beta all take part)."""
    from utils.core.tracking import read_jsonl

    common = dict(beta=0.04, max_steps=3, num_iterations=1)
    grpo(assets, tmp_path / "plain", reward_funcs=["tests.grpo_helpers:completion_length"], **common)
    grpo(assets, tmp_path / "pcgrad", use_pcgrad=True, reward_weights=[1.0, 3.0],
         reward_funcs=["tests.grpo_helpers:completion_length", "tests.grpo_helpers:always_one"], **common)
    plain, pcgrad = read_jsonl(tmp_path / "plain" / "metrics.jsonl"), read_jsonl(tmp_path / "pcgrad" / "metrics.jsonl")
    assert len(plain) == len(pcgrad) == 3
    for a, b in zip(plain, pcgrad):
        assert b["rewards/tests.grpo_helpers:completion_length"] == pytest.approx(a["reward"], rel=1e-5)
        for key in ("loss", "kl", "completion_length"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert plain[-1]["kl"] > 0  # the policy moved, so equal steps are not a trivial match


@pytest.mark.slow
def test_pcgrad_removes_exactly_opposed_objectives(assets, tmp_path):
    """Two rewards that are exact negatives give opposite gradients; PCGrad projects each onto the other's
    normal plane, which leaves (up to rounding) nothing, while the plain weighted sum still has a gradient."""
    from utils.core.tracking import read_jsonl

    funcs = ["tests.grpo_helpers:completion_length", "tests.grpo_helpers:negative_length"]
    common = dict(max_steps=1, reward_funcs=funcs, reward_weights=[1.0, 0.5])
    grpo(assets, tmp_path / "pcgrad", use_pcgrad=True, **common)
    grpo(assets, tmp_path / "plain", **common)
    plain = read_jsonl(tmp_path / "plain" / "metrics.jsonl")[0]["grad_norm"]
    projected = read_jsonl(tmp_path / "pcgrad" / "metrics.jsonl")[0]["grad_norm"]
    assert plain > 1e-3
    assert projected < 1e-4 * plain, (projected, plain)


def test_accuracy_next_to_cpr_needs_explicit_flag(assets, tmp_path):
    with pytest.raises(ValueError, match="--allow_double_accuracy"):
        grpo(assets, tmp_path, reward_funcs=["format", "accuracy", "cpr"])
