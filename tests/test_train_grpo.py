"""train_grpo.py end to end on tiny models: outputs, reward weighting, loss variants, model families,
1 vs 2 processes, and exact resume after SIGKILL."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

import train_grpo
from tests.grpo_helpers import shapes_assets
from tests.launch_helpers import cli as flags
from tests.launch_helpers import (
    failing_fixture,
    finish,
    fresh_accelerate_state,
    launch,
    launch_fsdp2,
    sigkill_when,
)
from tiny.models import make_tiny_llm, make_tiny_vlm
from train_grpo import GRPOConfig
from utils.core.tracking import read_jsonl


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shapes_assets(tmp_path_factory, "tests/test_train_grpo.py", 48)


def config(assets, out, **overrides):
    base = dict(model_name_or_path=assets["qwen"], dataset_name=assets["data"], output_dir=str(out),
                per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_prompt_length=256,
                max_steps=2, learning_rate=1e-3, report_to="none", save_steps=100, logging_steps=1, seed=0)
    base.update(overrides)
    return GRPOConfig(**base)


def run(cfg):
    try:
        return train_grpo.main(cfg)
    finally:  # each run in this process gets a fresh accelerate state
        fresh_accelerate_state()


@pytest.mark.slow
def test_run_writes_metrics_completions_summary_curve_and_checkpoints(assets, tmp_path):
    run(config(assets, tmp_path, save_steps=1, save_total_limit=1, log_completions=True,
               reward_funcs=["format", "accuracy"], reward_weights=[0.5, 2.0]))
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward", "reward_std", "rewards/format", "rewards/accuracy", "kl", "loss", "clip_ratio",
                "completion_length", "step_time"):
        assert key in metrics[0], key
    assert 1 <= metrics[0]["completion_length"] <= 8
    completions = read_jsonl(tmp_path / "completions.jsonl")
    # every completion of every logged step, with TRL's table columns
    assert len(completions) == 2 * 8 and {"step", "prompt", "completion", "reward", "advantage", "rewards"} <= set(
        completions[0])
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["global_step"] == 2 and summary["train_runtime"] > 0 and summary["peak_memory_mb"] > 0
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    # save_total_limit 1 keeps only the newest checkpoint, which loads as an ordinary HF model.
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(tmp_path / "checkpoint-2")


@pytest.mark.slow
def test_reward_weights_are_applied_and_none_is_left_out(assets, tmp_path):
    run(config(assets, tmp_path, max_steps=1,
               reward_funcs=["tests.grpo_helpers:always_one", "tests.grpo_helpers:half_missing"],
               reward_weights=[2.0, 0.5]))
    m = read_jsonl(tmp_path / "metrics.jsonl")[0]
    # even rows: 2*1 + 0.5*3 = 3.5, odd rows: 2*1 (the None reward is left out of the sum)
    assert m["reward"] == pytest.approx((3.5 + 2.0) / 2)
    assert m["rewards/tests.grpo_helpers:half_missing"] == pytest.approx(3.0)
    assert m["rewards/tests.grpo_helpers:always_one"] == pytest.approx(1.0)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    dict(loss_type="dapo", beta=0.04, num_iterations=2, gradient_accumulation_steps=2, save_steps=2),
    dict(loss_type="dr_grpo", importance_sampling_level="sequence", scale_rewards="batch", epsilon_high=0.28),
    dict(loss_type="bnpo", use_peft=True, lora_r=4, beta=0.1, scale_rewards="none", top_k=20, top_p=0.9),
])
def test_loss_variants_train(assets, tmp_path, variant):
    run(config(assets, tmp_path, reward_funcs=["tests.grpo_helpers:completion_length"], **variant))
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(metrics) == 2
    for m in metrics:
        assert all(v == v for k, v in m.items() if isinstance(v, float)), m  # no NaN
    if variant.get("beta"):
        # The policy moved away from the reference by the second step: the KL term is live.
        assert metrics[-1]["kl"] > 0
    if variant.get("num_iterations", 1) > 1:
        # Step 1 is the first pass over fresh completions: the stored behaviour log-probs equal the
        # policy's, so the importance ratio is exactly 1 on every token. Step 2 reuses the same
        # completions after an update: the ratio has moved.
        assert metrics[0]["ratio_max_dev"] < 1e-5, metrics[0]
        assert metrics[1]["ratio_max_dev"] > 1e-3, metrics[1]


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("family", ["internvl", "glm4v", "text"])
def test_other_model_families(assets, tmp_path, family):
    if family == "text":
        model = make_tiny_llm(str(tmp_path / "llm"), seed=0)
        extra = dict(image_column=None)
    else:
        model = make_tiny_vlm(str(tmp_path / family), family=family, seed=0)
        extra = {}
    run(config(assets, tmp_path / "out", model_name_or_path=model, max_steps=1,
               reward_funcs=["tests.grpo_helpers:completion_length"], **extra))
    assert read_jsonl(tmp_path / "out" / "metrics.jsonl")[0]["step"] == 1


def test_bad_flag_combinations_fail_before_loading(assets, tmp_path):
    with pytest.raises(ValueError, match="--num_generations 3"):
        run(config(assets, tmp_path, num_generations=3))
    with pytest.raises(ValueError, match="--reward_weights has 1 values for 2"):
        run(config(assets, tmp_path, reward_funcs=["format", "accuracy"], reward_weights=[1.0]))
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        run(config(assets, tmp_path, reward_funcs=["nope"]))


def test_validation_flags_fail_before_loading(assets, tmp_path):
    with pytest.raises(ValueError, match="--load_best_model_at_end picks on validation rows: give --val_split"):
        run(config(assets, tmp_path, load_best_model_at_end=True))
    with pytest.raises(ValueError, match="--val_split test is the held-out split of"):
        run(config(assets, tmp_path, val_split="test", eval_dataset_name=assets["data"], eval_split="test"))
    with pytest.raises(ValueError, match="--val_split train is the training split of"):
        run(config(assets, tmp_path, val_split="train"))
    with pytest.raises(ValueError, match="--val_samples must be >= 1"):
        run(config(assets, tmp_path, val_split="validation", val_samples=0))
    with pytest.raises(ValueError, match="--metric_for_best_model eval_loss: choose one of accuracy, format"):
        run(config(assets, tmp_path, val_split="validation", metric_for_best_model="eval_loss"))


@pytest.fixture(scope="module")
def split_assets(assets):
    """The shapes rows as train / validation / test splits of one data set."""
    from datasets import DatasetDict

    from tiny.shapes import make_shapes_vqa

    path = str(assets["root"] / "splits")
    DatasetDict({"train": make_shapes_vqa(48, seed=0, kinds=("color", "count")),
                 "validation": make_shapes_vqa(6, seed=2, kinds=("color", "count")),
                 "test": make_shapes_vqa(5, seed=1, kinds=("color", "count"))}).save_to_disk(path)
    return path


def scripted_validation(monkeypatch, values):
    """train_grpo's evaluations run for real; the validation ones (6 rows) report `values` in turn as their
    accuracy. Returns the calls: (rows scored, the policy's first weight's sum when scored)."""
    real, calls, scripted = train_grpo.evaluate_policy, [], iter(values)

    def evaluate_policy(policy, processor, eval_set, cfg, accelerator, **kwargs):
        result = real(policy, processor, eval_set, cfg, accelerator, **kwargs)
        calls.append((result["samples"], next(policy.parameters()).detach().double().sum().item()))
        return {**result, "accuracy": next(scripted)} if result["samples"] == 6 else result

    monkeypatch.setattr(train_grpo, "evaluate_policy", evaluate_policy)
    return calls


@pytest.mark.slow
def test_load_best_model_at_end_scores_each_checkpoint_keeps_and_loads_the_best(assets, split_assets, tmp_path,
                                                                                  monkeypatch):
    calls = scripted_validation(monkeypatch, [0.25, 0.75, 0.75, 0.5])
    policy = run(config(assets, tmp_path, dataset_name=split_assets, eval_dataset_name=split_assets,
                        eval_split="test", val_split="validation", val_samples=None, load_best_model_at_end=True,
                        save_steps=1, save_total_limit=1, max_steps=4,
                        reward_funcs=["tests.grpo_helpers:completion_length"]))
    # held out before, validation at each of the 4 checkpoints (all 6 rows), held out after
    assert [n for n, _ in calls] == [5, 6, 6, 6, 6, 5]
    metrics = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if "val_accuracy" in m]
    assert [(m["step"], m["val_accuracy"], m["val_samples"]) for m in metrics] == [
        (1, 0.25, 6), (2, 0.75, 6), (3, 0.75, 6), (4, 0.5, 6)]
    # the best (a tie keeps the earlier) is kept beside the newest whatever --save_total_limit says
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["best"] == {"step": 2, "checkpoint": str(tmp_path / "checkpoint-2"), "metric": "accuracy",
                             "value": 0.75}
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert (summary["best_model_checkpoint"], summary["best_metric"], summary["best_step"]) == (
        str(tmp_path / "checkpoint-2"), 0.75, 2)
    # the run ends holding checkpoint-2's weights, and the held-out evaluation scored them, not step 4's
    from transformers import AutoModelForImageTextToText

    best, last = (AutoModelForImageTextToText.from_pretrained(tmp_path / f"checkpoint-{step}").state_dict()
                  for step in (2, 4))
    trained = policy.model.state_dict()
    assert best.keys() == trained.keys() and all(trained[k].equal(best[k]) for k in best)
    assert any(not last[k].equal(best[k]) for k in best)
    assert calls[-1][1] == calls[2][1] != calls[4][1]  # after == at step 2's validation != at step 4's


@pytest.mark.slow
def test_the_best_checkpoint_so_far_is_resumed_with_the_run(assets, split_assets, tmp_path, monkeypatch):
    calls = scripted_validation(monkeypatch, [0.5, 0.25, 0.5])
    flags = dict(dataset_name=split_assets, eval_dataset_name=split_assets, eval_split="test", eval_before=False,
                 val_split="validation", load_best_model_at_end=True, save_steps=1)
    run(config(assets, tmp_path, max_steps=2, **flags))
    run(config(assets, tmp_path, max_steps=3, resume_from_checkpoint="latest", **flags))
    # step 1's 0.5 came back with checkpoint-2: step 3's 0.5 ties it and the earlier stays the best
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert (summary["best_step"], summary["best_metric"]) == (1, 0.5)
    assert len(calls) == 2 + 1 + 2  # validation at steps 1-2, held out after; then step 3, held out after


@pytest.mark.slow
def test_prompt_over_max_length_names_the_sample(assets, tmp_path):
    with pytest.raises(ValueError, match=r"sample 'shapes-0-\d+': prompt is \d+ tokens.*--max_prompt_length 20"):
        run(config(assets, tmp_path, max_prompt_length=20))


def cli(assets, out, **overrides):
    """train_grpo.py's command line for these assets (the launched runs, and the in-process runs that parse it)."""
    cfg = dict(model_name_or_path=assets["qwen"], dataset_name=assets["data"], output_dir=str(out),
               num_generations=4, max_completion_length=8, max_steps=3, learning_rate=1e-3, report_to="none",
               reward_funcs="tests.grpo_helpers:completion_length", seed=0)
    cfg.update(overrides)
    return flags(**cfg)


