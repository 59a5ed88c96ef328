"""Flow-GRPO through train_mixgrpo.py (--text_free): each prompt straight to the generator, no VLM; Flow-GRPO-Fast's
random SDE window (--sde_window_range); rewards scored off the critical path (--overlap_rewards, utils/t2i/scoring.py)
with exact resume; the Flow-GRPO recipes parse to Flow-GRPO's published values."""

import json
import os
import subprocess
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import train_mixgrpo as tm
from tests.launch_helpers import cli, failing_fixture, finish, fresh_accelerate_state, launch, sigkill_when
from utils.core.config import ConfigError, parse_config
from utils.core.tracking import read_jsonl
from utils.t2i.data import load_prompt_lines
from utils.t2i.scoring import RewardScorer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a photo of a cat", "a red dog", "a blue cat on the table", 'a sign that says "cat"', "a photo of a dog",
           "red", "blue dog", "a cat"]
TEXT_FREE = dict(text_free=True, reflect_refine=False, tune_text_cot=False, conditioning="generator")


def _cfg(**overrides):
    return tm.MixGRPOConfig(**{**TEXT_FREE, **overrides})


# ---- flags ----


def test_text_free_flags_are_checked_before_anything_loads():
    tm.validate(_cfg(overlap_rewards=True), 4)
    with pytest.raises(ConfigError, match="--overlap_rewards needs --text_free"):
        tm.validate(tm.MixGRPOConfig(overlap_rewards=True), 4)
    for bad in (dict(reflect_refine=True), dict(tune_text_cot=True), dict(conditioning="policy")):
        with pytest.raises(ConfigError, match="--text_free has no VLM: it runs with --reflect_refine false"):
            tm.validate(_cfg(**bad), 4)
        # what the script does first: --text_free alone sets them (the defaults reason, reflect and read the VLM)
        assert tm.text_free_settings(_cfg(**bad)) == _cfg()
    tm.validate(tm.text_free_settings(tm.MixGRPOConfig(text_free=True)), 4)
    tm.validate(_cfg(num_timesteps_gen=10, sde_window_size=2, sde_window_range=[0, 5]), 4)
    for window, size in (([0, 1], 2), ([3, 10], 2), ([0, 5, 6], 2), ([0, 5], 0), ([-1, 4], 2)):
        with pytest.raises(ConfigError, match="--sde_window_range"):
            tm.validate(_cfg(num_timesteps_gen=10, sde_window_size=size, sde_window_range=window), 4)


def test_fast_window_starts_at_random_in_its_range_seeded_by_the_step():
    cfg = _cfg(num_timesteps_gen=10, sde_window_size=2, sde_window_range=[0, 5], seed=3)
    windows = [tm.sde_window(cfg, step) for step in range(60)]
    assert all(w == [w[0], w[0] + 1] and 0 <= w[0] <= 3 for w in windows)
    assert {w[0] for w in windows} == {0, 1, 2, 3}  # every start of [lo, hi - size] is drawn
    assert windows == [tm.sde_window(cfg, step) for step in range(60)]  # a function of (seed, step): resumable
    other = _cfg(num_timesteps_gen=10, sde_window_size=2, sde_window_range=[0, 5], seed=4)
    assert windows != [tm.sde_window(other, step) for step in range(60)]
    sliding = _cfg(num_timesteps_gen=10, sde_window_size=2)  # MixGRPO's window stays as it was
    assert tm.sde_window(sliding, 0) == [0, 1] and tm.sde_window(sliding, 50) == [4, 5]


def test_plain_prompt_files(tmp_path):
    txt = tmp_path / "train.txt"
    txt.write_text("a photo of a cat\n\n  a red dog  \n")
    assert load_prompt_lines(str(txt)) == [{"prompt": "a photo of a cat"}, {"prompt": "a red dog"}]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a cat", "tag": "x"}\n{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl row 1.*'prompt'.*empty text"):
        load_prompt_lines(str(rows))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt: no prompts"):
        load_prompt_lines(str(tmp_path / "empty.txt"))


# ---- the background scorer ----


class _Reward:
    """A reward that takes `delay` seconds, fails on the prompt "boom" and gives None on "skip"."""

    def __init__(self, delay=0.0):
        self.delay, self.calls, self.threads = delay, 0, set()

    def __call__(self, completions, images=None, prompt=None, **columns):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        if "boom" in prompt:
            raise RuntimeError("reward server down")
        return [None if p == "skip" else float(len(p)) for p in prompt]


