"""train_mixgrpo.py against R3's own training code: the text ratio is 1 on a first pass with LoRA dropout, the image
KL has its own weight only, seed streams are disjoint, the reflect buffer resumes without unpickling, R3's format
rules, R3's GenEval++ judge request, and the r3_* recipes' defaults."""

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import train_mixgrpo as tm
from kernels import group_advantages
from train_mixgrpo import MixGRPOConfig
from utils.core.errors import InputError
from utils.t2i import mixgrpo_eval, mixgrpo_model, r3_format

TINY_CFG = dict(group_size=4, policy_group_size=1, prompts_per_policy_group=2, max_output_token_n_gen=6,
                image_size=32, num_timesteps_gen=4, temperature=0.7, generator_lora_r=4, report_to="none",
                reward_fn="tests.mixgrpo_helpers:brightness", seed=0)


@pytest.fixture(scope="module", autouse=True)
def fresh_accelerate_state():
    """The Accelerator these tests make is process-wide state (a reward's rank reads it): none left behind."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from accelerate import Accelerator

    from tiny.pipelines import make_tiny_qwenimage
    from tiny.t2i import make_t2i_prompts

    gen_path = make_tiny_qwenimage(str(tmp_path_factory.mktemp("fidelity") / "qwenimage"))
    return dict(gen_path=gen_path, vlm_path=os.path.join(gen_path, "_vlm"), rows=make_t2i_prompts(2, seed=0),
                accelerator=Accelerator(cpu=True))


def build(tiny, **overrides):
    cfg = MixGRPOConfig(**{**TINY_CFG, **overrides})
    model, processor, policy, gen, gen_params = tm.build_policy(cfg, tiny["vlm_path"], tiny["gen_path"], "cpu")
    stop = tm.stop_token_ids(model, processor.tokenizer)
    return dict(cfg=cfg, model=model, processor=processor, policy=policy, gen=gen, gen_params=gen_params, stop=stop,
                suppress=tm.special_token_ids_to_suppress(processor.tokenizer, stop))


def reason(tiny, parts, cfg=None):
    cfg = cfg or parts["cfg"]
    return tm.reason_rollout(cfg, 0, [0, 1], tiny["rows"], rank_in_group=0, policy=parts["policy"],
                             processor=parts["processor"], gen=parts["gen"], accelerator=tiny["accelerator"],
                             stop_ids=parts["stop"], suppress_ids=parts["suppress"],
                             reward_fn=tm.build_image_reward(cfg))


# ---- 1. LoRA dropout and the text ratio ----

@pytest.mark.parametrize("disable", [True, False])
def test_lora_dropout_is_off_so_the_text_ratio_is_one_on_a_first_pass(tiny, disable):
    """Rollout log-probs come from eval() mode and the loss's from train() mode (as in the training loop). With
    LoRA's B matrices moved off 0 (a policy some steps in), dropout on the LoRA branch changes the train-mode
    log-probs: --disable_dropout (the default) keeps the first pass's ratio at 1."""
    parts = build(tiny, use_peft=True, lora_r=4, lora_dropout=0.3, disable_dropout=disable)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in parts["model"].named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    cfg = replace(parts["cfg"], tune_image_cot=False, kl_weight_text=0.0)
    mix = tm.MixGRPOModel(parts["policy"], parts["gen"])
    mix.eval()
    roll = reason(tiny, parts, cfg)
    mix.train()
    adv = torch.linspace(-1, 1, 8)
    _, stats = tm.mixgrpo_loss(cfg, mix, roll, adv, adv, ref_logps=None, ref_mean=None,
                               text_tokens=roll["mask"].sum().float(), n_images=8, world=1)
    if disable:
        assert stats["ratio_max_dev_text"] < 1e-5
    else:  # the test sees the defect: dropout on moves the ratio
        assert stats["ratio_max_dev_text"] > 1e-3


# ---- 5. the image KL's weight ----

def test_image_kl_is_weighted_by_kl_weight_image_only(tiny):
    """R3: image part = mse_weight * clipped surrogate + kl_weight_image * image KL. With zero image advantages the
    surrogate is 0, so the loss is the KL term alone, whatever mse_weight is."""
    parts = build(tiny)
    cfg = replace(parts["cfg"], tune_text_cot=False, kl_weight_image=0.5)
    roll = reason(tiny, parts, cfg)
    with torch.no_grad():
        _, mean, std = mixgrpo_model.image_logprobs(parts["gen"], tm.step_condition(roll), roll["steps"])
    ref_mean = mean + 0.01 * torch.randn(mean.shape, generator=torch.Generator().manual_seed(0))
    expected = 0.5 * tm.image_kl(mean, ref_mean, std).mean()
    mix, zero = tm.MixGRPOModel(parts["policy"], parts["gen"]), torch.zeros(8)
    losses = []
    for mse in (1.0, 2.0):
        loss, _ = tm.mixgrpo_loss(replace(cfg, mse_weight=mse), mix, roll, zero, zero, ref_logps=None,
                                  ref_mean=ref_mean, text_tokens=roll["mask"].sum().float(), n_images=8, world=1)
        losses.append(loss.item())
    assert expected > 0
    assert losses[0] == pytest.approx(expected.item(), rel=1e-5) and losses[1] == pytest.approx(losses[0], rel=1e-6)


