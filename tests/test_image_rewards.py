"""Image reward models (rewards/clip.py, hps.py, imagereward.py, ocr.py, unifiedreward.py, weighted.py) on tiny models
built from configs and saved as their hub repositories are laid out: each score equals the published formula computed
by another route on the same weights; OCR reads rendered text with the package's shipped models."""

import json
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from rewards import get_reward
from rewards.ocr import ocr_score, quoted_text
from rewards.unifiedreward import final_score
from tests.test_reward_servers import _chat_reply, _decode_request, serve  # noqa: F401 (the loopback fixture)
from tiny.reward_models import make_tiny_aesthetic, make_tiny_clip, make_tiny_hps, make_tiny_imagereward
from utils.core.config import ConfigError

PROMPTS = ["a photo of a cat", "a red dog on the table", "blue", "a photo of a dog", "cat"]
CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711])


def _images(n=5, size=48, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def _pixels(images, size):
    """CLIP's preprocessing of square images, by hand: bicubic resize, [0, 1], CLIP's mean and std."""
    arrays = [np.asarray(im.resize((size, size), Image.BICUBIC), dtype=np.float64) / 255.0 for im in images]
    return torch.tensor(np.stack([(a - CLIP_MEAN) / CLIP_STD for a in arrays]), dtype=torch.float32).permute(0, 3, 1, 2)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    model, processor = make_tiny_clip(str(folder))
    return str(folder), model, processor


def _clip_forward(model, processor, images, prompts):
    """CLIPModel's own forward (not the reward's path): its normalised embeddings and logits_per_image."""
    inputs = processor(text=prompts, images=images, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs)


def test_pickscore_is_logit_scale_times_cosine(tiny_clip):
    folder, model, processor = tiny_clip
    images = _images()
    out = _clip_forward(model, processor, images, PROMPTS)
    expected = out.logits_per_image.diagonal()  # logit_scale.exp() * cos, as PickScore publishes it
    cos = (out.image_embeds * out.text_embeds).sum(-1)
    assert torch.allclose(expected, model.logit_scale.exp() * cos, atol=1e-5)
    got = get_reward("pickscore", model_name_or_path=folder, batch_size=2)(["c"] * 5, images=images, prompt=PROMPTS)
    assert torch.allclose(torch.tensor(got), expected, atol=1e-4), (got, expected)
    flow = get_reward("pickscore", model_name_or_path=folder, divisor=26)(["c"] * 5, images=images, prompt=PROMPTS)
    assert torch.allclose(torch.tensor(flow), expected / 26, atol=1e-5)
    assert len(set(np.round(got, 4))) == 5  # the prompts and images matter


def test_pickscore_defaults_are_the_published_checkpoints():
    from rewards.clip import PICKSCORE_MODEL, PICKSCORE_PROCESSOR

    assert (PICKSCORE_MODEL, PICKSCORE_PROCESSOR) == ("yuvalkirstain/PickScore_v1",
                                                      "laion/CLIP-ViT-H-14-laion2B-s32B-b79K")


def test_clipscore_is_weight_times_cosine_or_clipped(tiny_clip, tmp_path):
    folder, model, processor = tiny_clip
    images = _images()
    with torch.no_grad():  # a second CLIP whose cosines are those of the first, negated: max(cos, 0) clips them
        model.visual_projection.weight.neg_()
        model.save_pretrained(tmp_path)
        processor.save_pretrained(tmp_path)
        flipped = _clip_forward(model, processor, images, PROMPTS)
        model.visual_projection.weight.neg_()
    out = _clip_forward(model, processor, images, PROMPTS)
    for where, run in ((folder, out), (str(tmp_path), flipped)):
        cos = F.cosine_similarity(run.image_embeds, run.text_embeds, dim=-1)
        rl = get_reward("clipscore", model_name_or_path=where)(["c"] * 5, images=images, prompt=PROMPTS)
        paper = get_reward("clipscore", model_name_or_path=where, weight=2.5, nonnegative=True)(
            ["c"] * 5, images=images, prompt=PROMPTS)
        assert torch.allclose(torch.tensor(rl), 100 * cos, atol=1e-3)
        assert torch.allclose(torch.tensor(paper), 2.5 * cos.clamp(min=0), atol=1e-5)
    assert (F.cosine_similarity(flipped.image_embeds, flipped.text_embeds, dim=-1) < 0).all()


def test_aesthetic_is_the_mlp_on_the_normalised_image_embedding(tmp_path):
    clip_dir, mlp_dir, model, processor, state = make_tiny_aesthetic(str(tmp_path))
    images = _images(4, size=40)
    with torch.no_grad():
        embed = model.get_image_features(pixel_values=_pixels(images, 32))
        embed = getattr(embed, "pooler_output", embed)
        x = embed / embed.norm(dim=-1, keepdim=True)
        for i in (0, 2, 4, 6, 7):  # the Linear layers; the dropouts between them do nothing in eval
            x = F.linear(x, state[f"layers.{i}.weight"], state[f"layers.{i}.bias"])
    got = get_reward("aesthetic", clip_name_or_path=clip_dir, mlp_name_or_path=mlp_dir)(["c"] * 4, images=images)
    assert torch.allclose(torch.tensor(got), x[:, 0], atol=1e-4), (got, x[:, 0])


def test_aesthetic_refuses_an_mlp_of_another_width(tmp_path):
    clip_dir, mlp_dir, *_ = make_tiny_aesthetic(str(tmp_path))
    other = make_tiny_clip(str(tmp_path / "wide"), projection_dim=24)
    del other
    with pytest.raises(ValueError, match="reads 16-wide embeddings, the CLIP gives 24"):
        get_reward("aesthetic", clip_name_or_path=str(tmp_path / "wide"), mlp_name_or_path=mlp_dir)


def test_hpsv2_is_the_cosine_of_open_clip_features(tmp_path):
    import open_clip

    config, model = make_tiny_hps(str(tmp_path))
    images = _images(4, size=64)
    tokenizer = open_clip.get_tokenizer("TinyHPS")
    with torch.no_grad():
        out = model(_pixels(images, 32), tokenizer(PROMPTS[:4]))
    image_f = out["image_features"] if isinstance(out, dict) else out[0]
    text_f = out["text_features"] if isinstance(out, dict) else out[1]
    expected = (image_f @ text_f.T).diagonal()  # HPS: features normalised by open_clip's forward, then dotted
    got = get_reward("hpsv2", model_name_or_path=str(tmp_path), architecture=config, batch_size=3)(
        ["c"] * 4, images=images, prompt=PROMPTS[:4])
    assert torch.allclose(torch.tensor(got), expected, atol=1e-4), (got, expected)


def test_imagereward_is_blip_text_cls_through_the_mlp_standardised(tmp_path):
    folder, tokenizer_dir, vision, text, mlp = make_tiny_imagereward(str(tmp_path))
    from transformers import AutoTokenizer

    images, prompts = _images(3, size=50), PROMPTS[:3]
    square = [im.resize((32, 32), Image.BICUBIC) for im in images]  # resize 32 + centre crop 32 of a square
    tokens = AutoTokenizer.from_pretrained(tokenizer_dir)(prompts, padding="max_length", truncation=True,
                                                          max_length=35, return_tensors="pt")
    with torch.no_grad():
        embeds = vision(pixel_values=_pixels(square, 32)).last_hidden_state
        cls = text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                   encoder_hidden_states=embeds).last_hidden_state[:, 0]
        expected = (mlp(cls) - 0.16717362830052426) / 1.0333394966054072
    got = get_reward("imagereward", model_name_or_path=folder, tokenizer_name_or_path=tokenizer_dir)(
        ["c"] * 3, images=images, prompt=prompts)
    assert torch.allclose(torch.tensor(got), expected, atol=1e-4), (got, expected)


