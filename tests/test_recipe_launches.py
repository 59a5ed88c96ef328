"""Every paper recipe runs: each recipes/<paper>.yaml is launched with `accelerate launch` as its README command
says (DeepSpeed ZeRO-3 where it names accelerate_configs/zero3.yaml), its file unchanged. Only what a CPU test
must change is given on the command line over `--config`: the model (the tiny model of the same family), the data
(a few rows in the recipe's own schema, written here), sizes and step counts, and the servers (loopback). Each
recipe trains 2 steps with a checkpoint at each, then a second launch resumes from checkpoint-1 and must redo
step 2 exactly. Every key a recipe sets must be read by its script."""

import glob
import io
import json
import os
import pickle
import re

import numpy as np
import pytest
import yaml
from PIL import Image
from safetensors.torch import load_file

from tests.launch_helpers import REPO, cli, failing_fixture, finish, launch
from utils.core.config import ConfigError, parse_config
from utils.core.tracking import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.full]

ZERO3 = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed's CPU accelerator (gloo)
GRPO_RECIPES = ["crystal_answer_only", "crystal_cpr", "crystal_phase2", "crystal_spr", "crystal_cpr_internvl",
                "openvlthinker_grpo_medium", "openvlthinker_grpo_hard"]
R3_RECIPES = ["r3_geneval", "r3_geneval_plus", "r3_tiif"]
FLOW_RECIPES = ["flow_grpo_sd3_geneval", "flow_grpo_sd3_pickscore", "flow_grpo_sd3_ocr",
                "flow_grpo_qwenimage_pickscore"]
SCRIPTS = {**{name: "train_grpo.py" for name in GRPO_RECIPES}, "openvlthinker_sft": "train_sft.py",
           **{name: "train_mixgrpo.py" for name in R3_RECIPES + FLOW_RECIPES}}
# Each recipe's command (its header comment, the docs) runs it under accelerate_configs/zero3.yaml (R3's docs: at
# 7B + Qwen-Image); here on 1 process.


def recipe(name):
    return os.path.join(REPO, "recipes", f"{name}.yaml")


def recipe_keys(name):
    with open(recipe(name)) as f:
        return yaml.safe_load(f)


def config_class(name):
    import train_grpo
    import train_mixgrpo
    import train_sft

    return {"train_grpo.py": train_grpo.GRPOConfig, "train_sft.py": train_sft.SFTConfig,
            "train_mixgrpo.py": train_mixgrpo.MixGRPOConfig}[SCRIPTS[name]]


# ---- every key is a field of the script's config, and the code reads it ----

def _source_text():
    files = [p for p in glob.glob(os.path.join(REPO, "**", "*.py"), recursive=True)
             if f"{os.sep}tests{os.sep}" not in p and f"{os.sep}.venv{os.sep}" not in p]
    text = []
    for path in files:
        with open(path) as f:
            text.append(f.read())
    return "\n".join(text)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_recipe_key_is_a_flag_its_script_reads(name, tmp_path):
    import dataclasses

    Config = config_class(name)
    fields = {f.name for f in dataclasses.fields(Config)}
    keys = recipe_keys(name)
    assert set(keys) <= fields, (name, sorted(set(keys) - fields))
    # a flag the code never reads as `cfg.<key>` (or by its name) would be ignored
    source = _source_text()
    unread = [k for k in keys if not re.search(rf"\.{k}\b|[\"']{k}[\"']", source)]
    assert not unread, (name, unread)
    # and the parser refuses a key it does not know, naming the file and the key
    bad = tmp_path / f"{name}.yaml"
    bad.write_text(open(recipe(name)).read() + "\nnot_a_flag_of_the_script: 1\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(bad))}: unknown key 'not_a_flag_of_the_script'"):
        parse_config(Config, ["--config", str(bad)])


# ---- shared assets: the tiny models, the data in each recipe's schema, the servers ----

