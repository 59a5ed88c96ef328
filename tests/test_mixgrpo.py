"""train_mixgrpo.py: the stage reward rules, advantages, flag checks, reward endpoints, and on tiny models the
loss at unchanged weights (ratio 1, KL 0, CFG on), tune_* gradients, 1 vs 2 processes, SIGKILL + exact resume."""

import json
import os
import re
from dataclasses import replace

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

import train_mixgrpo as tm
from kernels import group_advantages
from tests.launch_helpers import cli as flags
from tests.launch_helpers import failing_fixture, finish, launch, launch_fsdp2, sigkill_when
from tiny.cache import resolve_tiny_t2i
from train_mixgrpo import MixGRPOConfig
from utils.core.logprobs import hf_core
from utils.core.tracking import read_jsonl
from utils.t2i import mixgrpo_eval, mixgrpo_model, r3_format
from utils.t2i.generators import step_logprob
from utils.t2i.r3_format import REASON_PROMPT, user_message


@pytest.mark.parametrize("score, fmt, w, text, image", [
    (1.0, 1.0, 0.5, 1.5, 1.0),  # perfect image, well-formed reasoning
    (0.4, 1.0, 0.5, 0.9, 0.4),  # partial credit
    (1.0, 0.0, 0.5, 0.0, 1.0),  # malformed reasoning: no text reward, the image keeps its score
    (0.0, 1.0, 0.2, 0.2, 0.0),  # format only
    (0.0, 0.0, 0.5, 0.0, 0.0),
])
def test_reason_rewards(score, fmt, w, text, image):
    t, i = r3_format.reason_rewards([score], [fmt], w)
    assert t.item() == pytest.approx(text) and i.item() == pytest.approx(image)


@pytest.mark.parametrize("text, fmt, reasoning", [
    ("<think>two red circles on the left</think>", 1.0, "two red circles on the left"),
    ("  <think>\nplan\n</think> trailing", 0.0, "plan"),  # R3: nothing may follow the reasoning
    ("<think> </think>", 1.0, ""),  # R3's rule: an empty think block is well-formed
    ("no tags here", 0.0, "no tags here"),
    ("<think>unclosed", 0.0, "<think>unclosed"),
    ("text <think>late</think>", 0.0, "text <think>late</think>"),
])
def test_reasoning_format(text, fmt, reasoning):
    assert r3_format.reasoning_of(text) == (fmt, reasoning)


# score_new, score_prev, fmt, no_edit, w -> text reward, image reward
@pytest.mark.parametrize("new, prev, fmt, no_edit, w, text, image", [
    (0.8, 0.3, 1.0, False, 0.5, 0.5 + 0.5, 0.8),  # an edit that improves
    (0.2, 0.6, 1.0, False, 0.5, 0.5 - 0.4, 0.2),  # an edit that hurts
    (1.0, 1.0, 1.0, True, 0.5, 0.5 + 1.0, 1.0),  # perfect image, correctly left alone: improvement 1
    (0.4, 0.4, 1.0, True, 0.5, 0.5 + 0.0, 0.4),  # imperfect image left alone: no improvement
    (1.0, 1.0, 1.0, False, 0.5, 0.5 + 0.0, 1.0),  # perfect image edited and still perfect
    (0.9, 0.1, 0.0, False, 0.5, 0.0, 0.9),  # malformed reflection: no text reward
])
def test_reflect_rewards(new, prev, fmt, no_edit, w, text, image):
    t, i = r3_format.reflect_rewards([new], [prev], [fmt], [no_edit], w)
    assert t.item() == pytest.approx(text) and i.item() == pytest.approx(image)


@pytest.mark.parametrize("text, fmt, instruction, no_edit", [
    ("<think>the square is missing</think> add a red square on the left", 1.0,
     "add a red square on the left", False),
    ("<think>all there</think> No further edit needed.", 1.0, "No further edit needed.", True),
    ("<think>all there</think>   ", 0.0, r3_format.NO_EDIT, True),  # nothing after </think>: no edit
    ("no further edit needed", 0.0, r3_format.NO_EDIT, True),  # no reflection: no edit, the image is kept (R3)
])
def test_reflection_format(text, fmt, instruction, no_edit):
    assert r3_format.reflection_of(text) == (fmt, instruction, no_edit)


def test_buffer_draws_follow_perfect_buffer_prob_and_fall_back_when_a_pool_is_empty():
    buffer = dict(perfect=[dict(id=0, score=1.0)], imperfect=[dict(id=i, score=0.5) for i in range(1, 5)])
    cfg = MixGRPOConfig(perfect_buffer_prob=0.15, seed=3)
    draws = [tm.draw_entry(buffer, cfg, step, slot)["id"] for step in range(1, 400, 2) for slot in range(4)]
    share = sum(d == 0 for d in draws) / len(draws)
    assert 0.10 < share < 0.20  # 800 draws at p = 0.15
    assert set(draws) == {0, 1, 2, 3, 4}
    assert tm.draw_entry(buffer, cfg, 5, 2) == tm.draw_entry(buffer, cfg, 5, 2)  # seeded by (seed, step, slot)
    only_imperfect, only_perfect = dict(perfect=[], imperfect=[dict(id=7)]), dict(perfect=[dict(id=9)], imperfect=[])
    assert tm.draw_entry(only_imperfect, replace(cfg, perfect_buffer_prob=1.0), 1, 0)["id"] == 7
    assert tm.draw_entry(only_perfect, replace(cfg, perfect_buffer_prob=0.0), 1, 0)["id"] == 9


def test_group_advantages_subtract_the_group_mean_and_optionally_divide_by_std():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(r, 4, scale="none")
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 0, 0, 0, 0]))
    scaled = group_advantages(r, 4, scale="group")
    assert torch.allclose(scaled[:4], adv[:4] / (r[:4].std() + 1e-4)) and scaled[4:].abs().max() == 0


