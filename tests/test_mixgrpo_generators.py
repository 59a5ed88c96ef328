"""train_mixgrpo.py with every generator adapter (Qwen-Image, Qwen-Image-Edit Plus as the refine stage's generator,
Qwen-Image 2.1, SD3/3.5, FLUX.1, FLUX.2 Klein) on tiny pipelines that carry the real checkpoints' scheduler configs:
the flag checks before loading (fast) and, in the full tier, two steps of `accelerate launch train_mixgrpo.py` per
adapter (reason, then reflect + refine where the adapter has an edit path) with a finite loss, a trained image LoRA,
checkpoints, and an exact resume before the second step."""

import json
import math
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

import train_mixgrpo as tm
from train_mixgrpo import MixGRPOConfig
from utils.core.config import ConfigError
from utils.core.tracking import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
# adapter -> (tiny pipeline maker, can refine, extra flags)
ADAPTERS = {
    "qwenimage": ("make_tiny_qwenimage", True, {}),
    "qwenimage21": ("make_tiny_qwenimage21", True, {}),  # refines through its input-image path, image CFG on
    "edit_plus": ("make_tiny_qwenimage_edit_plus", True, {}),  # the refine stage's generator beside Qwen-Image
    "sd3": ("make_tiny_sd3", False, {}),
    "flux": ("make_tiny_flux", False, {}),
    "klein": ("make_tiny_klein", True, {"generator_kwargs": json.dumps({"text_encoder_out_layers": [1]}),
                                        "cfg_img_scale_edit": 1.0}),
}


class _Built(dict):
    """Each tiny pipeline folder, built the first time a test asks for it."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        from tiny import pipelines

        self[name] = getattr(pipelines, ADAPTERS[name][0])(str(self.root / name))
        return self[name]


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    return _Built(tmp_path_factory.mktemp("generators"))


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_adapters_without_an_edit_path_refuse_reflect_refine_before_loading(pipes, name):
    cfg = MixGRPOConfig(generator_name_or_path=pipes[name], conditioning="generator", cfg_img_scale_edit=1.0)
    with pytest.raises(ConfigError, match=r"--reflect_refine: .* no edit path"):
        tm.check_generators(cfg, pipes[name])
    tm.check_generators(MixGRPOConfig(conditioning="generator", reflect_refine=False), pipes[name])
    with pytest.raises(ConfigError, match="reads its own text encoders.*--conditioning generator"):
        tm.check_generators(MixGRPOConfig(conditioning="base", reflect_refine=False), pipes[name])


def test_klein_refines_without_image_cfg_and_qwen_image_with_it(pipes):
    tm.check_generators(MixGRPOConfig(conditioning="generator", cfg_img_scale_edit=1.0), pipes["klein"])
    with pytest.raises(ConfigError, match="--cfg_img_scale_edit 1.5: .*no image-free branch"):
        tm.check_generators(MixGRPOConfig(conditioning="generator"), pipes["klein"])
    tm.check_generators(MixGRPOConfig(conditioning="base"), pipes["qwenimage"])
    beside_klein = MixGRPOConfig(conditioning="generator", cfg_img_scale_edit=1.0,
                                 edit_generator_name_or_path=pipes["qwenimage"])
    with pytest.raises(ConfigError, match="beside a Qwen-Image"):
        tm.check_generators(beside_klein, pipes["klein"])


def test_qwen_image_21_and_edit_plus_flag_checks(pipes):
    """Qwen-Image 2.1 reads its own Qwen3-VL and refines with image CFG; Edit Plus refines beside Qwen-Image."""
    tm.check_generators(MixGRPOConfig(conditioning="generator"), pipes["qwenimage21"])
    with pytest.raises(ConfigError, match="reads its own text encoders.*--conditioning generator"):
        tm.check_generators(MixGRPOConfig(conditioning="base"), pipes["qwenimage21"])
    plus = dict(edit_generator_name_or_path=pipes["edit_plus"])
    tm.check_generators(MixGRPOConfig(conditioning="base", **plus), pipes["qwenimage"])
    with pytest.raises(ConfigError, match="beside a Qwen-Image"):
        tm.check_generators(MixGRPOConfig(conditioning="generator", **plus), pipes["qwenimage21"])


def test_klein_lora_wraps_both_block_kinds(pipes):
    """FLUX.2 Klein's `to_out` is a Linear in single-stream blocks and a ModuleList in double-stream ones."""
    from utils.t2i.adapters import Flux2KleinGenerator

    gen = Flux2KleinGenerator.from_pretrained(pipes["klein"], text_encoder_out_layers=(1,))
    assert gen.add_lora(2)
    wrapped = {n.split(".lora_A")[0] for n, _ in gen.transformer.named_parameters() if ".lora_A." in n}
    assert {"transformer_blocks.0.attn.to_out.0", "single_transformer_blocks.0.attn.to_out",
            "single_transformer_blocks.0.attn.to_qkv_mlp_proj", "transformer_blocks.0.attn.to_q"} <= wrapped