# ---- 8. seed streams ----

def test_seed_streams_are_disjoint_across_run_seeds():
    bases = {}
    for seed in range(6):
        for stream in range(tm.SEED_STREAMS):
            key = tuple(tm.seeds_for(seed, stream, 3, [0, 1, 2]).tolist())
            assert key not in bases, (seed, stream, bases.get(key))
            bases[key] = (seed, stream)
    # the overlap this pins: stream 4 of seed s was stream 0 of seed s + 1
    assert not torch.equal(tm.seeds_for(0, 4, 0, [0]), tm.seeds_for(1, 0, 0, [0]))
    with pytest.raises(ValueError, match="stream"):
        tm.seeds_for(0, tm.SEED_STREAMS, 0, [0])


# ---- 9. the reflect buffer on resume ----

def small_buffer():
    from PIL import Image

    def image(v):
        return Image.fromarray((torch.arange(48).reshape(4, 4, 3) * v % 256).to(torch.uint8).numpy())

    row = dict(prompt="a red cube", tag="color", include=[dict(**{"class": "cube"}, count=1, color="red")])
    return dict(perfect=[dict(id=3, row=row, score=1.0, image=image(1))],
                imperfect=[dict(id=0, row=row, score=0.125, image=image(7)),
                           dict(id=5, row=dict(row, prompt="two cats"), score=1 / 3, image=image(11))])


def test_reflect_buffer_round_trips_exactly(tmp_path):
    buffer = small_buffer()
    tm.save_buffer(buffer, str(tmp_path))
    assert not os.path.exists(tmp_path / "buffer.pt")
    back = tm.load_buffer(str(tmp_path))
    for pool in ("perfect", "imperfect"):
        assert [(e["id"], e["row"], e["score"]) for e in back[pool]] == [
            (e["id"], e["row"], e["score"]) for e in buffer[pool]]
        assert [e["image"].tobytes() for e in back[pool]] == [e["image"].tobytes() for e in buffer[pool]]
    assert tm.load_buffer(str(tmp_path / "none")) is None


