"""TRL's generation and reference flags in train_grpo.py: --steps_per_generation / --generation_batch_size (one
generation feeds several optimizer steps, with --num_iterations and gradient accumulation as TRL combines them; exact
resume from a checkpoint taken inside a generation), --sync_ref_model (TR-DPO) and --use_bias_correction_kl."""

import contextlib
import json

import pytest
from safetensors.torch import load_file

import train_grpo
from tests.grpo_helpers import shapes_assets
from tests.launch_helpers import fresh_accelerate_state
from train_grpo import GRPOConfig, generation_steps, validate
from utils.core.config import ConfigError
from utils.core.tracking import read_jsonl


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shapes_assets(tmp_path_factory, "tests/test_generation_batch.py", 48)


def config(assets=None, out="unused", **overrides):
    base = dict(model_name_or_path=assets["qwen"] if assets else "tiny", dataset_name=assets["data"] if assets
                else "tiny", output_dir=str(out), per_device_train_batch_size=8, num_generations=4,
                max_completion_length=16, max_prompt_length=256, max_steps=4, learning_rate=1e-3, report_to="none",
                save_steps=100, logging_steps=1, seed=0, reward_funcs=["tests.grpo_helpers:completion_length"],
                eval_dataset_name=None, log_completions=True)
    base.update(overrides)
    return GRPOConfig(**base)


def run(cfg, monkeypatch=None):
    """Run train_grpo.main; returns (metrics rows, the micro-batch ids each optimizer step trained on, rounds)."""
    steps, rounds = [], []
    with monkeypatch.context() if monkeypatch else contextlib.nullcontext() as patch:
        return _run(cfg, patch, steps, rounds)


def _run(cfg, monkeypatch, steps, rounds):
    if monkeypatch is not None:
        sample, step = train_grpo.sample_round, train_grpo.optimisation_pass

        def counting_round(*a, **kw):
            out = sample(*a, **kw)
            rounds.append([id(mb) for mb in out[0]])
            return out

        def recording_pass(ro, batches, **kw):
            steps.append([id(mb) for mb in batches])
            return step(ro, batches, **kw)

        monkeypatch.setattr(train_grpo, "sample_round", counting_round)
        monkeypatch.setattr(train_grpo, "optimisation_pass", recording_pass)
    try:
        train_grpo.main(cfg)
    finally:
        fresh_accelerate_state()
    return {m["step"]: m for m in read_jsonl(f"{cfg.output_dir}/metrics.jsonl")}, steps, rounds


@pytest.mark.parametrize("flags, processes, expected", [
    ({}, 1, 1), (dict(gradient_accumulation_steps=2), 1, 2), (dict(steps_per_generation=4), 1, 4),
    (dict(generation_batch_size=32), 1, 4), (dict(generation_batch_size=32), 2, 2),
    (dict(steps_per_generation=4, generation_batch_size=32), 1, 4),
    (dict(steps_per_generation=1, gradient_accumulation_steps=2), 1, 2),  # generated more often, one policy
])
def test_steps_per_generation_follows_trl(flags, processes, expected):
    assert generation_steps(config(**flags), processes) == expected


@pytest.mark.parametrize("flags, message", [
    (dict(steps_per_generation=3, gradient_accumulation_steps=2), "not a multiple of --gradient_accumulation_steps"),
    (dict(steps_per_generation=1, gradient_accumulation_steps=2, num_iterations=2), "a divisor of it also runs"),
    (dict(generation_batch_size=12), "not a multiple of --per_device_train_batch_size 8"),
    (dict(generation_batch_size=32, steps_per_generation=2), "disagree"),
    (dict(sync_ref_model=True), "--sync_ref_model with --beta 0"),
    (dict(sync_ref_model=True, beta=0.1, ref_model_mixup_alpha=1.5), "--ref_model_mixup_alpha 1.5"),
    (dict(sync_ref_model=True, beta=0.1, ref_model_sync_steps=0), "--ref_model_sync_steps 0"),
    (dict(tools=["crop_image"], steps_per_generation=2, save_steps=3), "--save_steps 3 must be a multiple of the 2"),
])
def test_impossible_generation_flags_are_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(config(**flags), 1)


@pytest.mark.slow
def test_one_generation_feeds_several_optimizer_steps_with_num_iterations(assets, tmp_path, monkeypatch):
    """S = 2 micro-batches per generation, GA 1, mu 2: a round is 4 optimizer steps, mb0, mb1, mb0, mb1 (TRL's order:
    the generation batch's slices, num_iterations times); the importance ratio moves off 1 once the policy has moved
    (behaviour log-probs stored at generation); 6 steps take two generations."""
    metrics, steps, rounds = run(config(assets, tmp_path, steps_per_generation=2, num_iterations=2, max_steps=6),
                                 monkeypatch)
    assert [len(r) for r in rounds] == [2, 2]
    first, second = rounds
    assert steps == [[first[0]], [first[1]], [first[0]], [first[1]], [second[0]], [second[1]]]
    assert metrics[1]["ratio_max_dev"] == 0.0 and metrics[5]["ratio_max_dev"] == 0.0  # fresh samples
    assert all(metrics[s]["ratio_max_dev"] > 0 for s in (2, 3, 4, 6))  # the policy moved since they were drawn


@pytest.mark.slow
def test_generation_batch_size_is_steps_per_generation_in_completions(assets, tmp_path, monkeypatch):
    a, _, rounds_a = run(config(assets, tmp_path / "a", steps_per_generation=2, max_steps=2), monkeypatch)
    b, _, rounds_b = run(config(assets, tmp_path / "b", generation_batch_size=16, max_steps=2), monkeypatch)
    assert len(rounds_a) == len(rounds_b) == 1
    assert [a[s]["loss"] for s in (1, 2)] == [b[s]["loss"] for s in (1, 2)]