def run_cli(args):
    """train_grpo.py in this process on a command line, parsed as the launched script parses it."""
    from utils.core.config import parse_config

    return run(parse_config(GRPOConfig, args))


def grpo(args, num_processes=1, config=None, env=None):
    return launch("train_grpo.py", args, num_processes, config=config, env=env)


# The run the 2-process checks compare with: 2 prompts x 4 completions per step split over 2 DDP processes, the KL
# to the reference on (a second model on each rank), a checkpoint every step.
DDP = dict(per_device_train_batch_size=4, max_steps=2, save_steps=1, beta=0.5)
# (not "kl": as TRL's, the logged KL is the mean of each process's token mean, so it depends on the split)
COMPARED = ("reward", "reward_std", "loss", "completion_length", "clip_ratio", "grad_norm")


@pytest.fixture(scope="module")
def ddp_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-ddp")
    finish(grpo(cli(assets, out, **DDP), 2, config="cpu"), what="tests/test_train_grpo.py's 2-process DDP run")
    return out


def assert_same_metrics(m1, m2, keys=COMPARED, rel=1e-4):
    assert [m["step"] for m in m1] == [m["step"] for m in m2], (m1, m2)
    for a, b in zip(m1, m2):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-5), (a["step"], key, a[key], b[key])


@pytest.mark.slow
def test_two_processes_match_one_process_and_checkpoint_every_rank(assets, ddp_run, tmp_path):
    # The same global batch (8 completions = 2 prompts x 4) on one process (this one) or two (the DDP run).
    run_cli(cli(assets, tmp_path / "one", **dict(DDP, per_device_train_batch_size=8)))
    m1, m2 = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(ddp_run / "metrics.jsonl")
    assert len(m2) == 2
    assert_same_metrics(m1, m2)
    assert m2[-1]["grad_norm"] > 0 and m2[-1]["kl"] > 0  # the policy trains, the reference scores
    # the checkpoint holds each rank's RNG state and the sampler's position, and loads as an HF model
    state = ddp_run / "checkpoint-2" / "training_state"
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(os.listdir(state)), os.listdir(state)
    trainer_state = json.loads((ddp_run / "checkpoint-2" / "trainer_state.json").read_text())
    assert trainer_state["global_step"] == 2 and "sampler" in trainer_state
    one = load_file(str(tmp_path / "one" / "checkpoint-2" / "model.safetensors"))
    two = load_file(str(ddp_run / "checkpoint-2" / "model.safetensors"))
    assert one.keys() == two.keys() and max((one[k] - two[k]).abs().max().item() for k in one) < 1e-4


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("variant", [
    # PCGrad projects the step's per-objective gradients after averaging them over the processes
    dict(use_pcgrad="true", reward_funcs="tests.grpo_helpers:completion_length,tests.grpo_helpers:none_on_odd",
         reward_weights="1.0,-0.5"),
    # kept groups are regrouped across processes, their completions moved as token ids
    dict(dynamic_sampling="true", reward_funcs="tests.grpo_helpers:constant_on_even_prompts"),
], ids=["pcgrad", "dynamic_sampling"])
def test_two_processes_match_one_process(assets, tmp_path, variant):
    # Same global batch (8 completions = 2 prompts x 4), split over 1 or 2 processes.
    finish(grpo(cli(assets, tmp_path / "one", per_device_train_batch_size=8, **variant)))
    finish(grpo(cli(assets, tmp_path / "two", per_device_train_batch_size=4, **variant), 2))
    m1, m2 = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert len(m1) == len(m2) == 3
    assert_same_metrics(m1, m2)
    assert m1[-1]["grad_norm"] > 0
    if "dynamic_sampling" in variant:
        assert [m["resample_rounds"] for m in m1] == [m["resample_rounds"] for m in m2]
        assert sum(m["resample_rounds"] for m in m1) > 0


