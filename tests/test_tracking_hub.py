import importlib.util
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from accelerate import Accelerator
from safetensors.torch import save_file

import utils.core.hub as hub
from utils.core.hub import HubUploader, HubUploadError, stage_for_hub
from utils.core.tracking import RunLogger, peak_memory_mb, plot_reward_curve, read_jsonl, tracker_list, write_summary


def steps_in(path):
    return [row["step"] for row in read_jsonl(path)]


# ---------------------------------------------------------------- trackers
def test_tracker_list_maps_names_to_installed_trackers():
    assert tracker_list("none") == [] and tracker_list(None) == [] and tracker_list([]) == []
    assert tracker_list("tensorboard") == ["tensorboard"]
    assert tracker_list("tensorboard,tensorboard") == ["tensorboard"]
    everything = tracker_list("all")
    assert "tensorboard" in everything
    for name in ("wandb", "trackio"):
        assert (name in everything) == (importlib.util.find_spec(name) is not None)
    with pytest.raises(ValueError, match="unknown tracker 'tensorbord'"):
        tracker_list("tensorbord")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_tracker_list_wandb_missing_is_a_clear_error():
    with pytest.raises(ValueError, match="wandb.*not installed"):
        tracker_list(["tensorboard", "wandb"])


# ---------------------------------------------------------------- RunLogger
def test_run_logger_writes_jsonl_tensorboard_and_a_line_per_step(tmp_path, capsys):
    accelerator = Accelerator(cpu=True, log_with=tracker_list("tensorboard"), project_dir=str(tmp_path))
    config = {"beta": 0.04, "reward_funcs": ["accuracy", "format"], "epsilon_high": None}
    logger = RunLogger(tmp_path, accelerator, report_to="tensorboard", config=config, total_steps=4)
    logger.log(1, {"reward": torch.tensor(0.25), "loss": 1.5, "kl": 0.0, "lr": 1e-5})
    logger.log(2, {"train/reward": 0.5, "loss": 1.25})
    logger.log_completions(2, [{"prompt": "q", "completion": "a", "reward": 1.0}, {"prompt": "q", "completion": "b"}])
    assert logger.last_metrics == {"train/reward": 0.5, "loss": 1.25}
    logger.close()

    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 1, "reward": 0.25, "loss": 1.5, "kl": 0.0, "lr": 1e-5},
                    {"step": 2, "train/reward": 0.5, "loss": 1.25}]
    completions = read_jsonl(tmp_path / "completions.jsonl")
    assert [c["step"] for c in completions] == [2, 2] and completions[1]["completion"] == "b"
    assert list(tmp_path.glob("mmgrpo/events.out.tfevents.*")), "no TensorBoard event file"
    out = capsys.readouterr().out  # pytest's stdout is not a TTY: the compact line replaces the bar
    assert "step 1/4" in out and "reward 0.25" in out and "loss 1.5" in out
    assert "step 2/4" in out and "reward 0.5" in out and "eta" in out


def test_run_logger_sends_a_grid_png_to_tensorboard(tmp_path):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    Image.new("RGB", (24, 16), (255, 0, 0)).save(tmp_path / "grid.png")
    accelerator = Accelerator(cpu=True, log_with=tracker_list("tensorboard"), project_dir=str(tmp_path))
    logger = RunLogger(tmp_path, accelerator, report_to="tensorboard", total_steps=2)
    logger.log_image(2, "heldout/after", tmp_path / "grid.png")
    logger.log_image(2, "heldout/missing", tmp_path / "absent.png")  # no file: nothing sent, no error
    logger.close()
    events = EventAccumulator(str(next(tmp_path.glob("mmgrpo/events.out.tfevents.*")).parent))
    events.Reload()
    assert events.Tags()["images"] == ["heldout/after"]
    (image,) = events.Images("heldout/after")
    assert (image.step, image.width, image.height) == (2, 24, 16)