@pytest.mark.parametrize("overrides, world, message", [
    (dict(group_size=6, policy_group_size=4), 4, "not a multiple of --policy_group_size"),
    (dict(group_size=8, policy_group_size=4), 2, "do not split into policy groups"),
    (dict(tune_text_cot=False, tune_image_cot=False), 4, "nothing to train"),
    (dict(enable_sde_gen=False), 4, "needs --enable_sde_gen"),
    (dict(cfg_interval=[0.5, 0.4]), 4, "--cfg_interval"),
    (dict(reward_fn="nope"), 4, "--reward_fn 'nope'"),
    (dict(dataset_name="geneval", train_data_path="tiny"), 4, "--train_data_path tiny"),
    (dict(dataset_name="tiif", train_data_path="a", val_data_path=None, reward_fn="geneval"), 4, "judge_tiif"),
    (dict(generator_lora_r=-1), 4, "--generator_lora_r -1 must be >= 0"),
    (dict(edit_generator_name_or_path="edit", reflect_refine=False), 4, "--reflect_refine is off"),
    (dict(cfg_img_scale_edit=0.5), 4, "--cfg_img_scale_edit 0.5"),
    (dict(eval_batch_size=0), 4, "--eval_batch_size 0 must be >= 1"),
    (dict(sde_window_size=20), 4, "--sde_window_size 20 must lie in"),
    (dict(sde_window_size=4, sde_window_shift_interval=0), 4, "--sde_window_shift_interval"),
    (dict(cfg_renorm_type_gen="global", cfg_scale_gen=1.0), 4, "--cfg_renorm_type_gen global: --cfg_scale_gen 1.0"),
    (dict(cfg_renorm_type_edit="text_channel", reflect_refine=False), 4, "text_channel: --reflect_refine is off"),
    (dict(cfg_renorm_min=0.5), 4, "--cfg_renorm_min 0.5 clamps BAGEL's rescales"),
    (dict(cfg_renorm_type_gen="global", cfg_renorm_min=1.5), 4, r"--cfg_renorm_min 1.5 must lie in \[0, 1\]"),
    (dict(eval_temperature=-0.3), 4, "--eval_temperature -0.3 must be >= 0"),
])
def test_validate_refuses_bad_flags(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        tm.validate(MixGRPOConfig(**overrides), world)


@pytest.mark.parametrize("conditioning", ["base", "policy"])
def test_the_tiny_generator_refuses_to_read_the_policys_states(conditioning):
    # pre-trained on its own encoder's states, before anything is built or loaded
    with pytest.raises(ValueError, match=f"use --conditioning generator, not {conditioning}"):
        resolve_tiny_t2i(MixGRPOConfig(conditioning=conditioning), accelerator=None)


def test_the_tiny_edit_generator_edits_for_the_tiny_generator_only():
    with pytest.raises(ValueError, match="--edit_generator_name_or_path tiny edits for --generator_name_or_path tiny"):
        resolve_tiny_t2i(MixGRPOConfig(conditioning="generator", generator_name_or_path="some/folder",
                                       edit_generator_name_or_path="tiny"), accelerator=None)


@pytest.mark.parametrize("refine", [False, True])
def test_tiny_names_resolve_to_the_planner_or_the_reflector_and_the_edit_generator(refine, monkeypatch):
    import contextlib
    import types

    from tiny import cache

    one_process = types.SimpleNamespace(main_process_first=contextlib.nullcontext)  # no accelerate state left behind

    built = {"tiny-planner": "/p", "tiny-reflector": "/r"}
    monkeypatch.setattr(cache, "TINY_MODELS", {k: (lambda v=v: v) for k, v in built.items()})
    monkeypatch.setattr(cache, "tiny_generator_path", lambda: "/g")
    monkeypatch.setattr(cache, "tiny_edit_generator_path", lambda: "/e")
    monkeypatch.setattr(cache, "tiny_t2i_prompts", lambda n, seed: f"/prompts-{seed}")
    cfg = MixGRPOConfig(conditioning="generator", reflect_refine=refine,
                        edit_generator_name_or_path="tiny" if refine else None)
    assert resolve_tiny_t2i(cfg, one_process) == (
        "/r" if refine else "/p", "/g", "/e" if refine else None, "/prompts-0", "/prompts-1")


def test_reward_endpoints_rank_mod_n_and_the_geneval_server_is_not_sent_to_v1(monkeypatch):
    # R3 rewrote every reward URL to .../v1; the GenEval server serves "/", the OpenAI-compatible judge /v1.
    urls, ports = "http://127.0.0.1,http://127.0.0.2", "8000,8001"
    expected = ["http://127.0.0.1:8000/", "http://127.0.0.1:8001/", "http://127.0.0.2:8000/", "http://127.0.0.2:8001/"]
    for rank in range(6):
        monkeypatch.setenv("RANK", str(rank))
        geneval = tm.build_image_reward(MixGRPOConfig(reward_fn="geneval", reward_server_urls=urls,
                                                      reward_server_port=ports))
        assert geneval.options["client"].url == expected[rank % 4]
        judge = tm.build_image_reward(MixGRPOConfig(reward_fn="judge_geneval_plus", reward_server_urls=urls,
                                              reward_server_port=ports))
        assert judge.options["client"].url == expected[rank % 4] + "v1/chat/completions"
    judge = tm.build_image_reward(MixGRPOConfig(reward_fn="judge_tiif", dataset_name="tiif",
                                          reward_server_urls="http://127.0.0.1:9000/v1", reward_server_port=None))
    assert judge.options["client"].url == "http://127.0.0.1:9000/v1/chat/completions"


# ---- on tiny models, in this process ----

TINY_CFG = dict(group_size=4, policy_group_size=1, prompts_per_policy_group=2, max_output_token_n_gen=6,
                image_size=32, num_timesteps_gen=4, temperature=0.7, generator_lora_r=4, report_to="none",
                reward_fn="tests.mixgrpo_helpers:brightness", eval_samples=2, eval_num_timesteps=4, seed=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from accelerate import Accelerator

    from tiny.pipelines import make_tiny_qwenimage
    from tiny.t2i import make_t2i_prompts

    with failing_fixture("tests/test_mixgrpo.py's tiny Qwen-Image pipelines and policy"):
        gen_path = make_tiny_qwenimage(str(tmp_path_factory.mktemp("mixgrpo") / "qwenimage"))
        edit_path = make_tiny_qwenimage(str(tmp_path_factory.mktemp("mixgrpo-edit") / "qwenimage"), seed=1)
        cfg = MixGRPOConfig(**TINY_CFG)
        accelerator = Accelerator(cpu=True)
        model, processor, policy, gen, gen_params = tm.build_policy(cfg, os.path.join(gen_path, "_vlm"), gen_path,
                                                                    "cpu")
    stop = tm.stop_token_ids(model, processor.tokenizer)
    return dict(cfg=cfg, accelerator=accelerator, model=model, processor=processor, policy=policy, gen=gen,
                gen_params=gen_params, rows=make_t2i_prompts(2, seed=0), gen_path=gen_path, edit_path=edit_path,
                stop=stop, suppress=tm.special_token_ids_to_suppress(processor.tokenizer, stop))


def rollout(tiny, cfg=None):
    cfg = cfg or tiny["cfg"]
    return tm.reason_rollout(cfg, 0, [0, 1], tiny["rows"], rank_in_group=0, policy=tiny["policy"],
                             processor=tiny["processor"], gen=tiny["gen"], accelerator=tiny["accelerator"],
                             stop_ids=tiny["stop"], suppress_ids=tiny["suppress"],
                             reward_fn=tm.build_image_reward(cfg))


def test_rollout_shares_noise_and_sde_step_within_a_prompt_and_varies_the_rest(tiny):
    roll = rollout(tiny)
    steps = roll["steps"]
    assert roll["global_ids"] == list(range(8)) and len(roll["images"]) == 8
    # one SDE step index per prompt, among the first N - 1 steps
    assert steps.index.tolist()[:4] == [steps.index[0].item()] * 4 and 0 <= steps.index.max() < 3
    again = rollout(tiny)  # seeded by (seed, step, prompt / rollout): the same draw twice
    assert torch.equal(again["ids"], roll["ids"]) and torch.equal(again["steps"].next_latents, steps.next_latents)
    # different SDE noise per rollout: the group's images differ
    assert not torch.equal(steps.next_latents[0], steps.next_latents[1])


def pil_tensor(image):
    return torch.tensor(list(image.getdata()), dtype=torch.float32) / 255


def test_image_rollout_draws_all_prompts_in_one_batch_and_any_subset_as_the_whole(tiny, monkeypatch):
    cfg, gen = tiny["cfg"], tiny["gen"]
    roll = rollout(tiny)
    kw = dict(gen=gen, device="cpu", num_steps=cfg.num_timesteps_gen, sde_range=cfg.num_timesteps_gen - 1,
              enable_sde=True, noise_level=cfg.noise_level_gen, guidance=tm.Guidance(cfg.cfg_scale_gen))
    # a training step whose two prompts take different SDE steps (seeded, so the same one on every run)
    step = next(s for s in range(1, 20) if len(set(tm.image_rollout(
        cfg, s, [0, 1], None, roll["global_ids"], draw=[], **kw)[2].tolist())) == 2)
    real_velocity, velocity_calls = gen.velocity, []
    monkeypatch.setattr(gen, "velocity", lambda *a, **k: velocity_calls.append(1) or real_velocity(*a, **k))
    images, steps, sde_index, of = tm.image_rollout(cfg, step, [0, 1], roll["cond"], roll["global_ids"], **kw)
    assert len(velocity_calls) == cfg.num_timesteps_gen  # one batch: a velocity call per flow step, not per prompt
    assert steps.index.tolist() == sde_index.tolist() and of.tolist() == list(range(8))
    some, some_steps, some_index, some_of = tm.image_rollout(cfg, step, [0, 1], roll["cond"].select([6, 1]),
                                                             roll["global_ids"], draw=[6, 1], **kw)
    assert some_of.tolist() == [6, 1] and torch.equal(some_index, sde_index)
    for k, r in enumerate([6, 1]):
        assert torch.allclose(pil_tensor(some[k]), pil_tensor(images[r]), atol=1 / 255)
        assert torch.allclose(some_steps.next_latents[k], steps.next_latents[r], atol=1e-5)
        assert torch.allclose(some_steps.log_prob[k], steps.log_prob[r], atol=1e-5)


def test_ratio_one_and_kl_zero_at_unchanged_weights_with_cfg_on(tiny):
    cfg = tiny["cfg"]
    roll = rollout(tiny)
    gen, policy = tiny["gen"], tiny["policy"]
    assert roll["steps"].guidance.scale == 4.0 and roll["steps"].guidance.interval == (0.4, 1.0)
    with torch.no_grad():
        ref_mean = mixgrpo_model.image_logprobs(gen, roll["cond"], roll["steps"], reference=True)[1]
        ref_logps = policy(roll["batch"], roll["ids"], roll["mask"], cfg.temperature)
    adv = torch.linspace(-1, 1, 8)
    loss, stats = tm.mixgrpo_loss(cfg, tm.MixGRPOModel(policy, gen), roll, adv, adv, ref_logps=ref_logps,
                                  ref_mean=ref_mean, text_tokens=roll["mask"].sum().float(), n_images=8, world=1)
    assert stats["ratio_max_dev_text"] < 1e-5 and stats["ratio_max_dev_image"] < 1e-5
    assert stats["kl_text"].abs() < 1e-6 and stats["kl_image"].abs() < 1e-10
    assert stats["clip_ratio_text"] == 0 and stats["clip_ratio_image"] == 0
    # The defects these pin: a training velocity without the rollout's CFG, and behaviour log-probs from the
    # untempered softmax, would each move the ratio away from 1 here.
    # (The random tiny transformer's two CFG branches are close, hence the small but clear gap.)
    with torch.no_grad():
        kept = mixgrpo_model.image_logprobs(gen, roll["cond"], roll["steps"])[0]
        no_cfg = step_logprob(gen, roll["cond"], roll["steps"], guidance=tm.Guidance(scale=1.0))[0]
    assert (kept - roll["steps"].log_prob).abs().max() < 1e-6
    assert (no_cfg - roll["steps"].log_prob).abs().max() > 1e-5
    with torch.no_grad():
        untempered = policy(roll["batch"], roll["ids"], roll["mask"], 1.0)
    assert ((untempered - roll["old_logps"]) * roll["mask"]).abs().max() > 1e-3


def test_renorm_flags_reach_each_stages_guidance_and_keep_the_ratio_at_one(tiny):
    """--cfg_renorm_type_gen / _edit / --cfg_renorm_min (R3: global / text_channel / 0) become each stage's Guidance;
    the reason rollout draws other images with them, and its recomputed SDE log-prob keeps them (ratio 1)."""
    from utils.t2i.guidance import Guidance

    cfg = replace(tiny["cfg"], cfg_renorm_type_gen="global", cfg_renorm_type_edit="text_channel", cfg_renorm_min=0.1)
    assert mixgrpo_model.reason_guidance(cfg) == Guidance(4.0, interval=(0.4, 1.0), renorm="global", renorm_min=0.1)
    assert mixgrpo_model.edit_guidance(cfg) == Guidance(4.0, interval=(0.4, 1.0), renorm="text_channel",
                                                        renorm_min=0.1, image_scale=1.5)
    assert mixgrpo_model.reason_guidance(tiny["cfg"]).renorm is None  # pipeline: the pipeline's own choice
    assert mixgrpo_model.edit_guidance(replace(tiny["cfg"], cfg_renorm_type_edit="none")).renorm is False
    roll, plain = rollout(tiny, cfg), rollout(tiny)
    assert roll["steps"].guidance.renorm == "global"
    assert not torch.allclose(roll["steps"].next_latents, plain["steps"].next_latents)
    with torch.no_grad():
        recomputed = mixgrpo_model.image_logprobs(tiny["gen"], roll["cond"], roll["steps"])[0]
    assert (recomputed - roll["steps"].log_prob).abs().max() < 1e-6


@pytest.mark.parametrize("overrides, windows", [
    # 10 flow steps: SDE steps lie in [0, 9); MixGRPO's progressive window, moved every 2 reason steps
    (dict(sde_window_size=4), [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2 + [[5, 6, 7, 8]] * 4),
    (dict(sde_window_size=4, sde_window_roll_back=True), [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2 + [[0, 1, 2, 3]] * 2
     + [[4, 5, 6, 7]] * 2),
    (dict(sde_window_size=3, sde_window_stride=2), [[0, 1, 2]] * 2 + [[2, 3, 4]] * 2 + [[4, 5, 6]] * 2
     + [[6, 7, 8]] * 2),
    # with reflect + refine only the even (reason) steps count: the window moves every 4 training steps
    (dict(sde_window_size=2, reflect_refine=True), [[0, 1]] * 4 + [[2, 3]] * 4),
])
def test_sliding_window_moves_every_shift_interval_and_stops_or_rolls_back_at_the_end(overrides, windows):
    cfg = MixGRPOConfig(**{**dict(num_timesteps_gen=10, sde_window_shift_interval=2, reflect_refine=False),
                           **overrides})
    tm.validate(cfg, 4)
    assert [tm.sde_window(cfg, step) for step in range(len(windows))] == windows


def test_window_rollout_records_every_window_step_and_trains_them_at_ratio_one(tiny):
    cfg = MixGRPOConfig(**{**TINY_CFG, "sde_window_size": 2, "sde_window_shift_interval": 1, "reflect_refine": False})
    roll = tm.reason_rollout(cfg, 1, [0, 1], tiny["rows"], rank_in_group=0, policy=tiny["policy"],
                             processor=tiny["processor"], gen=tiny["gen"], accelerator=tiny["accelerator"],
                             stop_ids=tiny["stop"], suppress_ids=tiny["suppress"], reward_fn=tm.build_image_reward(cfg))
    steps, of = roll["steps"], roll["step_image"]
    # 8 images x a window of 2 (the second window, steps 1 and 2, at training step 1), position-major
    assert steps.index.tolist() == [1] * 8 + [2] * 8 and of.tolist() == list(range(8)) * 2
    # a step's latents continue from the previous step of the same image
    assert torch.equal(steps.latents[8:], steps.next_latents[:8])
    gen, policy = tiny["gen"], tiny["policy"]
    with torch.no_grad():
        ref_mean = mixgrpo_model.image_logprobs(gen, tm.step_condition(roll), steps, reference=True)[1]
        ref_logps = policy(roll["batch"], roll["ids"], roll["mask"], cfg.temperature)
    adv = torch.linspace(0.1, 1, 8)  # a non-zero mean, so that a wrong normaliser shows
    loss, stats = tm.mixgrpo_loss(cfg, tm.MixGRPOModel(policy, gen), roll, adv, adv, ref_logps=ref_logps,
                                  ref_mean=ref_mean, text_tokens=roll["mask"].sum().float(), n_images=8, world=1)
    assert stats["ratio_max_dev_image"] < 1e-5 and stats["kl_image"].abs() < 1e-10
    # at ratio 1 the image surrogate is -mean(advantage) over all 16 step terms: each step carries its image's
    image_part = (loss - stats["loss_text"] * cfg.ce_weight) / cfg.mse_weight
    assert torch.allclose(image_part, -adv[of].mean(), atol=1e-6)


def test_refine_rollout_keeps_the_input_image_without_an_edit_and_gives_it_no_image_advantage(tiny, monkeypatch):
    cfg = tiny["cfg"]
    reason = rollout(tiny)
    buffer = dict(perfect=[], imperfect=[dict(id=i, row=r, score=0.25 * (i % 4), image=im)
                                         for i, (r, im) in enumerate(zip(reason["rows"], reason["images"]))])
    texts = iter(["<think>fine</think> no further edit needed", "<think>x</think> add a circle"] * 8)
    real = tm.text_rollout

    def scripted(*args, **kw):  # the random tiny VLM never writes a reflection: script the decoded texts
        out = real(*args, **kw)
        return dict(out, texts=[next(texts) for _ in out["texts"]])

    monkeypatch.setattr(tm, "text_rollout", scripted)
    roll = tm.reflect_rollout(cfg, 1, [0, 1], buffer, rank_in_group=0, policy=tiny["policy"],
                              processor=tiny["processor"], gen=tiny["gen"], accelerator=tiny["accelerator"],
                              stop_ids=tiny["stop"], suppress_ids=tiny["suppress"],
                              reward_fn=tm.build_image_reward(cfg))
    keep = roll["no_edit"].bool()
    assert keep.tolist() == [True, False] * 4 and roll["image_mask"].tolist() == [0.0, 1.0] * 4
    inputs = {id(e["image"]): e for e in buffer["imperfect"]}
    for i, im in enumerate(roll["images"]):
        assert (id(im) in inputs) == bool(keep[i])  # kept: the very input image; edited: a new one
    assert torch.equal(roll["scores"][keep], roll["score_prev"][keep])
    # only the edited rollouts are drawn and trained; the refine SDE step is one of the first
    # max_sde_timestep_idx_for_edit steps, shared by the prompt's group
    assert roll["step_image"].tolist() == [1, 3, 5, 7]
    assert roll["steps"].index.max() < cfg.max_sde_timestep_idx_for_edit
    assert roll["steps"].index[:2].unique().numel() == 1 and roll["steps"].index[2:].unique().numel() == 1
    # the edit went through the image-conditioned path: the input image's latents join the sequence
    assert roll["cond"].image_latents is not None and roll["cond"].batch_size == 4  # the edited rollouts' only
    # ratio 1 at unchanged weights on the refine step too, and no image loss for the kept samples
    adv = torch.linspace(-1, 1, 8)
    _, stats = tm.mixgrpo_loss(replace(cfg, kl_weight_text=0.0), tm.MixGRPOModel(tiny["policy"], tiny["gen"]), roll,
                               adv, adv * roll["image_mask"],
                               ref_logps=None, ref_mean=None, text_tokens=roll["mask"].sum().float(), n_images=8,
                               world=1)
    assert stats["ratio_max_dev_image"] < 1e-5 and stats["ratio_max_dev_text"] < 1e-5


@pytest.mark.slow
@pytest.mark.full
def test_refine_rollout_without_any_edit_still_runs_the_generator_on_one_image_and_trains_nothing(tiny, monkeypatch):
    cfg, gen = tiny["cfg"], tiny["gen"]
    reason = rollout(tiny)
    buffer = dict(perfect=[], imperfect=[dict(id=i, row=r, score=0.5, image=im)
                                         for i, (r, im) in enumerate(zip(reason["rows"], reason["images"]))])
    real = tm.text_rollout

    def keeps(*args, **kw):  # the random tiny VLM never writes a reflection: every rollout keeps its image
        out = real(*args, **kw)
        return dict(out, texts=["<think>fine</think> no further edit needed"] * len(out["texts"]))

    monkeypatch.setattr(tm, "text_rollout", keeps)
    roll = tm.reflect_rollout(cfg, 1, [0, 1], buffer, rank_in_group=0, policy=tiny["policy"],
                              processor=tiny["processor"], gen=gen, accelerator=tiny["accelerator"],
                              stop_ids=tiny["stop"], suppress_ids=tiny["suppress"],
                              reward_fn=tm.build_image_reward(cfg))
    # one image is drawn (every process calls the generator: ZeRO-3's gathers are collective) and thrown away
    assert roll["step_image"].tolist() == [0] and roll["image_mask"].tolist() == [0.0] * 8
    inputs = {id(e["image"]) for e in buffer["imperfect"]}
    assert all(id(im) in inputs for im in roll["images"])
    adv = torch.linspace(-1, 1, 8)
    loss, stats = tm.mixgrpo_loss(replace(cfg, tune_text_cot=False), tm.MixGRPOModel(tiny["policy"], gen), roll,
                                  adv, adv * roll["image_mask"], ref_logps=None, ref_mean=None,
                                  text_tokens=roll["mask"].sum().float(), n_images=8, world=1)
    lora = [p for p in gen.transformer.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, lora, allow_unused=True)
    assert loss.item() == 0 and all(g is None or not g.any() for g in grads)


def test_refine_with_its_own_edit_generator_trains_that_generator_with_image_cfg(tiny, monkeypatch):
    cfg = tiny["cfg"]
    edit, edit_params = tm.build_edit_generator(cfg, tiny["edit_path"], tiny["gen"], "cpu")
    assert edit.text_encoder is tiny["gen"].text_encoder  # one conditioning for both generators, no second copy
    reason = rollout(tiny)
    buffer = dict(perfect=[], imperfect=[dict(id=i, row=r, score=0.5, image=im)
                                         for i, (r, im) in enumerate(zip(reason["rows"], reason["images"]))])
    real = tm.text_rollout

    def edits(*args, **kw):  # the random tiny VLM never writes a reflection: every rollout edits
        out = real(*args, **kw)
        return dict(out, texts=["<think>x</think> add a circle"] * len(out["texts"]))

    monkeypatch.setattr(tm, "text_rollout", edits)
    common = dict(rank_in_group=0, policy=tiny["policy"], processor=tiny["processor"], accelerator=tiny["accelerator"],
                  stop_ids=tiny["stop"], suppress_ids=tiny["suppress"], reward_fn=tm.build_image_reward(cfg))
    by_gen = tm.reflect_rollout(cfg, 1, [0, 1], buffer, gen=tiny["gen"], **common)
    by_edit = tm.reflect_rollout(cfg, 1, [0, 1], buffer, gen=edit, **common)
    # the same noise and text, another transformer: other images; image CFG on (the edit without its image)
    assert not torch.equal(by_gen["steps"].next_latents, by_edit["steps"].next_latents)
    assert by_edit["cond"].no_image is not None and by_edit["steps"].guidance.image_scale == cfg.cfg_img_scale_edit
    model = tm.MixGRPOModel(tiny["policy"], tiny["gen"], edit)
    assert {n.split(".")[0] for n, _ in model.named_children()} == {"text", "image", "edit_image"}
    adv = torch.linspace(-1, 1, 8)
    for p in tiny["gen_params"] + edit_params:
        p.grad = None
    loss, stats = tm.mixgrpo_loss(replace(cfg, kl_weight_text=0.0, tune_text_cot=False), model, by_edit, adv, adv,
                                  ref_logps=None, ref_mean=None, text_tokens=by_edit["mask"].sum().float(),
                                  n_images=8, world=1)
    assert stats["ratio_max_dev_image"] < 1e-5  # recomputed by the edit generator, its image CFG included
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in edit_params)
    assert all(p.grad is None for p in tiny["gen_params"])  # the reason stage's generator is not the one refining
    for p in edit_params:
        p.grad = None


def test_full_finetuning_trains_every_generator_weight_against_a_frozen_copy(tiny, tmp_path):
    cfg = replace(tiny["cfg"], generator_lora_r=0, reflect_refine=False)
    _, processor, policy, gen, params = tm.build_policy(cfg, os.path.join(tiny["gen_path"], "_vlm"), tiny["gen_path"],
                                                        "cpu")
    assert len(params) == len(list(gen.transformer.parameters())) and all(p.requires_grad for p in params)
    assert not tm.has_adapters(gen.transformer)
    common = dict(rank_in_group=0, policy=policy, processor=processor, gen=gen, accelerator=tiny["accelerator"],
                  stop_ids=tiny["stop"], suppress_ids=tiny["suppress"], reward_fn=tm.build_image_reward(cfg))
    roll = tm.reason_rollout(cfg, 0, [0, 1], tiny["rows"], **common)
    model = tm.MixGRPOModel(policy, gen)
    with torch.no_grad():
        ref_mean = model(image=(tm.step_condition(roll), roll["steps"]), reference=True)["image"][1]
    adv = torch.linspace(-1, 1, 8)
    loss, stats = tm.mixgrpo_loss(replace(cfg, tune_text_cot=False), model, roll, adv, adv, ref_logps=None,
                                  ref_mean=ref_mean, text_tokens=roll["mask"].sum().float(), n_images=8, world=1)
    assert stats["ratio_max_dev_image"] < 1e-5 and stats["kl_image"].abs() < 1e-10
    loss.backward()
    assert sum(p.grad is not None and p.grad.abs().sum() > 0 for p in params) > len(params) // 2  # not LoRA only
    torch.optim.SGD(params, lr=1e-1).step()
    with torch.no_grad():
        moved = model(image=(tm.step_condition(roll), roll["steps"]))["image"][1]
        ref_again = model(image=(tm.step_condition(roll), roll["steps"]), reference=True)["image"][1]
    assert (moved - ref_mean).abs().max() > 1e-4 and torch.equal(ref_again, ref_mean)  # the copy stayed put
    # the checkpoint holds the whole trained transformer as a diffusers model folder
    from diffusers import QwenImageTransformer2DModel

    folder = tm.save_generator(tiny["accelerator"], gen, params, str(tmp_path), "generator_transformer")
    saved = QwenImageTransformer2DModel.from_pretrained(folder).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in gen.transformer.state_dict().items())


def test_the_hub_card_loads_each_generator_part_from_its_subfolder(tiny, tmp_path):
    from utils.core.hub import stage_for_hub

    cfg = replace(tiny["cfg"], edit_generator_name_or_path=tiny["edit_path"])
    model, _, _, gen, params = tm.build_policy(cfg, os.path.join(tiny["gen_path"], "_vlm"), tiny["gen_path"], "cpu")
    edit, edit_params = tm.build_edit_generator(cfg, tiny["edit_path"], gen, "cpu")
    with torch.no_grad():
        for p in params + edit_params:
            p.normal_()  # trained LoRA weights (B is no longer 0)
    ckpt = tmp_path / "checkpoint-1"
    model.save_pretrained(ckpt)
    for name, g, ps in (("generator_lora", gen, params), ("edit_generator_lora", edit, edit_params)):
        os.replace(tm.save_generator(tiny["accelerator"], g, ps, str(tmp_path), name), ckpt / name)
    staged = tmp_path / "staged"  # what the hub repository would hold
    cfg.hub_model_id = str(staged)
    stage_for_hub(ckpt, staged, base_model=[tiny["gen_path"] + "/_vlm", tiny["gen_path"], tiny["edit_path"]],
                  parts=["generator_lora", "edit_generator_lora"],
                  notes=tm.generator_card(cfg, tiny["gen_path"], ["generator_lora", "edit_generator_lora"]))
    assert (staged / "generator_lora" / "pytorch_lora_weights.safetensors").is_file()
    card = (staged / "README.md").read_text()
    code = card.split("## The image generators", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope = {}
    exec(code, scope)  # the card's own loading code
    def lora_weights(transformer):  # keyed without the adapter's name (loaded: default_0)
        return {re.sub(r"\.(lora_[AB])\.[^.]+\.", r".\1.", k): v for k, v in transformer.state_dict().items()
                if ".lora_" in k}

    for loaded, trained in ((scope["pipe"], gen), (scope["edit"], edit)):
        want, got = lora_weights(trained.transformer), lora_weights(loaded.transformer)
        assert want and set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("text, image", [(True, False), (False, True), (True, True)])
def test_tune_flags_put_gradients_on_exactly_their_parameters(tiny, text, image):
    cfg = replace(tiny["cfg"], tune_text_cot=text, tune_image_cot=image, kl_weight_text=0.0, kl_weight_image=0.0)
    roll = rollout(tiny, cfg)
    policy, gen = tiny["policy"], tiny["gen"]
    text_params = [p for p in policy.parameters() if p.requires_grad]
    for p in text_params + tiny["gen_params"]:
        p.grad = None
    adv = torch.linspace(-1, 1, 8)
    loss, _ = tm.mixgrpo_loss(cfg, tm.MixGRPOModel(policy, gen), roll, adv, adv, ref_logps=None, ref_mean=None,
                              text_tokens=roll["mask"].sum().float(), n_images=8, world=1)
    loss.backward()
    text_grads = [p.grad for p in text_params if p.grad is not None and p.grad.abs().sum() > 0]
    image_grads = [p.grad for p in tiny["gen_params"] if p.grad is not None and p.grad.abs().sum() > 0]
    assert bool(text_grads) == text and bool(image_grads) == image
    # conditioning="base": nothing of the generator's text encoder (a frozen copy of the VLM) gets a gradient
    assert all(p.grad is None for p in gen.text_encoder.parameters())
    # the only generator parameters that train are its LoRA weights
    assert all("lora" in n for n, p in gen.transformer.named_parameters() if p.grad is not None)
    for p in text_params + tiny["gen_params"]:
        p.grad = None


def test_generator_conditioning_reads_the_pipelines_own_frozen_text_encoder(tiny, tmp_path):
    """--conditioning generator: a policy VLM other than the generator's text encoder (here 48-dim, against the
    generator's 32-dim encoder: refused under --conditioning base) writes the text; the pipeline's own frozen text
    encoder reads it, so the image is conditioned exactly as the plain pipeline conditions it, and RL on the text
    does not move it."""
    from tiny.models import make_tiny_vlm
    from utils.core.errors import InputError
    from utils.t2i.adapters import QwenImageGenerator

    vlm = make_tiny_vlm(str(tmp_path / "vlm48"), hidden_size=48, num_attention_heads=2, vision_hidden_size=32, seed=3)
    with pytest.raises(InputError, match="reads 32-dim text states but the VLM's hidden size is 48"):
        tm.build_policy(tiny["cfg"], vlm, tiny["gen_path"], "cpu")
    cfg = replace(tiny["cfg"], conditioning="generator")
    model, processor, policy, gen, gen_params = tm.build_policy(cfg, vlm, tiny["gen_path"], "cpu")
    assert gen.text_encoder is not hf_core(model) and gen.edit is not None  # the folder's own processor: refine
    assert not any(p.requires_grad for p in gen.text_encoder.parameters())
    plain = QwenImageGenerator.from_pretrained(tiny["gen_path"])
    texts = ["a photo of a red circle\nred circle top left", "a photo of two squares"]
    got, want = (g.encode_condition(texts, height=32, width=32) for g in (gen, plain))
    assert torch.equal(got.pos["embeds"], want.pos["embeds"]) and torch.equal(got.neg["embeds"], want.neg["embeds"])
    # one text step on the policy leaves the conditioning as it was
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    assert torch.equal(gen.encode_condition(texts, height=32, width=32).pos["embeds"], want.pos["embeds"])


# ---- end to end: accelerate launch ----


def mixgrpo(args, num_processes=1, config=None):
    """train_mixgrpo.py launched on CPU processes (with `config`: accelerate_configs/<config>.yaml, DeepSpeed's on
    its CPU accelerator; fsdp2 through tests/fsdp_worker.py)."""
    if config == "fsdp2":
        return launch_fsdp2("train_mixgrpo.py", args, num_processes)
    env = {"DS_ACCELERATOR": "cpu"} if config else None
    return launch("train_mixgrpo.py", args, num_processes, config=config, env=env)


def cli(tiny, out, **overrides):
    cfg = {**TINY_CFG, "model_name_or_path": os.path.join(tiny["gen_path"], "_vlm"),
           "generator_name_or_path": tiny["gen_path"], "output_dir": str(out), "max_steps": 3,
           "learning_rate": 1e-3, "warmup_steps": 0, "val_data_path": "none", "save_steps": 100, "cpu_threads": 1}
    cfg.update(overrides)
    return flags(**cfg)


LOSS_KEYS = ("loss", "image_reward", "loss_image", "loss_text", "image_advantage_abs", "text_reward", "score")


def values(m):
    stage = "reflect" if "reflect/score" in m else "reason"
    return {k: m[k if k == "loss" else f"{stage}/{k}"] for k in LOSS_KEYS}


def assert_same_metrics(a, b, rel=1e-4):
    """Two runs that differ only in how float sums are ordered (processes, DeepSpeed): every metric within `rel`,
    but an advantage, a difference of rewards of about 0.5, carries the rewards' float noise at their scale, not its
    own: it is compared within rel x its reward (a 0.004 advantage moves by 5e-4 of itself when its rewards move by
    5e-5 of theirs)."""
    va, vb = values(a), values(b)
    for key, value in va.items():
        scale = va[key.replace("advantage_abs", "reward")] if "advantage" in key else 0.0
        tolerance = dict(rel=rel, abs=max(1e-6, rel * scale))
        assert value == pytest.approx(vb[key], **tolerance), (a["step"], key, value, vb)


def reward_noise_gain(m):
    """How much a step's gradient, proportional to its advantages, magnifies its rewards' relative float noise:
    reward / largest mean |advantage| of the step (text or image), at least 1."""
    stage = "reflect" if "reflect/score" in m else "reason"
    advantage = max(m[f"{stage}/image_advantage_abs"], m[f"{stage}/text_advantage_abs"])
    return max(1.0, m[f"{stage}/image_reward"] / max(advantage, 1e-12))


def ds_args(tiny):
    """2 processes as one policy group, refine by its own generator."""
    return dict(policy_group_size=2, edit_generator_name_or_path=tiny["edit_path"])


@pytest.fixture(scope="module")
def ddp_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixgrpo-ddp")
    finish(mixgrpo(cli(tiny, out, **ds_args(tiny)), 2), what="tests/test_mixgrpo.py's 2-process DDP run")
    return train_rows(out)


def train_rows(run_dir):
    return [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]  # not the held-out rows


@pytest.mark.slow
@pytest.mark.parametrize("conditioning", ["base", pytest.param("policy", marks=pytest.mark.full)])
def test_two_processes_as_one_policy_group_match_one_process(tiny, ddp_run, tmp_path, conditioning):
    # The same 2 prompts x 4 rollouts: one process, or two processes making 2 rollouts of each prompt (the DDP run
    # the DeepSpeed test also compares with). conditioning="policy": the generator reads the VLM as it trains.
    args = dict(ds_args(tiny), conditioning=conditioning)
    finish(mixgrpo(cli(tiny, tmp_path / "one", **dict(args, policy_group_size=1))))
    m1 = train_rows(tmp_path / "one")
    if conditioning == "base":
        m2 = ddp_run
    else:
        finish(mixgrpo(cli(tiny, tmp_path / "two", **args), 2))
        m2 = train_rows(tmp_path / "two")
    assert len(m1) == len(m2) == 3
    assert "reflect/score" in m1[1] and "reason/score" in m1[2]  # the stages alternate
    assert m1[2]["reason/loss_image"] != m1[0]["reason/loss_image"]  # the runs really train
    for a, b in zip(m1, m2):
        assert_same_metrics(a, b)


@pytest.mark.slow
@pytest.mark.full
def test_sigkill_then_resume_matches_uninterrupted_run(tiny, tmp_path):
    # checkpoint-3 comes after a reason step: the resumed run's first step reflects on the checkpointed buffer
    # (tests/test_inprocess_resume.py checks the same resume in one process, bit for bit)
    args = dict(max_steps=5, save_steps=3, log_completions=8)
    finish(mixgrpo(cli(tiny, tmp_path / "full", **args)))
    victim = mixgrpo(cli(tiny, tmp_path / "killed", **args))
    sigkill_when(victim, tmp_path / "killed" / "checkpoint-3" / "trainer_state.json")
    assert not (tmp_path / "killed" / "checkpoint-5").exists()
    assert (tmp_path / "killed" / "checkpoint-3" / "reflect_buffer" / "images.pt").exists()
    finish(mixgrpo(cli(tiny, tmp_path / "killed", resume_from_checkpoint="latest", **args)))
    full = {m["step"]: m for m in read_jsonl(tmp_path / "full" / "metrics.jsonl")}
    resumed = {m["step"]: m for m in read_jsonl(tmp_path / "killed" / "metrics.jsonl")}
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    for step in (4, 5):
        for key, value in values(resumed[step]).items():
            assert value == pytest.approx(values(full[step])[key], rel=1e-5, abs=1e-7), (step, key)

    def drawn(run_dir):
        return [(r["step"], r["id"], r["prompt"], r["completion"], r["score"])
                for r in read_jsonl(run_dir / "completions.jsonl") if r["step"] >= 4]

    assert drawn(tmp_path / "killed") == drawn(tmp_path / "full") and len(drawn(tmp_path / "full")) == 16
    # both parts are in the checkpoint: the VLM as an HF folder, the generator's LoRA as a diffusers adapter
    ckpt = tmp_path / "full" / "checkpoint-5"
    assert (ckpt / "model.safetensors").exists()
    assert (ckpt / "generator_lora" / "pytorch_lora_weights.safetensors").exists()


def test_heldout_evaluation_reports_the_shapes_scorers_view(tiny, tmp_path):
    """On shapes_t2i the held-out result carries strict and detected / requested objects beside the reward (a gain
    bought with extra objects shows), averaged over the rows; the grid PNG is written."""
    cfg = replace(tiny["cfg"], dataset_name="shapes_t2i", reward_fn="shapes_t2i", reflect_refine=False,
                  reward_kwargs={"key": "score", "behaviour": "tiny"})
    rows = tiny["rows"]
    grid = str(tmp_path / "grid.png")
    result = evaluate(tiny, cfg, grid)
    assert os.path.isfile(grid) and result["samples"] == len(rows)
    assert {k for k in result if not k.startswith("tag_")} == {"reward", "format", "samples", "unscored", "strict",
                                                               "detected", "requested"}
    assert result["requested"] == sum(sum(int(i["count"]) for i in r["include"]) for r in rows) / len(rows)
    assert 0.0 <= result["strict"] <= result["reward"] + 1e-9 <= 1.0 + 1e-9


def test_heldout_images_per_prompt_each_draw_new_noise(tiny, tmp_path):
    """--eval_images_per_prompt N: row i's image j comes from seed + i + j x rows, so N images per row average
    exactly the N one-image evaluations at seed, seed + rows, seed + 2 rows, and draws their images."""
    cfg = replace(tiny["cfg"], dataset_name="shapes_t2i", reward_fn="shapes_t2i", reflect_refine=False,
                  reward_kwargs={"key": "score", "behaviour": "tiny"})
    n = len(tiny["rows"])
    singles = [evaluate(tiny, replace(cfg, seed=cfg.seed + j * n), str(tmp_path / f"one{j}.png")) for j in range(3)]
    three = evaluate(tiny, replace(cfg, eval_images_per_prompt=3), str(tmp_path / "three.png"))
    # the same images whether a batch holds one row's images or every row's (--eval_batch_size)
    assert n <= 16 // 3  # the default batch holds every row's images; this one a row's
    assert evaluate(tiny, replace(cfg, eval_images_per_prompt=3, eval_batch_size=3),
                    str(tmp_path / "batched.png")) == three
    assert (tmp_path / "batched.png").read_bytes() == (tmp_path / "three.png").read_bytes()
    assert three["samples"] == 3 * n and all(r["samples"] == n for r in singles)
    for key in ("reward", "strict", "detected", "requested"):
        assert three[key] == pytest.approx(sum(r[key] for r in singles) / 3, abs=1e-9), key
    grids = [Image.open(tmp_path / f"one{j}.png") for j in range(3)]
    w, h = grids[0].size
    with Image.open(tmp_path / "three.png") as b:  # 3 x n images, rows first: the three one-image grids side by side
        assert b.size == (3 * w, h)
        for j, single in enumerate(grids):
            assert b.crop((j * w, 0, (j + 1) * w, h)).tobytes() == single.tobytes(), j
    assert grids[0].tobytes() != grids[1].tobytes()  # each image from new noise


def evaluate(tiny, cfg, grid):
    return tm.evaluate_reason(cfg, tiny["rows"], policy=tiny["policy"], processor=tiny["processor"], gen=tiny["gen"],
                              accelerator=tiny["accelerator"], stop_ids=tiny["stop"], suppress_ids=tiny["suppress"],
                              reward_fn=tm.build_image_reward(cfg), grid_path=grid)


def test_heldout_text_is_greedy_or_sampled_at_eval_temperature(tiny):
    """--eval_temperature 0 is greedy; R3's 0.3 samples the held-out reasoning and reflections from seeded noise: the
    same texts on every call, others with another --seed, the reflections from noise of their own."""
    kw = dict(policy=tiny["policy"], processor=tiny["processor"], accelerator=tiny["accelerator"],
              stop_ids=tiny["stop"], suppress_ids=tiny["suppress"])
    messages = [user_message(REASON_PROMPT.format(prompt=r["prompt"])) for r in tiny["rows"] * 4]
    images, idx = [[] for _ in messages], list(range(len(messages)))

    def texts(**flags):
        return mixgrpo_eval.greedy_texts(replace(tiny["cfg"], **flags), messages, images, idx, 8, **kw)

    greedy, sampled = texts(eval_temperature=0.0), texts(eval_temperature=0.3)
    assert greedy[:2] * 4 == greedy  # greedy: a row's text does not depend on its seed
    assert sampled != greedy and texts(eval_temperature=0.3) == sampled
    assert texts(eval_temperature=0.3, seed=1) != sampled
    reflect = mixgrpo_eval.greedy_texts(replace(tiny["cfg"], eval_temperature=0.3), messages, images, idx, 8,
                                        seed_ids=idx, seed_round=mixgrpo_eval.HELDOUT_REFLECT_ROUND, **kw)
    assert reflect != sampled


@pytest.mark.slow
@pytest.mark.full
def test_heldout_refine_keeps_images_without_an_edit_and_rescores_edited_ones(tiny, tmp_path, monkeypatch):
    cfg = replace(tiny["cfg"], dataset_name="shapes_t2i", reward_fn="shapes_t2i", reflect_refine=True,
                  reward_kwargs={"key": "score", "behaviour": "tiny"})
    real = mixgrpo_eval.greedy_texts

    def scripted(reflection):  # the random tiny VLM never writes a reflection: script the refine stage's texts
        def texts(cfg, messages, images, *a, **kw):
            out = real(cfg, messages, images, *a, **kw)
            return [reflection] * len(out) if any(images) else out
        return texts

    monkeypatch.setattr(mixgrpo_eval, "greedy_texts", scripted("<think>fine</think> no further edit needed"))
    kept = evaluate(tiny, cfg, str(tmp_path / "kept.png"))
    assert kept["refine_no_edit"] == 1.0 and kept["refine_reward"] == kept["reward"]
    assert kept["refine_strict"] == kept["strict"] and os.path.isfile(tmp_path / "kept_refine.png")
    monkeypatch.setattr(mixgrpo_eval, "greedy_texts", scripted("<think>x</think> add a red circle"))
    edited = evaluate(tiny, cfg, str(tmp_path / "edited.png"))
    assert edited["refine_no_edit"] == 0.0 and edited["reward"] == kept["reward"]  # the reason images are the same
    with Image.open(tmp_path / "kept_refine.png") as a, Image.open(tmp_path / "edited_refine.png") as b:
        assert a.size == b.size and a.tobytes() != b.tobytes()  # refined: new images


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_deepspeed_on_two_cpu_processes_matches_ddp_and_resumes(tiny, ddp_run, tmp_path, zero):
    # One engine holds both parts (MixGRPOModel); ZeRO-3 shards the VLM and the generator, and the rollouts and the
    # held-out evaluation run on gathered shards. Steps 1 and 3 reason, step 2 reflects on step 1's buffer.
    args = dict(ds_args(tiny), save_steps=1)
    # ZeRO-3 also evaluates 33 held-out rows, split 17 / 16: two generation batches on one process, one on the
    # other, so its generation must not wait on the other process (transformers' synced_gpus)
    evaluation = dict(val_data_path="tiny", eval_samples=33) if zero == "zero3" else {}
    finish(mixgrpo(cli(tiny, tmp_path / "ds", **args, **evaluation), 2, config=zero))
    shards = os.listdir(tmp_path / "ds" / "checkpoint-3" / "training_state" / "pytorch_model")
    assert sorted(s for s in shards if "optim_states" in s) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], shards  # DeepSpeed ran on 2 ranks
    ds = train_rows(tmp_path / "ds")
    assert [m["step"] for m in ds] == [m["step"] for m in ddp_run] == [1, 2, 3]
    for a, b in zip(ddp_run, ds):
        assert_same_metrics(a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4 * reward_noise_gain(a)), a["step"]
    if evaluation:
        summary = json.loads((tmp_path / "ds" / "train_summary.json").read_text())
        assert 0.0 <= summary["heldout_reward_after"] <= 1.0 and (tmp_path / "ds" / "heldout_after.png").exists()
    # both parts in the checkpoint, whole: the VLM as an HF folder, the generator's LoRA gathered from its shards
    ckpt = tmp_path / "ds" / "checkpoint-3"
    for part in ("generator_lora", "edit_generator_lora"):  # step 2 refined, steps 1 and 3 drew
        lora = load_file(ckpt / part / "pytorch_lora_weights.safetensors")
        assert lora and all(t.numel() > 0 for t in lora.values()), part
        assert any(t.abs().sum() > 0 for k, t in lora.items() if "lora_B" in k), part  # trained away from B = 0
    vlm = AutoModelForImageTextToText.from_pretrained(ckpt)
    assert all(p.numel() > 0 for p in vlm.parameters())
    if zero == "zero2":
        return  # resume is the same code for both stages: ZeRO-3 runs it here, ZeRO-2 in train_grpo's test
    # resume from checkpoint-1 (the next step reflects on the checkpointed buffer): steps 2 and 3 again
    finish(mixgrpo(cli(tiny, tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "ds" / "checkpoint-1"),
                       **ds_args(tiny)), 2, config=zero))
    resumed = train_rows(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [2, 3]
    for a, b in zip(ds[1:], resumed):
        for key, value in values(a).items():
            assert value == pytest.approx(values(b)[key], rel=1e-5, abs=1e-7), (a["step"], key)


@pytest.mark.slow
@pytest.mark.full
def test_fsdp2_on_two_cpu_processes_matches_ddp_and_resumes(tiny, ddp_run, tmp_path):
    # accelerate_configs/fsdp2.yaml (through tests/fsdp_worker.py): the VLM's layers and the generator's blocks
    # sharded as units of the one prepared module; rollouts on whole weights gathered once (utils/core/fsdp.py)
    finish(mixgrpo(cli(tiny, tmp_path / "fsdp", **ds_args(tiny), save_steps=1), 2, config="fsdp2"))
    shards = os.listdir(tmp_path / "fsdp" / "checkpoint-3" / "training_state" / "pytorch_model_fsdp_0")
    assert sorted(s for s in shards if s.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    fsdp = train_rows(tmp_path / "fsdp")
    assert [m["step"] for m in fsdp] == [1, 2, 3]
    for a, b in zip(ddp_run, fsdp):
        assert_same_metrics(a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4 * reward_noise_gain(a)), a["step"]
    finish(mixgrpo(cli(tiny, tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "fsdp" / "checkpoint-1"),
                       **ds_args(tiny)), 2, config="fsdp2"))
    resumed = train_rows(tmp_path / "resumed")
    assert [m["step"] for m in resumed] == [2, 3]
    for a, b in zip(fsdp[1:], resumed):
        for key, value in values(a).items():
            assert value == pytest.approx(values(b)[key], rel=1e-5, abs=1e-7), (a["step"], key)