# Resume: 6 steps with a checkpoint every 2, every completion logged. The uninterrupted run is made in this process
# once per module; the launched SIGKILL test and the in-process resume tests compare with it.
RESUME = dict(per_device_train_batch_size=8, max_steps=6, save_steps=2, max_completion_length=16,
              log_completions="true")
# half the prompts get a constant reward: dynamic sampling drops their groups and draws more prompts
DYNAMIC = dict(dynamic_sampling="true", reward_funcs="tests.grpo_helpers:constant_on_even_prompts")


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    runs = {}

    def get(name):
        if name not in runs:
            out = tmp_path_factory.mktemp(f"grpo-uninterrupted-{name}")
            with failing_fixture(f"tests/test_train_grpo.py's uninterrupted 6-step run ({name})"):
                run_cli(cli(assets, out, **RESUME, **(DYNAMIC if name == "dynamic_sampling" else {})))
            runs[name] = out
        return runs[name]

    return get


def assert_resumed_like(resumed_dir, full_dir, variant, exact):
    full = {m["step"]: m for m in read_jsonl(full_dir / "metrics.jsonl")}
    resumed = {m["step"]: m for m in read_jsonl(resumed_dir / "metrics.jsonl")}
    assert sorted(resumed)[-4:] == [3, 4, 5, 6], sorted(resumed)
    for step in range(3, 7):
        for key in ("reward", "loss", "completion_length", "grad_norm"):
            if exact:
                assert resumed[step][key] == full[step][key], (step, key, resumed[step][key], full[step][key])
            else:
                assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-5, abs=1e-6), (step, key)
    if variant:
        assert sum(m["resample_rounds"] for m in full.values()) > 0  # the resampling did happen
        assert [resumed[s]["resample_rounds"] for s in range(3, 7)] == [full[s]["resample_rounds"] for s in range(3, 7)]

    # A random tiny model earns the same rewards whatever it is asked, so the metrics alone would not
    # notice a resume that forgot the sampler's position: the drawn prompts and completions must match too.
    def drawn(run_dir):
        rows = read_jsonl(run_dir / "completions.jsonl")
        return [(r["step"], r["id"], r["prompt"], r["completion"]) for r in rows if r["step"] >= 3]

    assert drawn(resumed_dir) == drawn(full_dir) and len(drawn(full_dir)) == 4 * 8


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(assets, uninterrupted, tmp_path):
    # The one real kill: the run dies mid-flight (after checkpoint-2), the checkpoint it left is whole.
    victim = grpo(cli(assets, tmp_path / "killed", **RESUME))
    sigkill_when(victim, tmp_path / "killed" / "checkpoint-2", timeout=300)
    assert not (tmp_path / "killed" / "checkpoint-6").exists()
    assert len(read_jsonl(tmp_path / "killed" / "metrics.jsonl")) < 6, "the kill came after the run had finished"
    finish(grpo(cli(assets, tmp_path / "killed", resume_from_checkpoint="latest", **RESUME)))
    assert sorted(m["step"] for m in read_jsonl(tmp_path / "killed" / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]
    assert_resumed_like(tmp_path / "killed", uninterrupted("plain"), {}, exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [{}, pytest.param(DYNAMIC, marks=pytest.mark.full)],
                         ids=["plain", "dynamic_sampling"])
def test_resume_from_a_checkpoint_matches_uninterrupted_run_bit_for_bit(assets, uninterrupted, tmp_path, variant):
    # In this process: rebuild everything from checkpoint-2 (weights, optimizer, scheduler, sampler position,
    # dynamic sampling's state), train steps 3-6, and compare with the uninterrupted run exactly.
    full = uninterrupted("dynamic_sampling" if variant else "plain")
    run_cli(cli(assets, tmp_path / "resumed", resume_from_checkpoint=str(full / "checkpoint-2"), **RESUME,
                **variant))
    assert not (tmp_path / "resumed" / "checkpoint-2").exists()  # it started at step 3
    assert_resumed_like(tmp_path / "resumed", full, variant, exact=True)
    a = load_file(str(full / "checkpoint-6" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoint-6" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    opt_a, opt_b = (json.loads((d / "checkpoint-6" / "trainer_state.json").read_text())
                    for d in (full, tmp_path / "resumed"))
    assert opt_a == opt_b

@pytest.mark.slow
@pytest.mark.full
def test_dynamic_sampling_trains_only_groups_with_spread(assets, tmp_path):
    funcs = ["tests.grpo_helpers:constant_on_even_prompts"]
    run(config(assets, tmp_path / "plain", reward_funcs=funcs, max_steps=3, log_completions=True))
    run(config(assets, tmp_path / "dapo", reward_funcs=funcs, max_steps=3, log_completions=True, dynamic_sampling=True,
               max_resample_rounds=8))
    plain, dapo = read_jsonl(tmp_path / "plain" / "metrics.jsonl"), read_jsonl(tmp_path / "dapo" / "metrics.jsonl")
    assert sum(m["frac_reward_zero_std"] for m in plain) > 0  # some steps trained constant groups
    for m in dapo:
        assert m["frac_reward_zero_std"] == 0.0, m  # every trained group has spread
        assert m["frac_zero_std_groups"] > 0 or m["resample_rounds"] == 0
    assert sum(m["resample_rounds"] for m in dapo) > 0
    rows = read_jsonl(tmp_path / "dapo" / "completions.jsonl")
    assert len(rows) == 3 * 8 and all(int(r["id"].rsplit("-", 1)[1]) % 2 == 1 for r in rows)
    # with no resample rounds allowed, the step keeps its shape: constant groups fill it (advantage 0)
    run(config(assets, tmp_path / "capped", reward_funcs=funcs, max_steps=2, dynamic_sampling=True,
               max_resample_rounds=0))
    capped = read_jsonl(tmp_path / "capped" / "metrics.jsonl")
    assert all(m["resample_rounds"] == 0 for m in capped)
    assert [m["reward"] for m in capped] == pytest.approx([m["reward"] for m in plain[:2]])


@pytest.mark.slow
def test_unscorable_completions_get_zero_advantage_and_are_counted(assets, tmp_path):
    run(config(assets, tmp_path, reward_funcs=["tests.grpo_helpers:none_on_odd"], max_steps=1, log_completions=True))
    m = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert m["frac_unscorable"] == 0.5
    rows = read_jsonl(tmp_path / "completions.jsonl")
    unscorable = [r for r in rows if r["reward"] is None]
    assert len(unscorable) == 4 and all(r["advantage"] == 0.0 for r in unscorable)
    scored = [r for r in rows if r["reward"] is not None]
    # the baseline is the mean of the scorable completions only: their advantages sum to 0 per group
    by_prompt = {}
    for r in scored:
        by_prompt.setdefault(r["id"], []).append(r["advantage"])
    assert all(abs(sum(a)) < 1e-4 for a in by_prompt.values())
    assert m["reward"] == pytest.approx(sum(r["reward"] for r in scored) / len(scored), rel=1e-5)


@pytest.mark.slow
def test_trl_reward_functions_train_unchanged(assets, tmp_path):
    from datasets import load_from_disk

    data = str(tmp_path / "with_solution")
    load_from_disk(assets["data"]).map(lambda row: {"solution": row["answer"]}).save_to_disk(data)
    funcs = ["trl.rewards:think_format_reward", "trl.rewards:accuracy_reward"]
    run(config(assets, tmp_path / "out", dataset_name=data, reward_funcs=funcs, max_steps=1, log_completions=True))
    m = read_jsonl(tmp_path / "out" / "metrics.jsonl")[0]
    assert m["rewards/trl.rewards:think_format_reward"] == 0.0  # a random model writes no <think> block
    assert "rewards/trl.rewards:accuracy_reward" in m
    rows = read_jsonl(tmp_path / "out" / "completions.jsonl")
    assert {"solution", "gold_parsed", "answer_parsed"} <= set(rows[0])  # TRL's log_extra columns


@pytest.mark.slow
@pytest.mark.parametrize("disable", [True, False])
def test_dropout_off_gives_ratio_one_on_a_first_pass(assets, tmp_path, disable):
    """LoRA dropout 0.05 with two passes per generation round: step 3 is the first pass over round 2's fresh
    completions, after LoRA's B matrices have moved. Old log-probs come from eval() mode and new ones from
    train() mode, so with dropout on the ratio is not 1; with --disable_dropout it is exactly 1."""
    run(config(assets, tmp_path, use_peft=True, lora_r=4, lora_dropout=0.05, num_iterations=2, max_steps=4,
               save_steps=2, disable_dropout=disable, learning_rate=5e-3,
               reward_funcs=["tests.grpo_helpers:completion_length"]))
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    if disable:
        assert metrics[0]["ratio_max_dev"] < 1e-5 and metrics[2]["ratio_max_dev"] < 1e-5, metrics
    else:
        assert metrics[2]["ratio_max_dev"] > 1e-4, metrics


@pytest.mark.slow
def test_pcgrad_does_not_depend_on_the_micro_batch_split(assets, tmp_path):
    """GA 2 x 4 completions draws the same prompts and samples as GA 1 x 8; projecting the step's gradients (not
    each micro-batch's) makes the updates equal too."""
    common = dict(use_pcgrad=True, max_steps=2, reward_weights=[1.0, -0.5], loss_type="grpo",
                  reward_funcs=["tests.grpo_helpers:completion_length", "tests.grpo_helpers:none_on_odd"])
    run(config(assets, tmp_path / "one", per_device_train_batch_size=8, **common))
    run(config(assets, tmp_path / "two", per_device_train_batch_size=4, gradient_accumulation_steps=2, **common))
    a, b = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "reward", "completion_length"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), (x["step"], key)


@pytest.mark.slow
def test_mask_truncated_completions_leaves_them_out_of_the_loss(assets, tmp_path):
    # 3 tokens: a random model almost never stops that soon, so nearly every completion is cut
    run(config(assets, tmp_path / "masked", max_completion_length=3, mask_truncated_completions=True, max_steps=1,
               reward_funcs=["tests.grpo_helpers:completion_length"]))
    run(config(assets, tmp_path / "plain", max_completion_length=3, max_steps=1,
               reward_funcs=["tests.grpo_helpers:completion_length"]))
    masked = read_jsonl(tmp_path / "masked" / "metrics.jsonl")[0]
    plain = read_jsonl(tmp_path / "plain" / "metrics.jsonl")[0]
    assert masked["completions/clipped_ratio"] == plain["completions/clipped_ratio"] > 0.5
    assert plain["grad_norm"] > 0
    if masked["completions/clipped_ratio"] == 1.0:
        assert masked["loss"] == 0.0 and masked["grad_norm"] == 0.0
    else:
        assert masked["grad_norm"] < plain["grad_norm"]


def multi_image_rows(tmp_path, question_suffix=""):
    from PIL import Image

    rows = []
    for i in range(4):
        paths = []
        for j in range(1 + i % 2):  # 1 or 2 images per sample
            path = tmp_path / f"img{i}_{j}.png"
            Image.new("RGB", (84, 84), (255 * (j % 2), 0, 255)).save(path)
            paths.append(path.name)
        rows.append({"id": f"multi-{i}", "image": paths, "question": f"How many images?{question_suffix}",
                     "answer": str(len(paths))})
    data = tmp_path / "multi.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return str(data)


@pytest.mark.slow
def test_several_images_per_sample(assets, tmp_path):
    data = multi_image_rows(tmp_path)
    run(config(assets, tmp_path / "out", dataset_name=data, max_steps=1, per_device_train_batch_size=8,
               reward_funcs=["tests.grpo_helpers:completion_length"]))
    assert read_jsonl(tmp_path / "out" / "metrics.jsonl")[0]["step"] == 1


@pytest.mark.slow
def test_image_token_mismatch_names_the_sample(assets, tmp_path):
    # A literal image placeholder in the question makes the tokens outnumber the images.
    data = multi_image_rows(tmp_path, question_suffix=" <|image_pad|>")
    with pytest.raises(ValueError, match=r"sample 'multi-\d'.*image"):
        run(config(assets, tmp_path / "out", dataset_name=data, max_steps=1,
                   reward_funcs=["tests.grpo_helpers:completion_length"]))


@pytest.mark.slow
def test_push_to_hub_uploads_checkpoint_with_card_in_background(assets, tmp_path, monkeypatch):
    import utils.core.hub

    uploads = []

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kw):
            return repo_id

        def upload_folder(self, *, repo_id, folder_path, **kw):
            files = sorted(os.listdir(folder_path))
            card = open(os.path.join(folder_path, "README.md")).read()
            uploads.append((repo_id, files, card))

    monkeypatch.setattr(utils.core.hub, "HfApi", FakeApi)
    run(config(assets, tmp_path, max_steps=2, save_steps=1, push_to_hub=True, hub_model_id="me/tiny-grpo",
               report_to="tensorboard", reward_funcs=["tests.grpo_helpers:completion_length"]))
    assert [u[0] for u in uploads] == ["me/tiny-grpo", "me/tiny-grpo"]
    repo, files, card = uploads[-1]
    assert "model.safetensors" in files and "config.json" in files and "README.md" in files
    assert not any("optimizer" in f or "random_states" in f for f in files)  # training state stays local
    assert "train_grpo.py" in card and "num_generations" in card
    # tensorboard is the default tracker: event files were written
    assert list(tmp_path.rglob("events.out.tfevents.*"))