class Planted:
    """Unpickling this writes a file: the proof that a load ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("target", ["images.pt", "buffer.pt"])
def test_a_planted_object_in_the_buffer_is_refused_naming_the_file(tmp_path, target):
    folder = tmp_path / "checkpoint-2" / "reflect_buffer"
    tm.save_buffer(small_buffer(), str(folder))
    marker = tmp_path / "ran"
    torch.save({"perfect": [Planted(str(marker))], "imperfect": []}, folder / target)
    with pytest.raises(InputError, match=str(folder / target)):
        tm.load_buffer(str(folder))
    assert not marker.exists()


# ---- 6. R3's format rules ----

@pytest.mark.parametrize("text, fmt", [
    ("<think>two red circles</think>", 1.0),
    ("<think>plan</think> and then some", 0.0),  # nothing may follow the reasoning
    ("<think>a <think>nested</think>", 0.0),
    ("<think>a</think><think>b</think>", 0.0),
])
def test_reason_format_is_the_whole_output(text, fmt):
    assert r3_format.reasoning_of(text)[0] == fmt


@pytest.mark.parametrize("text, fmt, instruction, no_edit", [
    ("<think>missing a cube</think> add a red cube", 1.0, "add a red cube", False),
    ("missing a cube</think> add a red cube", 0.0, "add a red cube", False),  # no leading <think>: format 0
    ("<think>fine</think> No further edit.", 1.0, "No further edit.", True),  # R3 matches "no further edit"
    ("add a red cube", 0.0, r3_format.NO_EDIT, True),  # malformed: no edit, the image is kept
    ("<think>a</think> b <think>c</think> d", 0.0, "d", False),
])
def test_reflection_follows_r3(text, fmt, instruction, no_edit):
    assert r3_format.reflection_of(text) == (fmt, instruction, no_edit)


# ---- 4. R3's GenEval++ judge ----

def test_geneval_plus_judge_sends_r3s_system_prompt_and_the_rows_checklist():
    """A loopback judge captures each request: R3's system prompt, and a user turn built from the row's metadata
    (colour, size, count, region, the exclude items), which the prompt text alone does not carry."""
    import json

    from rewards import get_reward
    from rewards.geneval import GENEVAL_PLUS_SYSTEM
    from tests.test_reward_servers import Loopback, _chat_reply, _image

    replies = iter(['{"correct": 1,}', "I cannot tell.", '```json\n{"correct": 0}\n```'])
    server = Loopback(lambda attempt, path, body: _chat_reply(next(replies)))
    try:
        fn = get_reward("judge_geneval_plus", base_url=server.url + "/v1", model="judge", max_concurrency=1,
                        timeout=5.0)
        rows = [dict(prompt="a photo of things", include=[{"class": "cat", "count": 2, "color": "red",
                                                           "region": "left", "size": "large"}],
                     exclude=[{"class": "dog", "count": 1}]),
                dict(prompt="another photo", include=[{"class": "cup", "count": 1}]),
                dict(prompt="a third", include=[{"class": "cup", "count": 3, "region": "top"}], exclude=None)]
        columns = {k: [r.get(k) for r in rows] for k in ("prompt", "include", "exclude")}
        out = fn(["c"] * 3, images=[_image("red")] * 3, **columns)
    finally:
        server.close()
    assert out == [1.0, None, 0.0]  # R3 reads a reply without a verdict as 0; here it is no score
    sent = [json.loads(body)["messages"] for _, body, _ in server.requests]
    assert all(m[0] == {"role": "system", "content": GENEVAL_PLUS_SYSTEM} for m in sent)
    texts = [next(p["text"] for p in m[1]["content"] if p["type"] == "text") for m in sent]
    assert texts[0] == ("Instruction: a photo of things\n\nExplanation: This image should contain:\n"
                        "- red-colored large 2 cats located in the left part of the image.\n"
                        "- No more than 0 dog should appear.")
    assert texts[1].endswith("contain:\n- 1 cup present in the image.")
    assert texts[2].endswith("- 3 cups located in the top part of the image.")
    assert "Be very strict" in GENEVAL_PLUS_SYSTEM and "collage" in GENEVAL_PLUS_SYSTEM


def test_unscored_images_are_left_out_of_the_group_and_counted():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 0.5, float("nan"), float("nan"), float("nan"), float("nan")])
    adv = group_advantages(rewards, 4, scale="none")
    assert adv.tolist() == pytest.approx([0.5, 0.0, -0.5, 0.0] + [0.0] * 4)
    full = torch.tensor([1.0, 0.2, 0.0, 0.5])
    assert torch.allclose(group_advantages(full, 4, scale="group"),
                          (full - full.mean()) / (full.std() + 1e-4))
    scores = tm.score_images(SimpleNamespace(reward_fn="r"), lambda texts, images, **c: [1.0, None], ["a", "b"],
                             [None, None], [dict(prompt="x"), dict(prompt="y")])
    assert scores[0] == 1.0 and scores[1].isnan()


# ---- 7. the r3_* recipes ----

RECIPES = ("r3_geneval.yaml", "r3_geneval_plus.yaml", "r3_tiif.yaml")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe(name):
    from utils.core.config import parse_config

    return parse_config(MixGRPOConfig, ["--config", os.path.join(REPO, "recipes", name)])


@pytest.mark.parametrize("name", RECIPES)
def test_r3_recipes_carry_r3s_script_defaults_and_truncated_sampling_is_refused(name):
    from utils.core.config import ConfigError

    cfg = recipe(name)
    assert (cfg.format_weight, cfg.max_output_token_n_gen, cfg.max_output_token_n_edit) == (1.0, 196, 384)
    assert cfg.freeze_vision_tower and cfg.use_peft and cfg.disable_dropout and cfg.lora_dropout > 0
    cfg.train_data_path = cfg.val_data_path = "prompts.jsonl"
    tm.validate(cfg, 4)
    for flags in (dict(top_k=50), dict(top_p=0.9)):
        with pytest.raises(ConfigError, match="full tempered softmax"):
            tm.validate(replace(cfg, **flags), 4)


@pytest.mark.parametrize("name", RECIPES)
def test_r3_recipes_at_tiny_sizes_keep_the_text_ratio_at_one_on_a_first_pass(tiny, name):
    """Each r3_* recipe with its LoRA (dropout 0.05), frozen vision tower and dtype, on the tiny models and tiny
    sizes: rollout in eval() mode, loss in train() mode, LoRA's B moved off 0: ratio 1 on the first pass."""
    sizes = {k: TINY_CFG[k] for k in ("group_size", "policy_group_size", "prompts_per_policy_group",
                                      "max_output_token_n_gen", "image_size", "num_timesteps_gen", "reward_fn")}
    cfg = replace(recipe(name), **sizes, lora_r=4, lora_alpha=8, generator_lora_r=4, gradient_checkpointing=False,
                  dataset_name="shapes_t2i")
    model, processor, policy, gen, _ = tm.build_policy(cfg, tiny["vlm_path"], tiny["gen_path"], "cpu")
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".visual." in n and "merger" not in n)
    stop = tm.stop_token_ids(model, processor.tokenizer)
    parts = dict(cfg=cfg, policy=policy, processor=processor, gen=gen, stop=stop,
                 suppress=tm.special_token_ids_to_suppress(processor.tokenizer, stop))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    mix = tm.MixGRPOModel(policy, gen)
    mix.eval()
    roll = reason(tiny, parts, replace(cfg, tune_image_cot=False))
    mix.train()
    adv = torch.linspace(-1, 1, 8)
    _, stats = tm.mixgrpo_loss(replace(cfg, tune_image_cot=False, kl_weight_text=0.0), mix, roll, adv, adv,
                               ref_logps=None, ref_mean=None, text_tokens=roll["mask"].sum().float(), n_images=8,
                               world=1)
    assert stats["ratio_max_dev_text"] < 1e-5