def launch(pipes, name, out, **overrides):
    _, refine, extra = ADAPTERS[name]
    if name == "edit_plus":  # the refine stage's own generator, beside the Qwen-Image it reads the text encoder of
        extra = dict(extra, edit_generator_name_or_path=pipes[name])
    flags = dict(model_name_or_path=os.path.join(pipes["qwenimage"], "_vlm"),
                 generator_name_or_path=pipes["qwenimage" if name == "edit_plus" else name],
                 conditioning="generator", group_size=2, policy_group_size=1, max_output_token_n_gen=4,
                 max_output_token_n_edit=4, image_size=32, num_timesteps_gen=3, num_timesteps_edit=3,
                 reward_fn="tests.mixgrpo_helpers:brightness", val_data_path="none", max_steps=2, save_steps=1,
                 report_to="none", output_dir=str(out), learning_rate=1e-3, warmup_steps=0, generator_lora_r=2,
                 reflect_refine=refine, cpu_threads=1, **extra)
    flags.update(overrides)
    # where the adapter refines, every reflection reads as an edit (tests/mixgrpo_scripted_edit.py), so the
    # reflect step trains the refine path: a random tiny VLM's reflections would all keep their image
    script = os.path.join("tests", "mixgrpo_scripted_edit.py") if refine else "train_mixgrpo.py"
    cmd = [ACCELERATE, "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", os.path.join(REPO, script),
           *[x for k, v in flags.items() for x in (f"--{k}", str(v))]]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return read_jsonl(os.path.join(out, "metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_two_steps_through_the_script_train_the_image_and_resume_exactly(pipes, tmp_path, name):
    metrics = launch(pipes, name, tmp_path / "run")
    stages = ["reason", "reflect" if ADAPTERS[name][1] else "reason"]
    assert [f"{s}/score" in m for s, m in zip(stages, metrics)] == [True, True]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    trained = [("checkpoint-1", "generator_lora")]  # the reason step trains the generator
    if name == "edit_plus":  # the reflect step trains the refine stage's own generator
        trained.append(("checkpoint-2", "edit_generator_lora"))
    for checkpoint, part in trained:
        lora = load_file(str(tmp_path / "run" / checkpoint / part / "pytorch_lora_weights.safetensors"))
        assert max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k) > 0  # the image part was trained
    assert os.path.isdir(tmp_path / "run" / "checkpoint-2")
    if ADAPTERS[name][1]:  # the reflect step refined every image and trained on the refine steps
        assert metrics[1]["reflect/no_edit"] == 0 and metrics[1]["reflect/image_advantage_abs"] > 0
        assert math.isfinite(metrics[1]["reflect/loss_image"])
        # the reflect step reflects on the buffer the checkpoint holds
        assert os.path.isfile(tmp_path / "run" / "checkpoint-1" / "reflect_buffer" / "images.pt")
    resumed = launch(pipes, name, tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    keys = [k for k in metrics[1] if k.split("/")[-1] in ("loss", "score", "text_reward", "image_reward", "format")]
    assert {k: resumed[-1][k] for k in keys} == pytest.approx({k: metrics[1][k] for k in keys}, rel=1e-5, abs=1e-7)


def test_reflect_buffer_keeps_an_images_alpha(tmp_path):
    """Qwen-Image 2.1 draws RGBA images and its refine's VAE reads the alpha: a resumed run's buffer keeps it."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (8, 8, 4), dtype=np.uint8))
    rgb = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    buffer = {pool: [] for pool in tm.BUFFER_POOLS}
    buffer[tm.BUFFER_POOLS[0]] = [dict(id=0, row={"prompt": "p"}, score=0.5, image=rgba),
                                  dict(id=1, row={"prompt": "q"}, score=0.2, image=rgb)]
    tm.save_buffer(buffer, str(tmp_path))
    back = tm.load_buffer(str(tmp_path))[tm.BUFFER_POOLS[0]]
    assert [e["image"].mode for e in back] == ["RGBA", "RGB"]
    assert all(a["image"].tobytes() == b.tobytes() for a, b in zip(back, (rgba, rgb)))