def _picture(i, size=56):
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import datasets

    from tiny.cache import tiny_vlm_path
    from tiny.models import make_tiny_vlm
    from tiny.pipelines import make_tiny_qwenimage
    from tiny.t2i import make_t2i_prompts, write_jsonl

    root = tmp_path_factory.mktemp("recipe-launches")
    with failing_fixture("tests/test_recipe_launches.py's assets (the tiny Qwen2.5-VL, a tiny Qwen-Image, data)"):
        paths = []
        for i in range(4):
            paths.append(str(root / f"image-{i}.png"))
            _picture(i).save(paths[-1])
        # CRYSTAL (waybarrios/CRYSTAL): a stored image, question, answer, reference_steps, choices and options
        crystal = datasets.Dataset.from_dict({
            "image": paths, "question": [f"How many shapes are there in picture {i}?" for i in range(4)],
            "answer": ["B", "2", "A", "4"],
            "reference_steps": [["Count the shapes.", f"There are {i + 1}."] for i in range(4)],
            "choices": [["1", "2"], None, [], None], "options": [None, None, ["3", "5"], None],
        }).cast_column("image", datasets.Image())
        crystal.to_parquet(str(root / "crystal.parquet"))
        # OpenVLThinker's RL rows: images (a list), problem, answer
        rl = [{"images": [p], "problem": f"<image>What is {i} + {i}?", "answer": str(2 * i), "difficulty": level}
              for i, (p, level) in enumerate(zip(paths, ["easy", "medium", "medium", "hard"]))]
        # OpenVLThinker's SFT rows (LLaMA-Factory sharegpt): messages with from/value, images
        sft = [{"messages": [{"role": "user", "content": f"<image>What is {i} + 1?"},
                             {"role": "assistant", "content": f"<think>{i} plus one.</think><answer>{i + 1}</answer>"}],
                "images": [p]} for i, p in enumerate(paths)]
        tiif = [{"type": "basic", "short_description": f"a red circle number {i}",
                 "yn_question_list": ["Is there a circle?", "Is it red?"], "yn_answer_list": ["yes", "yes"]}
                for i in range(4)]
        return dict(
            root=root, vlm=tiny_vlm_path(), generator=make_tiny_qwenimage(str(root / "qwenimage")),
            internvl=make_tiny_vlm(str(root / "internvl3_5"), family="internvl3_5"),
            crystal=str(root / "crystal.parquet"),
            rl=write_jsonl(rl, str(root / "openvlthinker_rl.jsonl")),
            sft=write_jsonl(sft, str(root / "openvlthinker_sft.jsonl")),
            geneval=write_jsonl(make_t2i_prompts(4, seed=0), str(root / "geneval.jsonl")),
            tiif=write_jsonl(tiif, str(root / "tiif.jsonl")))


def _geneval_reply(body):
    """A GenEval-protocol server's reply: the score is the image's mean brightness."""
    request = pickle.loads(body)
    scores = [float(np.asarray(Image.open(io.BytesIO(b)).convert("RGB"), dtype=np.float64).mean() / 255)
              for b in request["images"]]
    return 200, pickle.dumps({"scores": scores, "rewards": [float(s > 0.5) for s in scores],
                              "strict_rewards": [0.0] * len(scores), "group_rewards": {},
                              "group_strict_rewards": {}})


@pytest.fixture(scope="module")
def geneval_server():
    from tests.test_reward_servers import Loopback

    server = Loopback(lambda attempt, path, body: _geneval_reply(body))
    yield server
    server.close()


@pytest.fixture(scope="module")
def judge(assets):
    """`transformers serve` of the tiny Qwen2.5-VL: the GenEval++ and TIIF judge."""
    from utils.core.serving import LocalServer

    log = str(assets["root"] / "judge.log")
    with failing_fixture(f"`transformers serve` of the tiny judge (its log: {log})"):
        server = LocalServer(assets["vlm"], device="cpu", threads=1, log_path=log).start()
    yield server
    server.stop()


# ---- the launches ----

def _run(name, out, args):
    return finish(launch(SCRIPTS[name], ["--config", recipe(name), *cli(output_dir=str(out), **args)],
                         config="zero3", env=ZERO3), what=name)


# One recipe per script kind also resumes (the others only train): resume itself is the same code for every recipe of a
# script, and each resume is a second launch (about half of a recipe's test time).
RESUMED = {"crystal_cpr", "crystal_cpr_internvl", "openvlthinker_grpo_hard", "openvlthinker_sft", "r3_geneval",
           "flow_grpo_sd3_pickscore"}