def test_run_logger_resume_truncates_rows_after_start_step(tmp_path):
    accelerator = Accelerator(cpu=True)
    with RunLogger(tmp_path, accelerator, report_to="none", total_steps=10) as logger:
        for step in range(1, 6):
            logger.log(step, {"reward": step / 10})
            logger.log_completions(step, [{"completion": f"c{step}"}])
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "rew')  # the crash tore the last line

    with RunLogger(tmp_path, accelerator, report_to="none", total_steps=10, start_step=3) as logger:
        assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3]
        assert steps_in(tmp_path / "completions.jsonl") == [1, 2, 3]
        logger.log(4, {"reward": 0.9})
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]

    # a fresh run (start_step 0) in the same folder does not append to the old run's logs
    with RunLogger(tmp_path, accelerator, report_to="none", total_steps=10) as logger:
        logger.log(1, {"reward": 0.0})
    assert steps_in(tmp_path / "metrics.jsonl") == [1]


def test_run_logger_rich_progress_bar_path(tmp_path):
    accelerator = Accelerator(cpu=True)
    logger = RunLogger(tmp_path, accelerator, report_to="none", total_steps=3, progress=True)
    for step in range(1, 4):
        logger.log(step, {"reward": 0.1 * step, "kl": 0.01})
    assert logger._progress.tasks[0].completed == 3
    logger.close()
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3]


def test_run_logger_is_silent_on_other_ranks(tmp_path):
    other_rank = SimpleNamespace(is_main_process=False)
    logger = RunLogger(tmp_path / "run", other_rank, report_to="tensorboard", total_steps=3)
    logger.log(1, {"reward": 1.0})
    logger.log_completions(1, [{"completion": "x"}])
    logger.close()
    assert not (tmp_path / "run").exists()


def test_report_to_without_accelerator_trackers_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="log_with"):
        RunLogger(tmp_path, Accelerator(cpu=True), report_to="tensorboard", total_steps=1)


def test_plot_reward_curve_and_missing_key(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "reward": (s % 3) / 3, "loss": 1 / s}) + "\n"
                               for s in range(1, 30)))
    png = plot_reward_curve(metrics, tmp_path / "plots" / "reward.png", keys=("reward", "loss"), title="run")
    data = Path(png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match=r"metrics.jsonl.*accuracy.*available keys: \['loss', 'reward'\]"):
        plot_reward_curve(metrics, tmp_path / "x.png", keys=("accuracy",))


def test_peak_memory_and_summary(tmp_path):
    before = peak_memory_mb()
    assert 10 < before < 1e6  # this Python process holds torch: tens of MB at least
    blob = bytearray(64 * 2**20)  # touch 64 MiB
    blob[::4096] = b"x" * len(blob[::4096])
    assert peak_memory_mb() >= before
    path = write_summary(tmp_path, {"final_reward": torch.tensor(0.75), "steps": 10, "peak_memory_mb": before})
    assert json.loads(Path(path).read_text()) == {"final_reward": 0.75, "steps": 10, "peak_memory_mb": before}
    del blob


# ---------------------------------------------------------------- hub
def make_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja",
                 "generation_config.json"):
        (folder / name).write_text("{}")
    (folder / "trainer_state.json").write_text('{"global_step": 3}')
    (folder / "optimizer.bin").write_bytes(b"state")
    (folder / "training_state").mkdir()
    (folder / "training_state" / "random_states_0.pkl").write_bytes(b"rng")
    return folder


RECIPE = {"learning_rate": 1e-5, "num_generations": 8, "reward_funcs": ["accuracy", "cpr"]}
METRICS = {"reward": 0.8125, "accuracy": 0.5}


def read_card(folder: Path):
    text = (folder / "README.md").read_text()
    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


def test_stage_for_hub_copies_only_the_model_and_writes_a_card(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "checkpoint-3")
    staged = Path(stage_for_hub(checkpoint, tmp_path / "stage", recipe=RECIPE, metrics=METRICS,
                                base_model="Qwen/Qwen2.5-VL-3B-Instruct", script="train_grpo.py"))
    assert sorted(p.name for p in staged.iterdir()) == sorted([
        "README.md", "model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
        "preprocessor_config.json", "chat_template.jinja", "generation_config.json"])
    front, body = read_card(staged)
    assert front["library_name"] == "transformers"
    assert front["base_model"] == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert {"mmgrpo", "grpo"} <= set(front["tags"])
    recipe_block = body.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(recipe_block) == RECIPE
    assert "| reward | 0.8125 |" in body and "| accuracy | 0.5 |" in body
    assert "AutoModelForImageTextToText" in body  # a VLM checkpoint