def test_imagereward_names_the_checkpoint_part_it_lacks(tmp_path):
    folder, tokenizer_dir, *_ = make_tiny_imagereward(str(tmp_path))
    state = torch.load(tmp_path / "ImageReward.pt", weights_only=True)
    torch.save({k: v for k, v in state.items() if not k.startswith("mlp.")}, tmp_path / "ImageReward.pt")
    with pytest.raises(ValueError, match=r"ImageReward.pt: no weights for mlp: layers.0.weight"):
        get_reward("imagereward", model_name_or_path=folder, tokenizer_name_or_path=tokenizer_dir)


def test_models_load_once_score_in_batches_and_skip_none(tiny_clip):
    folder = tiny_clip[0]
    one = get_reward("pickscore", model_name_or_path=folder, batch_size=1)
    many = get_reward("pickscore", model_name_or_path=folder, batch_size=16)
    assert one.options["clip"] is many.options["clip"]  # one load per process
    clip = one.options["clip"]
    assert not clip.model.training and not any(p.requires_grad for p in clip.model.parameters())
    images = _images()
    images[2] = None
    a = one(["c"] * 5, images=images, prompt=PROMPTS)
    b = many(["c"] * 5, images=images, prompt=PROMPTS)
    assert a[2] is None and b[2] is None
    assert np.allclose([v for v in a if v is not None], [v for v in b if v is not None], atol=1e-5)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        get_reward("pickscore", model_name_or_path=folder, batch_size=0)
    with pytest.raises(ValueError, match="needs the prompt text in column 'prompt'"):
        one(["c"], images=_images(1))