def test_use_vllm_without_vllm_is_a_clear_error_before_loading(assets, tmp_path):
    with pytest.raises((ImportError, RuntimeError), match="--use_vllm"):
        run(config(assets, tmp_path, use_vllm=True))
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM replaced by the fake engine of tests/vllm_helpers.py (importable as `vllm`, no GPU needed); the
    rendezvous variables the rollout sets for the engine are undone after the test."""
    import utils.core.vllm_rollout
    from tests.vllm_helpers import DIST_KEYS, FakeVLLM

    for key in DIST_KEYS:
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    monkeypatch.setitem(sys.modules, "vllm", FakeVLLM)

    def require_vllm():  # the real import, without the CUDA check
        import vllm

        return vllm

    monkeypatch.setattr(utils.core.vllm_rollout, "require_vllm", require_vllm)
    monkeypatch.setattr(train_grpo, "require_vllm", require_vllm)
    FakeVLLM.engines.clear()
    return FakeVLLM


@pytest.mark.slow
def test_use_vllm_trains_with_importance_weights_and_logs_the_mismatch(assets, tmp_path, fake_vllm):
    run(config(assets, tmp_path, use_vllm=True, vllm_enable_sleep_mode=True, max_steps=2, save_steps=2,
               reward_funcs=["tests.grpo_helpers:completion_length"]))
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 0 < m["vllm/logp_diff_mean"] <= m["vllm/logp_diff_max"], m
        assert 0 < m["vllm/is_weight_min"] <= m["vllm/is_weight_mean"] <= m["vllm/is_weight_max"] <= 3.0, m
        assert 3 <= m["completion_length"] <= 5  # the fake's completions: 2 to 4 tokens and a stop id
        assert m["loss"] == m["loss"] and m["grad_norm"] > 0  # finite, and the policy trains
    (engine,) = fake_vllm.engines
    assert engine.kwargs["gpu_memory_utilization"] == 0.3 and engine.kwargs["max_num_batched_tokens"] == 4096
    assert engine.kwargs["enable_sleep_mode"] is True and "limit_mm_per_prompt" in engine.kwargs
    # asleep until the first round; each round: weights back and synced, KV cache back, generate, asleep again
    round_calls = ["wake_up", "reset_prefix_cache", "wake_up", "generate", "sleep"]
    assert [c[0] for c in engine.calls] == ["sleep"] + round_calls * 2
    assert engine.params[0].logit_bias and engine.params[0].max_tokens == 8  # suppressed tokens, the budget
    assert (tmp_path / "checkpoint-2").is_dir()


@pytest.mark.slow
def test_use_vllm_importance_weights_reach_the_loss_under_dynamic_sampling(assets, tmp_path, fake_vllm):
    # token_mask with a cap below every ratio: every weight is 0, so is the policy loss (beta 0); the weights
    # travel with their completions through dynamic sampling's regrouping
    run(config(assets, tmp_path, use_vllm=True, max_steps=1, dynamic_sampling=True, max_resample_rounds=8,
               reward_funcs=["tests.grpo_helpers:constant_on_even_prompts"],
               vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_cap=1e-12))
    (m,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert m["frac_reward_zero_std"] == 0.0 and m["resample_rounds"] > 0
    assert m["vllm/is_weight_max"] == 0.0 and m["loss"] == 0.0 and m["grad_norm"] == 0.0
    assert m["vllm/logp_diff_mean"] > 0


@pytest.mark.slow
def test_use_vllm_weights_are_against_the_rounds_behaviour_log_probs(assets, tmp_path, fake_vllm):
    # --num_iterations 2: both passes over a round weight by pi_old / pi_vllm with the round's stored old
    # log-probs, so the logged weights repeat while the policy itself moves between the passes
    run(config(assets, tmp_path, use_vllm=True, max_steps=2, num_iterations=2,
               reward_funcs=["tests.grpo_helpers:completion_length"]))
    first, second = read_jsonl(tmp_path / "metrics.jsonl")
    keys = [k for k in first if k.startswith("vllm/")]
    assert len(keys) == 5 and all(first[k] == second[k] for k in keys), (first, second)
    assert first["ratio_max_dev"] == 0.0 < second["ratio_max_dev"]
    assert [c[0] for c in fake_vllm.engines[0].calls].count("generate") == 1  # one round, one generation


def test_bad_vllm_flags_fail_before_loading(assets, tmp_path):
    with pytest.raises(ValueError, match="--vllm_importance_sampling_cap 0"):
        run(config(assets, tmp_path, vllm_importance_sampling_cap=0.0))
    with pytest.raises(ValueError, match="--vllm_gpu_memory_utilization 1.5"):
        run(config(assets, tmp_path, vllm_gpu_memory_utilization=1.5))
    with pytest.raises(ValueError, match="--vllm_max_num_batched_tokens 0"):
        run(config(assets, tmp_path, vllm_max_num_batched_tokens=0))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_vllm_flags_default_to_what_the_rollout_module_reads():
    from utils.core.vllm_flags import FLAG_DEFAULTS

    defaults = GRPOConfig()
    assert {name: getattr(defaults, name) for name in FLAG_DEFAULTS} == FLAG_DEFAULTS


def test_pure_bf16_weights_at_a_tiny_learning_rate_are_refused_before_training(assets, tmp_path):
    from utils.core.errors import InputError

    with pytest.raises(InputError, match=r"--dtype bfloat16 trains .* AdamW at learning rate 1e-06: .*--bf16"):
        run(config(assets, tmp_path, dtype="bfloat16", learning_rate=1e-6))
    assert not (tmp_path / "metrics.jsonl").exists() and not list(tmp_path.glob("checkpoint-*"))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [pytest.param("zero2", marks=pytest.mark.full), "zero3"])
def test_deepspeed_on_two_cpu_processes_matches_ddp_and_resumes(assets, ddp_run, tmp_path, zero):
    # DS_ACCELERATOR=cpu: DeepSpeed's gloo group on the CPU (ZeRO-3: sharded weights, gathered generation);
    # beta > 0: the frozen reference copy is a DeepSpeed inference engine of its own. The resume launch runs in the
    # full tier's ZeRO-2 case (the fast tier keeps one DeepSpeed launch; resume is the same code for both stages and
    # is tested under ZeRO-3 by the SFT and Mix-GRPO scripts' full-tier tests)
    env = {"DS_ACCELERATOR": "cpu"}
    finish(grpo(cli(assets, tmp_path / "ds", **DDP), 2, config=zero, env=env))
    shards = os.listdir(tmp_path / "ds" / "checkpoint-2" / "training_state" / "pytorch_model")
    assert sorted(s for s in shards if "optim_states" in s) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], shards  # DeepSpeed ran on 2 ranks
    ddp, ds = read_jsonl(ddp_run / "metrics.jsonl"), read_jsonl(tmp_path / "ds" / "metrics.jsonl")
    assert [m["step"] for m in ds] == [1, 2]
    assert_same_metrics(ddp, ds, keys=("reward", "reward_std", "loss", "completion_length", "grad_norm", "kl"))
    assert ds[-1]["grad_norm"] > 0 and ds[-1]["kl"] > 0  # the reference really scored (step 2: weights moved)
    # the HF copy names its weights as DDP's does (model.layers.*, not ZeRO-3's former model.model.layers.*); only
    # the tied LM head may be written or left out (it is the embedding)
    names = {"ddp": set(load_file(str(ddp_run / "checkpoint-2" / "model.safetensors"))),
             "ds": set(load_file(str(tmp_path / "ds" / "checkpoint-2" / "model.safetensors")))}
    assert names["ds"] ^ names["ddp"] <= {"lm_head.weight"}, names["ds"] ^ names["ddp"]
    assert any(".layers." in n for n in names["ds"])
    if zero == "zero2":
        finish(grpo(cli(assets, tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "ds" / "checkpoint-1"),
                        **DDP), 2, config=zero, env=env))
        resumed = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
        assert [m["step"] for m in resumed] == [2]
        for key in ("reward", "loss", "completion_length"):
            assert resumed[0][key] == pytest.approx(ds[1][key], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.full
def test_load_best_model_at_end_under_zero3_on_two_processes(assets, split_assets, tmp_path):
    # validation on sharded weights at each checkpoint, then the best one loaded into the DeepSpeed engine on both
    # ranks (the in-process test above checks which weights; this one the collectives around them)
    out = finish(grpo(cli(assets, tmp_path, dataset_name=split_assets, eval_dataset_name=split_assets,
                          eval_split="test", val_split="validation", load_best_model_at_end="true",
                          metric_for_best_model="format", save_steps=1, save_total_limit=1,
                          per_device_train_batch_size=4), 2, config="zero3", env={"DS_ACCELERATOR": "cpu"}))
    val = {m["step"]: m["val_format"] for m in read_jsonl(tmp_path / "metrics.jsonl") if "val_format" in m}
    assert sorted(val) == [1, 2, 3]
    best = max(val, key=lambda step: (val[step], -step))  # the highest, the earliest of a tie
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert (summary["best_step"], summary["best_metric"]) == (best, val[best])
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == sorted({f"checkpoint-{best}", "checkpoint-3"})
    assert out.count("loaded the best checkpoint") == (best != 3), out[-3000:]  # printed once, by the main process
    assert best != 3, val  # (a random model formats nothing: step 1 ties the later ones, so a load happens)
    assert "heldout_accuracy_after" in summary


@pytest.fixture(scope="module")
def fsdp2_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-fsdp2")
    finish(launch_fsdp2("train_grpo.py", cli(assets, out, **DDP)), what="tests/test_train_grpo.py's FSDP2 run")
    return out


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_matches_ddp(assets, ddp_run, fsdp2_run):
    # accelerate_configs/fsdp2.yaml: fully_shard per decoder layer and vision block, activation checkpointing, sharded
    # checkpoints; generation on whole weights gathered once (utils/core/fsdp.py), the reference a copy per rank
    shards = os.listdir(fsdp2_run / "checkpoint-2" / "training_state" / "pytorch_model_fsdp_0")
    assert sorted(s for s in shards if s.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # 2 ranks' shards
    ddp, fsdp = read_jsonl(ddp_run / "metrics.jsonl"), read_jsonl(fsdp2_run / "metrics.jsonl")
    assert_same_metrics(ddp, fsdp, keys=COMPARED + ("kl",))
    assert fsdp[-1]["grad_norm"] > 0 and fsdp[-1]["kl"] > 0
    a = load_file(str(ddp_run / "checkpoint-2" / "model.safetensors"))
    b = load_file(str(fsdp2_run / "checkpoint-2" / "model.safetensors"))
    assert a.keys() ^ b.keys() <= {"lm_head.weight"}  # DDP's names; the gathered copy may write the tied head too
    assert max((a[k] - b[k]).abs().max().item() for k in a.keys() & b.keys()) < 1e-4


@pytest.mark.slow
@pytest.mark.full
def test_fsdp2_resumes_exactly(assets, fsdp2_run, tmp_path):
    finish(launch_fsdp2("train_grpo.py", cli(assets, tmp_path / "resumed", **DDP,
                                            resume_from_checkpoint=str(fsdp2_run / "checkpoint-1"))))
    full, resumed = read_jsonl(fsdp2_run / "metrics.jsonl"), read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [2]
    assert_same_metrics(full[1:], resumed, keys=COMPARED + ("kl",), rel=1e-6)
    a = load_file(str(fsdp2_run / "checkpoint-2" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoint-2" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.full
def test_use_vllm_on_two_processes_matches_one_process(assets, tmp_path):
    # Colocate mode: each process builds its own engine under the rendezvous variables it is given, syncs its
    # weights, and samples its own completions (the fake engine samples by each completion's seed).
    worker = os.path.join("tests", "fake_vllm_worker.py")
    args = dict(use_vllm="true", max_steps=2)
    finish(launch(worker, cli(assets, tmp_path / "one", per_device_train_batch_size=8, **args), 1, config="cpu"))
    finish(launch(worker, cli(assets, tmp_path / "two", per_device_train_batch_size=4, **args), 2, config="cpu"))
    m1, m2 = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert len(m1) == len(m2) == 2
    for a, b in zip(m1, m2):
        for key in ("reward", "loss", "completion_length", "grad_norm", "vllm/logp_diff_mean", "vllm/logp_diff_max",
                    "vllm/is_weight_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key, a[key], b[key])
    engines = [json.loads((tmp_path / "two" / f"engine-{rank}.json").read_text()) for rank in (0, 1)]
    assert [(e["env"]["RANK"], e["env"]["LOCAL_RANK"], e["env"]["WORLD_SIZE"]) for e in engines] == [
        ("0", "0", "2"), ("1", "1", "2")]
    assert engines[0]["env"]["MASTER_PORT"] == engines[1]["env"]["MASTER_PORT"]  # the launcher's rendezvous
    assert all(e["synced"] > 0 and e["calls"].count("generate") == 2 for e in engines)
    alone = json.loads((tmp_path / "one" / "engine-0.json").read_text())
    assert not set(engines[0]["seeds"]) & set(engines[1]["seeds"])  # each process samples its own completions
    assert sorted(engines[0]["seeds"] + engines[1]["seeds"]) == sorted(alone["seeds"])
    # --vllm_tensor_parallel_size 2: one engine over both processes, which generate both halves together and take
    # their own back (the same completions: each keeps its seed)
    finish(launch(worker, cli(assets, tmp_path / "tp", per_device_train_batch_size=4, vllm_tensor_parallel_size=2,
                              **args), 2, config="cpu"))
    tp = read_jsonl(tmp_path / "tp" / "metrics.jsonl")
    for a, b in zip(m2, tp):
        for key in ("reward", "loss", "completion_length", "grad_norm", "vllm/logp_diff_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)
    grouped = [json.loads((tmp_path / "tp" / f"engine-{rank}.json").read_text()) for rank in (0, 1)]
    assert grouped[0]["seeds"] == grouped[1]["seeds"] == alone["seeds"]
    assert all(e["tp"] == 2 and e["engine_seed"] == grouped[0]["engine_seed"] for e in grouped)