def test_stage_for_hub_takes_named_subfolders_and_several_base_models(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "checkpoint-3")
    (checkpoint / "generator_lora").mkdir()
    (checkpoint / "generator_lora" / "pytorch_lora_weights.safetensors").write_bytes(b"lora")
    staged = Path(stage_for_hub(checkpoint, tmp_path / "stage", recipe={}, metrics={}, base_model=["vlm", "gen"],
                                parts=["generator_lora"], notes="## The image generators\n\nread me"))
    assert (staged / "generator_lora" / "pytorch_lora_weights.safetensors").read_bytes() == b"lora"
    assert not (staged / "training_state").exists()
    front, body = read_card(staged)
    assert front["base_model"] == ["vlm", "gen"] and "## The image generators" in body
    with pytest.raises(FileNotFoundError, match="edit_generator_lora"):
        stage_for_hub(checkpoint, tmp_path / "stage2", parts=["edit_generator_lora"])


def test_stage_for_hub_without_weights_names_the_folder(tmp_path):
    (tmp_path / "training_state").mkdir()
    with pytest.raises(FileNotFoundError, match="training_state"):
        stage_for_hub(tmp_path / "training_state", tmp_path / "stage", recipe={}, metrics={})


class FakeApi:
    """Records calls; upload_folder blocks until released, like a slow network."""

    instances = []

    def __init__(self, token=None):
        self.token = token
        self.calls = []
        self.release = threading.Event()
        FakeApi.instances.append(self)

    def create_repo(self, repo_id, private=False, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private, exist_ok))

    def upload_folder(self, repo_id, folder_path, commit_message):
        assert self.release.wait(10)
        files = sorted(p.name for p in Path(folder_path).iterdir())
        self.calls.append(("upload_folder", repo_id, files, commit_message))
        return f"commit-{len(self.calls)}"


def test_uploader_pushes_staged_folder_in_background(tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "HfApi", FakeApi)
    checkpoint = make_checkpoint(tmp_path / "checkpoint-3")
    uploader = HubUploader("me/run", token="hf_x", private=True)
    api = FakeApi.instances[-1]
    future = uploader.push(checkpoint, recipe=RECIPE, metrics=METRICS, base_model="base", script="train_sft.py")
    assert not future.done()  # training goes on while the upload is in flight ...
    import shutil
    shutil.rmtree(checkpoint)  # ... and may prune the checkpoint it came from
    api.release.set()
    assert uploader.wait() == ["commit-2"]
    assert api.token == "hf_x"
    assert api.calls[0] == ("create_repo", "me/run", True, True)
    _, repo_id, files, message = api.calls[1]
    assert repo_id == "me/run" and "checkpoint-3" in message
    assert "model.safetensors" in files and "README.md" in files
    assert "trainer_state.json" not in files and "optimizer.bin" not in files and "training_state" not in files


def test_uploader_accepts_a_card_dict(tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "HfApi", FakeApi)
    checkpoint = make_checkpoint(tmp_path / "checkpoint-9")
    uploader = HubUploader("me/run")
    FakeApi.instances[-1].release.set()
    uploader.push(checkpoint, {"recipe": RECIPE, "metrics": METRICS, "base_model": "b", "script": "train_grpo.py"})
    assert uploader.wait() == ["commit-2"]


def test_unreachable_hub_is_reported_by_wait_not_by_push(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    checkpoint = make_checkpoint(tmp_path / "checkpoint-3")
    uploader = HubUploader("me/run", token="hf_not_a_real_token")
    future = uploader.push(checkpoint, recipe=RECIPE, metrics=METRICS, base_model="b", script="train_grpo.py")
    # training continues: push returned a Future; the failure waits in it
    with pytest.raises(HubUploadError, match="checkpoint-3"):
        uploader.wait()
    assert isinstance(future.exception(), OSError)
    results = uploader.wait()  # the report is given once
    assert results == []