@pytest.mark.parametrize("reward,module,package", [("hpsv2", "open_clip", "open_clip_torch"),
                                                   ("ocr", "rapidocr", "rapidocr"),
                                                   ("ocr", "Levenshtein", "levenshtein")])
def test_a_missing_package_is_refused_in_one_line(monkeypatch, reward, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # what an environment without the package gives on import
    with pytest.raises(ConfigError) as info:
        get_reward(reward)
    message = str(info.value)
    assert "\n" not in message and f"needs the package {package!r}" in message
    assert "pip install -r requirements-rewards.txt" in message


# ---- OCR ----


def _edit_distance(a, b):
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def test_ocr_score_is_flow_grpos_normalised_edit_distance():
    assert quoted_text('A neon sign that says "Open Late" at night') == "Open Late"
    assert quoted_text("no quotes here") is None
    for read, target in [("OpenLate", "Open Late"), ("0pen Lat", "Open Late"), ("xx open late yy", "Open Late"),
                         ("", "Open Late"), ("completely different words", "Hi")]:
        r, t = read.replace(" ", "").lower(), target.replace(" ", "").lower()
        d = 0 if t in r else min(_edit_distance(r, t), len(t))
        assert math.isclose(ocr_score(read, target), 1 - d / len(t))
    assert ocr_score("", "Hi") == 0.0 and ocr_score("hi there", "Hi") == 1.0


def _render(text, size=(320, 96)):
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((12, 24), text, fill="black", font=ImageFont.load_default(size=36))
    return image


def test_ocr_reward_orders_exact_near_wrong_renderings():
    fn = get_reward("ocr")
    prompt = 'a shop sign that says "Hello World"'
    scores = fn(["c"] * 4, images=[_render("Hello World"), _render("Helo Wrld"), _render("Banana"), None],
                prompt=[prompt] * 4)
    exact, near, wrong, missing = scores
    assert exact == 1.0 and 0.5 < near < 1.0 and wrong < near and missing is None, scores
    assert fn(["c"], images=[_render("Hello")], prompt=["no quoted text"]) == [None]


# ---- weighted and the judge ----


def test_weighted_sums_parts_and_leaves_out_none(tiny_clip):
    folder = tiny_clip[0]
    images = _images(3)
    images[1] = None
    pick = get_reward("pickscore", model_name_or_path=folder)(["c"] * 3, images=images, prompt=PROMPTS[:3])
    clip = get_reward("clipscore", model_name_or_path=folder)(["c"] * 3, images=images, prompt=PROMPTS[:3])
    both = get_reward("weighted", weights={"pickscore": 1.0, "clipscore": -0.5},
                      reward_kwargs={"pickscore": {"model_name_or_path": folder},
                                     "clipscore": {"model_name_or_path": folder}})
    got = both(["c"] * 3, images=images, prompt=PROMPTS[:3])
    assert got[1] is None
    for i in (0, 2):
        assert math.isclose(got[i], pick[i] - 0.5 * clip[i], rel_tol=1e-6)
    with pytest.raises(ValueError, match="reward_kwargs names \\['ocr'\\], which are not in weights"):
        get_reward("weighted", weights={"pickscore": 1.0}, reward_kwargs={"ocr": {}})


def test_unifiedreward_scores_final_score_over_five(serve):  # noqa: F811
    def respond(attempt, path, body):
        request, image, text = _decode_request(body)
        assert image.size == (512, 512) and "Text Caption: [" in text and request["model"] == "ur"
        caption = text.rsplit("[", 1)[1].rstrip("]")
        return _chat_reply({"good": "Alignment fine.\nFinal Score: 4.5", "bad": "Final Score: 2",
                            "mute": "I cannot tell."}[caption])

    server = serve(respond)
    fn = get_reward("unifiedreward", base_url=server.url + "/v1", model="ur", timeout=5.0)
    out = fn(["c"] * 4, images=_images(4), prompt=["good", "bad", "mute", "good"])
    assert out == [0.9, 0.4, None, 0.9]
    assert final_score("Final Score: 3\n...\nFinal Score: 5") == 1.0 and final_score(json.dumps({})) is None


def test_reward_models_load_whole_under_a_zero3_config(tiny_clip, tmp_path):
    """Under an accelerate ZeRO-3 config transformers builds models sharded; a reward model loads whole all the same
    (every process scores its own images with all of it), and the ZeRO-3 config stays registered for the policy."""
    import shutil

    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    shutil.copytree(tiny_clip[0], tmp_path / "clip")
    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    try:
        fn = get_reward("pickscore", model_name_or_path=str(tmp_path / "clip"))
        assert is_deepspeed_zero3_enabled()
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        del config
    model = fn.options["clip"].model
    assert all(p.numel() > 0 for p in model.parameters())
    assert fn(["c"], images=_images(1), prompt=["a cat"])[0] is not None