# ---- 3. the timestep shift on the real checkpoints' scheduler configs ----

@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    from tiny import pipelines as tp
    from utils.t2i import adapters as fa

    root = tmp_path_factory.mktemp("pipes")
    return {"qwenimage": (fa.QwenImageGenerator, tp.make_tiny_qwenimage(str(root / "qwen")), tp.QWEN_IMAGE_SCHEDULER),
            "sd3": (fa.SD3Generator, tp.make_tiny_sd3(str(root / "sd3")), tp.SD35_SCHEDULER),
            "flux": (fa.FluxGenerator, tp.make_tiny_flux(str(root / "flux")), tp.FLUX1_DEV_SCHEDULER),
            "klein": (fa.Flux2KleinGenerator, tp.make_tiny_klein(str(root / "klein")), tp.FLUX2_KLEIN_SCHEDULER)}


@pytest.mark.parametrize("name", ["qwenimage", "sd3", "flux", "klein"])
def test_a_fixed_shift_gives_r3s_schedule_on_the_real_scheduler_configs(pipelines, name):
    """R3: t' = 3t / (1 + 2t) on the linear steps. The tiny pipelines carry the real configs (Qwen-Image's
    shift_terminal 0.02 and dynamic exponential shifting included), which diffusers would apply on top."""
    cls, path, real = pipelines[name]
    gen = cls.from_pretrained(path)
    config = gen.scheduler.config
    assert all(config[k] == v for k, v in real.items()), name
    x = gen.prepare_latents(1, 32, 32, torch.Generator().manual_seed(0))
    _, sigmas = gen.schedule(8, x, shift=3.0)
    t = torch.linspace(1, 1 / 8, 8, dtype=torch.float64)
    assert torch.allclose(sigmas[:-1].double(), 3 * t / (1 + 2 * t), atol=1e-6) and sigmas[-1] == 0
    _, own = gen.schedule(8, x)  # without the flag: the pipeline's own schedule, untouched
    assert not torch.allclose(own[:-1].double(), 3 * t / (1 + 2 * t), atol=1e-3)


# ---- R3's evaluation: refine rounds until "no further edit", per round and per tag ----