def test_background_scores_equal_inline_ones_and_a_failure_surfaces_when_read():
    rows = [{"prompt": p} for p in ("ab", "skip", "abcd")]
    inline = RewardScorer(tm.MixGRPOConfig(), _Reward(), background=False)
    reward = _Reward(delay=0.2)
    background = RewardScorer(tm.MixGRPOConfig(), reward, background=True)
    start = time.perf_counter()
    pending = background.submit(["t"] * 3, [None] * 3, rows)
    assert time.perf_counter() - start < 0.1  # submit returns while the reward runs
    got, want = pending.result(), inline.submit(["t"] * 3, [None] * 3, rows).result()
    assert torch.equal(got.isnan(), want.isnan()) and got[~got.isnan()].tolist() == [2.0, 4.0]  # None: NaN, not 0
    assert reward.threads and all(name.startswith("reward-") for name in reward.threads)
    failed = background.submit(["t"], [None], [{"prompt": "boom"}])  # the step goes on; its scores are read later
    with pytest.raises(RuntimeError, match="reward server down"):
        failed.result()
    with pytest.raises(RuntimeError, match="reward server down"):
        inline.submit(["t"], [None], [{"prompt": "boom"}]).result()
    background.close()


def test_the_queue_is_bounded():
    reward = _Reward(delay=0.3)
    scorer = RewardScorer(tm.MixGRPOConfig(), reward, background=True, queue_size=2)
    start = time.perf_counter()
    jobs = [scorer.submit(["t"], [None], [{"prompt": "a"}]) for _ in range(3)]
    assert time.perf_counter() - start >= 0.25  # the third waited for a slot
    assert [j.result().item() for j in jobs] == [1.0, 1.0, 1.0]
    scorer.close()


# ---- the loop: in process, then launched ----


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tiny.pipelines import make_tiny_qwenimage
    from tiny.reward_models import make_tiny_clip

    root = tmp_path_factory.mktemp("flow-grpo")
    with failing_fixture("tests/test_flow_grpo.py's tiny Qwen-Image, tiny CLIP and prompts"):
        (root / "train.txt").write_text("\n".join(PROMPTS) + "\n")
        make_tiny_clip(str(root / "clip"))
        return dict(root=root, generator=make_tiny_qwenimage(str(root / "qwenimage")), clip=str(root / "clip"),
                    prompts=str(root / "train.txt"))


def _flags(world, out, **overrides):
    return {**TEXT_FREE, **dict(
        generator_name_or_path=world["generator"], dataset_name="prompts", train_data_path=world["prompts"],
        val_data_path=None, reward_fn="pickscore", reward_kwargs={"model_name_or_path": world["clip"]},
        group_size=2, policy_group_size=1, prompts_per_policy_group=2, image_size=32, num_timesteps_gen=3,
        generator_lora_r=4, learning_rate=3e-2, warmup_steps=0, report_to="none", output_dir=str(out), seed=0,
        max_steps=4, save_steps=2, log_completions=4), **overrides}


