"""train_grpo.py end to end on tiny models: outputs, reward weighting, loss variants, model families,
1 vs 2 processes, and exact resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import train_grpo
from tiny.models import make_tiny_llm, make_tiny_vlm
from tiny.shapes import make_shapes_vqa
from train_grpo import GRPOConfig
from utils.tracking import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    data = str(root / "shapes")
    make_shapes_vqa(48, seed=0, kinds=("color", "count")).save_to_disk(data)
    return {"qwen": make_tiny_vlm(str(root / "qwen"), seed=0), "data": data, "root": root}


def config(assets, out, **overrides):
    base = dict(model_name_or_path=assets["qwen"], dataset_name=assets["data"], output_dir=str(out),
                per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_prompt_length=256,
                max_steps=2, learning_rate=1e-3, report_to="none", save_steps=100, logging_steps=1, seed=0)
    base.update(overrides)
    return GRPOConfig(**base)


def run(cfg):
    from accelerate.state import AcceleratorState, GradientState

    try:
        return train_grpo.main(cfg)
    finally:  # each run in this process gets a fresh accelerate state
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


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


@pytest.mark.slow
def test_prompt_over_max_length_names_the_sample(assets, tmp_path):
    with pytest.raises(ValueError, match=r"sample 'shapes-0-\d+': prompt is \d+ tokens.*--max_prompt_length 20"):
        run(config(assets, tmp_path, max_prompt_length=20))


def launch(args, num_processes, env=None):
    cmd = [ACCELERATE, "launch", "--cpu", "--num_processes", str(num_processes), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", os.path.join(REPO, "train_grpo.py"), *args]
    # Its own session, so a test can SIGKILL the launcher and every worker it started (killpg).
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def cli(assets, out, **overrides):
    cfg = dict(model_name_or_path=assets["qwen"], dataset_name=assets["data"], output_dir=str(out),
               num_generations=4, max_completion_length=8, max_steps=3, learning_rate=1e-3, report_to="none",
               reward_funcs="tests.grpo_helpers:completion_length", seed=0)
    cfg.update(overrides)
    return [x for k, v in cfg.items() for x in (f"--{k}", str(v))]


def finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, "\n".join(line for line in out.splitlines() if "rror" in line)[-3000:]
    return out


@pytest.mark.slow
def test_two_processes_match_one_process(assets, tmp_path):
    # Same global batch (8 completions = 2 prompts x 4), split over 1 or 2 processes.
    one = launch(cli(assets, tmp_path / "one", per_device_train_batch_size=8), 1)
    finish(one)
    two = launch(cli(assets, tmp_path / "two", per_device_train_batch_size=4), 2)
    finish(two)
    m1, m2 = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert len(m1) == len(m2) == 3
    for a, b in zip(m1, m2):
        for key in ("reward", "reward_std", "loss", "completion_length", "clip_ratio"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key, a[key], b[key])


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(assets, tmp_path):
    args = dict(per_device_train_batch_size=8, max_steps=6, save_steps=2, max_completion_length=16, log_completions=True)
    finish(launch(cli(assets, tmp_path / "full", **args), 1))
    victim = launch(cli(assets, tmp_path / "killed", **args), 1)
    deadline = time.time() + 300
    while not (tmp_path / "killed" / "checkpoint-2").exists():
        assert victim.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)  # the launcher and its worker: the run really stops here
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    time.sleep(1.0)  # nothing may still be writing into the folder
    assert not (tmp_path / "killed" / "checkpoint-6").exists()
    assert len(read_jsonl(tmp_path / "killed" / "metrics.jsonl")) < 6, "the kill came after the run had finished"
    finish(launch(cli(assets, tmp_path / "killed", resume_from_checkpoint="latest", **args), 1))
    full = {m["step"]: m for m in read_jsonl(tmp_path / "full" / "metrics.jsonl")}
    resumed = {m["step"]: m for m in read_jsonl(tmp_path / "killed" / "metrics.jsonl")}
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(3, 7):
        for key in ("reward", "loss", "completion_length"):
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-5, abs=1e-6), (step, key)
    # A random tiny model earns the same rewards whatever it is asked, so the metrics alone would not
    # notice a resume that forgot the sampler's position: the drawn prompts and completions must match too.
    def drawn(run_dir):
        rows = read_jsonl(run_dir / "completions.jsonl")
        return [(r["step"], r["id"], r["prompt"], r["completion"]) for r in rows if r["step"] >= 3]

    assert drawn(tmp_path / "killed") == drawn(tmp_path / "full") and len(drawn(tmp_path / "full")) == 4 * 8


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
    import utils.hub

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

    monkeypatch.setattr(utils.hub, "HfApi", FakeApi)
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