@pytest.mark.slow
def test_resume_inside_a_generation_matches_the_uninterrupted_run_bit_for_bit(assets, tmp_path):
    """A checkpoint after the 3rd of a round's 4 optimizer steps holds the rest of the round (completions, rewards,
    behaviour and reference log-probs, the synced reference): the resumed steps 4-6 equal the uninterrupted run's,
    and so do the final weights."""
    flags = dict(steps_per_generation=2, num_iterations=2, max_steps=6, save_steps=1, beta=0.04, sync_ref_model=True,
                 ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    full, _, _ = run(config(assets, tmp_path / "full", **flags))
    state = json.loads((tmp_path / "full" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["round"]["position"] == 3 and state["round_index"] == 0
    resumed, _, _ = run(config(assets, tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "full" /
                                                                                         "checkpoint-3"), **flags))
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in ("reward", "loss", "kl", "grad_norm", "ratio_max_dev", "completion_length"):
            assert resumed[step][key] == full[step][key], (step, key)
    a = load_file(str(tmp_path / "full" / "checkpoint-6" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoint-6" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    drawn = [(r["step"], r["id"], r["completion"]) for r in read_jsonl(tmp_path / "full" / "completions.jsonl")]
    again = [(r["step"], r["id"], r["completion"]) for r in read_jsonl(tmp_path / "resumed" / "completions.jsonl")]
    assert again == [d for d in drawn if d[0] >= 4]


@pytest.mark.slow
def test_sync_ref_model_with_alpha_one_makes_the_next_rounds_kl_zero(assets, tmp_path):
    """alpha 1 every 2 steps: the reference becomes the policy that generates the next round, so that round's first
    step has KL exactly 0; without syncing the KL to the initial model grows."""
    flags = dict(beta=0.1, max_steps=4, learning_rate=5e-3)
    synced, _, _ = run(config(assets, tmp_path / "synced", sync_ref_model=True, ref_model_sync_steps=2,
                              ref_model_mixup_alpha=1.0, **flags))
    plain, _, _ = run(config(assets, tmp_path / "plain", **flags))
    assert synced[3]["kl"] == 0.0 and plain[3]["kl"] > 0
    assert synced[2]["kl"] == plain[2]["kl"] > 0  # before the first sync the reference is the initial model


@pytest.mark.slow
def test_bias_corrected_kl_keeps_the_loss_and_moves_the_gradient(assets, tmp_path):
    flags = dict(beta=0.5, max_steps=2, learning_rate=5e-3)
    plain, _, _ = run(config(assets, tmp_path / "plain", **flags))
    corrected, _, _ = run(config(assets, tmp_path / "corrected", use_bias_correction_kl=True, **flags))
    assert corrected[1]["loss"] == plain[1]["loss"] and corrected[1]["grad_norm"] == plain[1]["grad_norm"]  # KL 0
    assert corrected[2]["loss"] == pytest.approx(plain[2]["loss"], rel=1e-6)  # the ratio is 1 on-policy
    assert corrected[2]["grad_norm"] != plain[2]["grad_norm"]


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("launcher", ["ddp", "zero3", "lora"])
def test_sync_ref_model_on_two_processes(assets, tmp_path, launcher):
    """Two processes, rounds of 2 optimizer steps, the reference synced with alpha 1 after every step: each round's
    first step has KL 0 (the reference is the policy that generated it) and its second a KL > 0, under DDP (ZeRO-1/2
    hold whole weights and mix them with the same code), ZeRO-3 (pairs gathered, mixed on the first process) and DDP
    with LoRA (the reference adapters); the checkpoint inside a round resumes to the same steps."""
    from tests.launch_helpers import cli, finish, launch

    args = dict(model_name_or_path=assets["qwen"], dataset_name=assets["data"], output_dir=str(tmp_path / "run"),
                num_generations=4, per_device_train_batch_size=4, max_completion_length=8, max_steps=4,
                learning_rate=5e-3, report_to="none", seed=0, reward_funcs="tests.grpo_helpers:completion_length",
                beta=0.1, sync_ref_model="true", ref_model_sync_steps=1, ref_model_mixup_alpha=1.0,
                steps_per_generation=2, save_steps=3, eval_dataset_name="none")
    if launcher == "lora":
        args.update(use_peft="true", lora_r=4, learning_rate=5e-2)
    config = {"ddp": "cpu", "lora": "cpu", "zero3": "zero3"}[launcher]
    env = {"DS_ACCELERATOR": "cpu"} if launcher.startswith("zero") else None
    finish(launch("train_grpo.py", cli(**args), 2, config=config, env=env), what=f"sync_ref_model ({launcher})")
    metrics = {m["step"]: m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert metrics[3]["kl"] < 1e-7 and metrics[1]["kl"] < 1e-7
    assert metrics[2]["kl"] > 1e-6 and metrics[4]["kl"] > 1e-6
    resumed = dict(args, output_dir=str(tmp_path / "resumed"), resume_from_checkpoint=str(tmp_path / "run" /
                                                                                          "checkpoint-3"))
    finish(launch("train_grpo.py", cli(**resumed), 2, config=config, env=env), what=f"resume ({launcher})")
    again = {m["step"]: m for m in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")}
    assert again[4]["loss"] == pytest.approx(metrics[4]["loss"], rel=1e-5, abs=1e-7)
    assert again[4]["kl"] == pytest.approx(metrics[4]["kl"], rel=1e-4, abs=1e-8)