def _arg(value):
    """A flag's value on the command line: JSON for dicts and lists, none for None, lower-case booleans."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else value


def _run(world, out, **overrides):
    try:
        return tm.main(tm.MixGRPOConfig(**_flags(world, out, cpu_threads=1, **overrides)))
    finally:
        fresh_accelerate_state()


def _steps(out):
    return {m["step"]: m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m}


def _numbers(metrics):
    return {k: v for k, v in metrics.items() if isinstance(v, float) and "time" not in k and "memory" not in k}


def _lora(out, step):
    return load_file(str(out / f"checkpoint-{step}" / "generator_lora" / "pytorch_lora_weights.safetensors"))


@pytest.mark.slow
def test_text_free_trains_the_generator_on_pickscore_overlapped_and_resumes_bit_for_bit(world, tmp_path):
    out = _run(world, tmp_path / "overlap", overlap_rewards=True)
    assert out["policy"] is None  # no VLM loaded
    steps = _steps(tmp_path / "overlap")
    assert sorted(steps) == [1, 2, 3, 4] and all("image/score" in m for m in steps.values())
    assert not (tmp_path / "overlap" / "checkpoint-2" / "model.safetensors").exists()  # the generator alone
    lora1, lora2 = _lora(tmp_path / "overlap", 2), _lora(tmp_path / "overlap", 4)
    assert max((lora1[k] - lora2[k]).abs().max().item() for k in lora1) > 1e-6  # the LoRA trained
    # step 2 was drawn before step 1 trained (one step off-policy), step 1 alike with or without the overlap
    plain = _run(world, tmp_path / "plain", max_steps=2)
    first, second = _steps(tmp_path / "plain"), steps
    assert _numbers(first[1]) == _numbers(second[1])
    assert first[2]["image/score"] != second[2]["image/score"]
    # the step before a checkpoint draws no next step: a run resumed from checkpoint-2 is the same run
    _run(world, tmp_path / "resumed", overlap_rewards=True, resume_from_checkpoint=str(tmp_path / "overlap" /
                                                                                       "checkpoint-2"))
    again = _steps(tmp_path / "resumed")
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert _numbers(again[step]) == _numbers(steps[step]), step
    a, b = _lora(tmp_path / "overlap", 4), _lora(tmp_path / "resumed", 4)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    del plain


@pytest.mark.slow
@pytest.mark.full
def test_launched_text_free_run_killed_with_sigkill_resumes_exactly(world, tmp_path):
    def start(out, **extra):
        flags = _flags(world, out, max_steps=5, save_steps=2, overlap_rewards=True, **extra)
        return launch("train_mixgrpo.py", cli(**{k: _arg(v) for k, v in flags.items()}))

    finish(start(tmp_path / "full"), what="the uninterrupted run")
    victim = start(tmp_path / "killed")
    sigkill_when(victim, tmp_path / "killed" / "checkpoint-2" / "trainer_state.json")
    assert not (tmp_path / "killed" / "checkpoint-4").exists()
    finish(start(tmp_path / "killed", resume_from_checkpoint="latest"), what="the resumed run")
    full, resumed = _steps(tmp_path / "full"), _steps(tmp_path / "killed")
    for step in (3, 4, 5):
        for key, value in _numbers(full[step]).items():
            assert resumed[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
    a, b = _lora(tmp_path / "full", 5), _lora(tmp_path / "killed", 5)
    assert all(torch.allclose(a[k], b[k], atol=1e-7) for k in a)


@pytest.mark.full
def test_a_reward_whose_package_is_missing_is_refused_in_one_line(world, tmp_path):
    """In an environment made from requirements.txt alone (no requirements-rewards.txt), --reward_fn hpsv2 stops
    before any model loads, in one line naming the file to install."""
    from tests.requirements_env import closure, make_view_venv, pinned

    python = make_view_venv(str(tmp_path / "venv"), closure(pinned()))
    flags = _flags(world, tmp_path / "run", reward_fn="hpsv2", reward_kwargs={})
    proc = subprocess.run([python, os.path.join(REPO, "train_mixgrpo.py"), *cli(**{k: _arg(v) for k, v in
                                                                                   flags.items()})], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert "reward 'hpsv2' needs the package 'open_clip_torch'" in lines[-1], proc.stderr[-3000:]
    assert "pip install -r requirements-rewards.txt" in lines[-1] and "Traceback" not in proc.stderr


# ---- the recipes ----

FLOW_GRPO_SD3 = dict(text_free=True, reflect_refine=False, tune_text_cot=False, conditioning="generator",
                     generator_name_or_path="stabilityai/stable-diffusion-3.5-medium", group_size=24, image_size=512,
                     num_timesteps_gen=10, eval_num_timesteps=40, noise_level_gen=0.7, cfg_scale_gen=4.5,
                     cfg_interval=[0.0, 1.0], generator_lora_r=32, generator_lora_alpha=64, learning_rate=3e-4,
                     clip_range_image=1e-4, mse_weight=1.0, adam_beta2=0.999, weight_decay=1e-4, max_grad_norm=1.0,
                     sde_window_size=9, timestep_shift=None)


@pytest.mark.parametrize("name, dataset, reward, kl", [
    ("flow_grpo_sd3_geneval", "geneval", "geneval", 0.04),
    ("flow_grpo_sd3_pickscore", "prompts", "pickscore", 0.01),
    ("flow_grpo_sd3_ocr", "prompts", "ocr", 0.04),
])
def test_flow_grpo_sd3_recipes_hold_flow_grpos_values(name, dataset, reward, kl):
    cfg = parse_config(tm.MixGRPOConfig, ["--config", os.path.join(REPO, "recipes", f"{name}.yaml")])
    for key, value in FLOW_GRPO_SD3.items():
        assert getattr(cfg, key) == (pytest.approx(value) if isinstance(value, float) else value), key
    assert (cfg.dataset_name, cfg.reward_fn, cfg.kl_weight_image) == (dataset, reward, pytest.approx(kl))
    assert cfg.reward_kwargs == ({"divisor": 26} if reward == "pickscore" else {})
    cfg.train_data_path = cfg.val_data_path = "prompts.txt"
    tm.validate(cfg, 8)


def test_flow_grpo_qwenimage_recipe_holds_its_fast_window():
    cfg = parse_config(tm.MixGRPOConfig, ["--config", os.path.join(REPO, "recipes",
                                                                   "flow_grpo_qwenimage_pickscore.yaml")])
    assert (cfg.generator_name_or_path, cfg.group_size, cfg.num_timesteps_gen, cfg.eval_num_timesteps) == \
        ("Qwen/Qwen-Image", 16, 10, 50)
    assert (cfg.noise_level_gen, cfg.sde_window_size, cfg.sde_window_range, cfg.cfg_scale_gen,
            cfg.kl_weight_image) == (1.2, 2, [0, 5], 4.0, 0.0)
    cfg.train_data_path = cfg.val_data_path = "prompts.txt"
    tm.validate(cfg, 4)


def test_the_tiny_flow_grpo_recipe_validates_on_one_process():
    cfg = parse_config(tm.MixGRPOConfig, ["--config", os.path.join(REPO, "recipes", "tiny_flow_grpo.yaml")])
    tm.validate(cfg, 1)
    assert cfg.text_free and cfg.generator_name_or_path == "tiny" and cfg.reward_fn == "shapes_t2i"