@pytest.mark.slow
@pytest.mark.full
def test_eval_refine_rounds_stop_at_no_edit_and_report_each_round_and_tag(tiny, monkeypatch, tmp_path):
    parts = build(tiny)
    rows = [dict(r, tag=t) for r, t in zip(tiny["rows"], ("counting", "color"))]
    cfg = replace(parts["cfg"], reflect_refine=True, eval_refine_rounds=3, eval_num_timesteps=3)
    real, calls = mixgrpo_eval.greedy_texts, []

    def scripted(cfg, messages, images, idx, *a, **kw):  # row 0 edits every round, row 1 stops in round 2
        out = real(cfg, messages, images, idx, *a, **kw)
        if not any(images):
            return out
        calls.append(list(idx))
        return ["<think>x</think> add a circle" if i == 0 or len(calls) == 1 else "<think>ok</think> no further edit"
                for i in idx]

    monkeypatch.setattr(mixgrpo_eval, "greedy_texts", scripted)
    result = tm.evaluate_reason(cfg, rows, policy=parts["policy"], processor=parts["processor"], gen=parts["gen"],
                                accelerator=tiny["accelerator"], stop_ids=parts["stop"],
                                suppress_ids=parts["suppress"], reward_fn=tm.build_image_reward(cfg),
                                grid_path=str(tmp_path / "grid.png"))
    assert result["refine_no_edit"] == 0.5  # row 1 stopped, row 0 edited all three rounds
    assert calls == [[0, 1], [0, 1], [0]]  # row 1 stops in round 2 and is not reflected on again
    for n in (1, 2, 3):
        assert result[f"round{n}_improved"] + result[f"round{n}_worse"] + result[f"round{n}_same"] == 1.0
    assert result["round3_reward"] == result["refine_reward"]
    assert result["refine_improved"] + result["refine_worse"] <= 1.0  # first draft -> last round
    assert result["round2_same"] >= 0.5 and result["round3_same"] >= 0.5  # the stopped row's image is kept
    assert set(k for k in result if k.startswith("tag_")) == {"tag_counting", "tag_color"}
    assert (result["tag_counting"] + result["tag_color"]) / 2 == pytest.approx(result["reward"])


def test_eval_refine_draws_only_the_edited_images_each_from_its_own_noise(tiny, monkeypatch):
    """A reflection that says "no further edit" keeps its image without drawing it again; an edited image gets the
    noise of its own id, so it comes out as when every image in the batch is edited."""
    import numpy as np
    from PIL import Image

    parts = build(tiny)
    cfg = replace(parts["cfg"], reflect_refine=True, eval_num_timesteps=3)
    drafts = [Image.new("RGB", (cfg.image_size, cfg.image_size), "white") for _ in range(2)]  # only the noise differs
    real_sample, drawn = mixgrpo_eval.sample, []

    def counted(gen, cond, **kw):
        drawn.append(cond.batch_size)
        return real_sample(gen, cond, **kw)

    def refine(answers):
        monkeypatch.setattr(mixgrpo_eval, "greedy_texts", lambda *a, **kw: list(answers))
        return mixgrpo_eval.refine_heldout(cfg, tiny["rows"], [0, 1], drafts, parts["gen"], tiny["accelerator"],
                                           noise_ids=[11, 12], policy=parts["policy"], processor=parts["processor"],
                                           stop_ids=parts["stop"], suppress_ids=parts["suppress"])

    monkeypatch.setattr(mixgrpo_eval, "sample", counted)
    edit = "<think>x</think> add a circle"
    _, both, _ = refine([edit, edit])
    _, second, no_edit = refine(["<think>ok</think> no further edit needed", edit])
    assert drawn == [2, 1] and no_edit == [True, False]
    assert second[0] is drafts[0]
    diff = np.abs(np.asarray(second[1], dtype=float) - np.asarray(both[1], dtype=float))
    assert diff.max() <= 2 and not np.array_equal(np.asarray(both[0]), np.asarray(both[1]))


def test_refine_change_counts_perfect_drafts_made_worse_among_perfect_drafts_only():
    from utils.t2i.mixgrpo_eval import heldout_lines, refine_change, scored_mean

    pairs = ((1.0, 1.0), (1.0, 0.5), (0.5, 1.0), (0.5, 0.25), (0.5, 0.5), (float("nan"), 1.0))
    changes = [refine_change(a, b) for a, b in pairs]
    assert scored_mean([c["refine_perfect_worse"] for c in changes]) == 0.5  # 1 of the 2 perfect drafts
    assert scored_mean([c["refine_improved"] for c in changes]) == 0.2  # 1 of the 5 scored
    assert scored_mean([c["refine_worse"] for c in changes]) == 0.4
    result = dict(reward=0.5, refine_reward=0.6, refine_no_edit=0.3, round1_reward=0.55, round2_reward=0.6,
                  **{k: scored_mean([c[k] for c in changes]) for k in changes[0]})
    lines = heldout_lines(dict(result, round1_reward=0.4), result, "2 prompts")
    assert "by round 0.4000 0.6000" in lines[2] and "by round 0.5500 0.6000" in lines[3]
    assert "perfect drafts made worse 0.500" in lines[3]


def test_unscored_reason_images_go_to_the_imperfect_pool():
    from accelerate import Accelerator

    Accelerator(cpu=True)
    roll = dict(global_ids=[0, 1, 2], rows=[{}, {}, {}], scores=torch.tensor([1.0, float("nan"), 0.5]),
                images=["a", "b", "c"])
    buffer = tm.build_buffer(None, roll)
    assert [e["id"] for e in buffer["perfect"]] == [0] and [e["id"] for e in buffer["imperfect"]] == [1, 2]