def _two_steps_then_resume(name, tmp_path, args, keys):
    """2 steps with a checkpoint at each; then, for the RESUMED recipes, a launch from checkpoint-1 redoes step 2:
    same metrics, same weights (the checkpoint's weights, optimizer state, scheduler, data position and RNG were all
    used). Returns the first run's metric rows and the resumed run's (None when not resumed)."""
    _run(name, tmp_path / "run", dict(args, max_steps=2, save_steps=1))
    first = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in first] == [1, 2], first
    assert all(np.isfinite(first[1][key]) for key in keys), first[1]
    assert (tmp_path / "run" / "checkpoint-1").is_dir() and (tmp_path / "run" / "checkpoint-2").is_dir()
    if name not in RESUMED:
        return first, None
    checkpoint = str(tmp_path / "run" / "checkpoint-1")
    out = _run(name, tmp_path / "resumed", dict(args, max_steps=2, save_steps=1, resume_from_checkpoint=checkpoint))
    assert f"resumed from {checkpoint}" in out, out[-2000:]
    again = [m for m in read_jsonl(tmp_path / "resumed" / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in again] == [2], again
    for key in keys:
        assert again[0][key] == pytest.approx(first[1][key], rel=1e-5, abs=1e-6), key
    return first, again


def _max_diff(a, b, file):
    wa, wb = load_file(str(a / file)), load_file(str(b / file))
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def _same_weights(a, b, file="model.safetensors"):
    """The resumed run's step-2 weights are the first run's (exact on one CPU process; a step moves them by more
    than 1e-7 at these learning rates, so a resume without the optimizer state would show)."""
    diff = _max_diff(a, b, file)
    assert diff < 1e-9, diff


# Shrunk for the CPU (the recipe's other keys stay): the model, the data, a group of 2 with 2 completions per
# process, 8-token completions, 3136-pixel images (4 x 4 patches), 2 difficulty samples, 2 steps.
GRPO_SHRUNK = dict(num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                   max_completion_length=8, max_prompt_length=512, max_pixels=3136, report_to="none", logging_steps=1)


def _grpo_args(name, assets):
    args = dict(GRPO_SHRUNK, model_name_or_path=assets["vlm"])
    if name == "crystal_cpr_internvl":  # the tiny InternVL3.5: its tiles (2, not 12), no Qwen pixel budget
        args = dict({k: v for k, v in GRPO_SHRUNK.items() if k != "max_pixels"}, model_name_or_path=assets["internvl"],
                    max_anyres_num=2)
    if name.startswith("crystal"):
        args["dataset_name"] = assets["crystal"]
    elif name == "openvlthinker_grpo_medium":
        # difficulty_samples 8 -> 0 (the rows' `difficulty` labels): a random tiny model fails every question, so
        # the estimate puts all of them in `hard` and the medium stage would be empty (refused). The hard recipe
        # below runs the estimate itself (2 samples a question).
        args.update(dataset_name=assets["rl"], difficulty_samples=0)
    else:
        args.update(dataset_name=assets["rl"], difficulty_samples=2)
    return args


@pytest.mark.parametrize("name", GRPO_RECIPES)
def test_grpo_recipe_trains_and_checkpoints(name, assets, tmp_path):
    keys = ("reward", "loss", "completion_length", "entropy", "grad_norm", "learning_rate")
    first, again = _two_steps_then_resume(name, tmp_path, _grpo_args(name, assets), keys)
    for func in recipe_keys(name)["reward_funcs"]:
        assert f"rewards/{func}" in first[0], (func, sorted(first[0]))  # every reward of the recipe scored
    if again is not None:
        _same_weights(tmp_path / "run" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")


def test_openvlthinker_sft_recipe_trains_checkpoints_and_resumes(assets, tmp_path):
    args = dict(model_name_or_path=assets["vlm"], dataset_name=assets["sft"], per_device_train_batch_size=2,
                gradient_accumulation_steps=1, max_length=256, max_pixels=3136, report_to="none", logging_steps=1)
    _two_steps_then_resume("openvlthinker_sft", tmp_path, args, keys=("loss", "grad_norm"))
    run = tmp_path / "run"
    assert _max_diff(run / "checkpoint-1", run / "checkpoint-2", "model.safetensors") > 1e-7  # step 2 trained
    _same_weights(run / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")


# R3 on the CPU: one process (policy_group_size 1 instead of 4 GPUs), a group of 2, 32-pixel images, 3 sampling
# steps, 6-token texts, LoRA rank 4 and a 1-prompt held-out set at 2 steps; --use_peft true as the recipe has.
R3_SHRUNK = dict(group_size=2, policy_group_size=1, max_output_token_n_gen=6, max_output_token_n_edit=6,
                 image_size=32, num_timesteps_gen=3, num_timesteps_edit=3, lora_r=4, lora_alpha=8,
                 generator_lora_r=4, eval_samples=1, eval_num_timesteps=2, report_to="none", use_peft="true")


@pytest.mark.parametrize("name", R3_RECIPES)
def test_r3_recipe_trains_and_checkpoints_with_the_text_ratio_at_one(name, assets, geneval_server, request,
                                                                     tmp_path):
    data = assets["tiif"] if name == "r3_tiif" else assets["geneval"]
    args = dict(R3_SHRUNK, model_name_or_path=os.path.join(assets["generator"], "_vlm"),
                generator_name_or_path=assets["generator"], edit_generator_name_or_path=assets["generator"],
                train_data_path=data, val_data_path=data)
    if name == "r3_geneval":
        args["reward_server_port"] = geneval_server.port
        args["reward_kwargs"] = json.dumps({"max_retries": 1, "timeout": 60.0})
    else:
        judge = request.getfixturevalue("judge")
        args["reward_server_port"] = judge.port
        args["reward_kwargs"] = json.dumps({"model": judge.model_name, "max_tokens": 8, "max_retries": 1})
    first, again = _two_steps_then_resume(name, tmp_path, args, keys=("loss", "grad_norm"))
    # step 1 reasons, step 2 reflects on its buffer; each step is one pass over fresh rollouts, with LoRA on the VLM:
    # behaviour and training log-probs are the same, the text ratio 1
    assert [("reason/score" in m, "reflect/score" in m) for m in first] == [(True, False), (False, True)]
    assert first[0]["reason/ratio_max_dev_text"] < 1e-5, first[0]
    assert first[1]["reflect/ratio_max_dev_text"] < 1e-5, first[1]
    run, resumed = tmp_path / "run" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2"
    if name == "r3_geneval":  # the server's scores vary with every pixel: step 2 trained the generator's LoRA
        lora = "generator_lora/pytorch_lora_weights.safetensors"  # (a random judge's verdicts give no advantages)
        assert _max_diff(tmp_path / "run" / "checkpoint-1", run, lora) > 1e-8
    if again is None:
        return
    _same_weights(run, resumed, "adapter_model.safetensors")  # the VLM's LoRA
    for part in ("generator_lora", "edit_generator_lora"):  # the generators' LoRA (each written at every save)
        _same_weights(run / part, resumed / part, "pytorch_lora_weights.safetensors")


# Flow-GRPO (--text_free): the SD3.5 recipes on a tiny SD3 pipeline, the Qwen-Image one on the tiny Qwen-Image; their
# rewards: the GenEval loopback server, PickScore on a tiny CLIP folder, the OCR package's shipped models. The SDE
# window shrinks with the step count (2 of 3 steps; the Qwen-Image recipe's random window in [0, 2]).
FLOW_SHRUNK = dict(group_size=2, policy_group_size=1, prompts_per_policy_group=1, image_size=32, num_timesteps_gen=3,
                   sde_window_size=2, generator_lora_r=4, eval_samples=1, eval_num_timesteps=2, report_to="none")


@pytest.fixture(scope="module")
def flow_assets(assets):
    from tiny.pipelines import make_tiny_sd3
    from tiny.reward_models import make_tiny_clip

    root = assets["root"]
    with failing_fixture("tests/test_recipe_launches.py's Flow-GRPO assets (a tiny SD3, a tiny CLIP, prompt files)"):
        make_tiny_clip(str(root / "clip"))
        (root / "pickscore.txt").write_text("a photo of a cat\na red dog\n")
        (root / "ocr.txt").write_text('a sign that says "open"\na cake with "happy" written on it\n')
        return dict(sd3=make_tiny_sd3(str(root / "sd3")), clip=str(root / "clip"),
                    pickscore=str(root / "pickscore.txt"), ocr=str(root / "ocr.txt"))


@pytest.mark.parametrize("name", FLOW_RECIPES)
def test_flow_grpo_recipe_trains_and_checkpoints_the_generator_alone(name, assets, flow_assets, geneval_server,
                                                                    tmp_path):
    qwen = "qwenimage" in name
    args = dict(FLOW_SHRUNK, generator_name_or_path=assets["generator"] if qwen else flow_assets["sd3"])
    if qwen:
        args["sde_window_range"] = "0,2"
    if name.endswith("geneval"):
        args.update(train_data_path=assets["geneval"], val_data_path=assets["geneval"],
                    reward_server_port=geneval_server.port, reward_kwargs=json.dumps({"max_retries": 1}))
    elif name.endswith("pickscore"):
        args.update(train_data_path=flow_assets["pickscore"], val_data_path=flow_assets["pickscore"],
                    reward_kwargs=json.dumps({"model_name_or_path": flow_assets["clip"], "divisor": 26}))
    else:
        args.update(train_data_path=flow_assets["ocr"], val_data_path=flow_assets["ocr"])
    first, again = _two_steps_then_resume(name, tmp_path, args, keys=("loss",))
    assert all("image/score" in m for m in first)
    run = tmp_path / "run" / "checkpoint-2"
    assert not (run / "model.safetensors").exists()  # no VLM: the generator's LoRA is the checkpoint's model
    if again is not None:
        _same_weights(run / "generator_lora", tmp_path / "resumed" / "checkpoint-2" / "generator_lora",
                      "pytorch_lora_weights.safetensors")
