import json
import os

import pytest
import torch
from PIL import Image

from tiny.models import load_flow_model, make_tiny_flow_model, make_tiny_llm, make_tiny_vlm
from tiny.tokenizer import COLOURS, FAMILIES, JSON_PUNCTUATION, SHAPES, make_tiny_tokenizer, tokenizer_corpus
from utils.core.models import ModelLoadError, freeze_vision_tower, is_vision_model, load_model_and_processor

torch.set_num_threads(1)

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    paths = {family: make_tiny_vlm(root / family, family=family) for family in FAMILIES}
    paths["llm"] = make_tiny_llm(root / "llm")
    return paths


def _image(colour=(255, 0, 0), size=84):
    return Image.new("RGB", (size, size), colour)


def _user(n_images, text="How many circles are in the image?"):
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


def _n_params(model):
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_keeps_answer_words_digits_and_json_punctuation_whole():
    tok = make_tiny_tokenizer("qwen2_5_vl")
    assert 300 <= len(tok) <= 420, len(tok)
    for word in COLOURS + SHAPES + ("yes", "no", "left", "right"):
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
        assert len(tok(" " + word, add_special_tokens=False).input_ids) == 1, word
    # Numbers go digit by digit, so "12" is two decisions and never a token of its own.
    assert tok.convert_ids_to_tokens(tok("12 305", add_special_tokens=False).input_ids) == [
        "1", "2", "Ġ", "3", "0", "5"]
    text = json.dumps({"reasoning_steps": ["I see 3 red circles."], "answer": "3"})
    tokens = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False).input_ids)
    for mark in JSON_PUNCTUATION:
        assert tokens.count(mark) == text.count(mark), (mark, tokens)
    for line in tokenizer_corpus():
        assert tok.decode(tok(line, add_special_tokens=False).input_ids) == line


def test_tokenizer_corpus_covers_the_output_formats():
    text = "\n".join(tokenizer_corpus())
    for needle in ('"reasoning_steps"', '"answer"', "<think>", "</answer>", "left", "right", "yes", "no",
                   "assistant") + COLOURS + SHAPES:
        assert needle in text, needle


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_has_the_family_special_tokens(family):
    tok = make_tiny_tokenizer(family)
    image_token = {"qwen2_5_vl": "<|image_pad|>", "internvl": "<IMG_CONTEXT>", "glm4v": "<|image|>"}[family]
    image_id = tok.convert_tokens_to_ids(image_token)
    assert image_id != tok.unk_token_id and tok.convert_ids_to_tokens(image_id) == image_token
    assert tok.eos_token is not None and tok.pad_token is not None
    # Special tokens are atomic and dropped by skip_special_tokens.
    ids = tok(image_token + "red", add_special_tokens=False).input_ids
    assert ids[0] == image_id and tok.decode(ids, skip_special_tokens=True) == "red"


# ---------------------------------------------------------------- tiny VLMs


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_vlm_loads_runs_forward_and_generate_with_an_image(tiny, family):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny[family])
    processor = AutoProcessor.from_pretrained(tiny[family])
    assert model.config.model_type == family
    n_params = _n_params(model)
    print(f"{family}: {n_params / 1e6:.3f}M parameters, vocab {len(processor.tokenizer)}")
    assert n_params < 5_000_000

    text = processor.apply_chat_template(_user(1), add_generation_prompt=True)
    assert processor.image_token in text  # the placeholder the processor expands
    inputs = processor(text=[text], images=[_image()], return_tensors="pt", padding=True)
    # 84x84 -> 6x6 patches of 14 px -> 2x2 merge (or pixel shuffle) -> 9 image tokens.
    assert (inputs["input_ids"] == model.config.image_token_id).sum().item() == 9

    out = model(**inputs, labels=inputs["input_ids"])
    assert torch.isfinite(out.loss)
    assert out.logits.shape[:2] == inputs["input_ids"].shape
    generated = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 4
    assert torch.equal(generated[:, : inputs["input_ids"].shape[1]], inputs["input_ids"])


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_with_one_and_two_images_per_sample(tiny, family):
    model, processor = load_model_and_processor(tiny[family])
    processor.tokenizer.padding_side = "left"
    texts = [processor.apply_chat_template(_user(n), add_generation_prompt=True) for n in (1, 2)]
    images = [[_image((255, 0, 0))], [_image((0, 255, 0)), _image((0, 0, 255))]]
    inputs = processor(text=texts, images=images, return_tensors="pt", padding=True)
    per_row = (inputs["input_ids"] == model.config.image_token_id).sum(1).tolist()
    assert per_row == [9, 18]
    assert inputs["attention_mask"][0, 0] == 0 and inputs["attention_mask"][1].all()  # left padding
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()

    # The same flat list of images (in order) gives the same inputs.
    flat = processor(text=texts, images=[img for row in images for img in row], return_tensors="pt", padding=True)
    assert torch.equal(flat["input_ids"], inputs["input_ids"])
    assert torch.equal(flat["pixel_values"], inputs["pixel_values"])


def test_image_changes_the_output(tiny):
    # The image must actually reach the LM: two different images give different logits.
    model, processor = load_model_and_processor(tiny["qwen2_5_vl"])
    text = processor.apply_chat_template(_user(1), add_generation_prompt=True)
    logits = []
    for colour in ((255, 0, 0), (0, 0, 255)):
        inputs = processor(text=[text], images=[_image(colour)], return_tensors="pt")
        with torch.no_grad():
            logits.append(model(**inputs).logits[0, -1])
    assert not torch.allclose(logits[0], logits[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_marks_assistant_tokens_ending_in_eos(tiny, family):
    # SFT trains on exactly these tokens: the answer plus the token generation stops at.
    model, processor = load_model_and_processor(tiny[family])
    tokenizer = processor.tokenizer
    messages = _user(1) + [{"role": "assistant", "content": "<answer>3</answer>"}]
    enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tokenizer.decode(ids) == "<answer>3</answer>" + tokenizer.eos_token
    assert tokenizer.eos_token_id in model.generation_config.eos_token_id


def test_make_tiny_vlm_is_deterministic_for_a_seed(tmp_path):
    from safetensors.torch import load_file

    def weights(path):
        return load_file(os.path.join(path, "model.safetensors"))

    a = weights(make_tiny_vlm(tmp_path / "a", seed=3))
    b = weights(make_tiny_vlm(tmp_path / "b", seed=3))
    c = weights(make_tiny_vlm(tmp_path / "c", seed=4))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_make_tiny_vlm_sizes_are_configurable(tmp_path):
    from transformers import AutoConfig

    path = make_tiny_vlm(tmp_path / "m", hidden_size=64, num_hidden_layers=1, vision_depth=1)
    config = AutoConfig.from_pretrained(path)
    assert config.text_config.hidden_size == 64 and config.text_config.num_hidden_layers == 1
    assert config.vision_config.depth == 1 and config.vision_config.out_hidden_size == 64
    with pytest.raises(ValueError, match="llava"):
        make_tiny_vlm(tmp_path / "x", family="llava")


# ---------------------------------------------------------------- tiny LLM


def test_tiny_llm_loads_as_text_only_causal_lm(tiny):
    from transformers import Qwen2ForCausalLM

    model, tokenizer = load_model_and_processor(tiny["llm"])
    assert isinstance(model, Qwen2ForCausalLM) and not is_vision_model(model)
    print(f"llm: {_n_params(model) / 1e6:.3f}M parameters")
    assert _n_params(model) < 5_000_000
    assert tokenizer("purple", add_special_tokens=False).input_ids == make_tiny_tokenizer()(
        "purple", add_special_tokens=False).input_ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Count to 3."}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nCount to 3.<|im_end|>\n<|im_start|>assistant\n"
    inputs = tokenizer([text], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    with pytest.raises(ValueError, match="no vision encoder"):
        freeze_vision_tower(model)
    with pytest.raises(ValueError, match="max_pixels"):
        load_model_and_processor(tiny["llm"], max_pixels=1000)


# ---------------------------------------------------------------- loader options and errors


def test_loader_dtype_and_pixel_budget(tiny):
    model, processor = load_model_and_processor(tiny["qwen2_5_vl"], dtype="bfloat16", attn_implementation="eager")
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    big = Image.new("RGB", (168, 168))
    grid = processor(text=["<|image_pad|>"], images=[big], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 12, 12]]  # within the saved budget: kept at 168 px
    _, processor = load_model_and_processor(tiny["qwen2_5_vl"], max_pixels=84 * 84, min_pixels=28 * 28)
    grid = processor(text=["<|image_pad|>"], images=[big], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 6, 6]]  # shrunk to the 84x84 budget
    with pytest.raises(ValueError, match="dtype"):
        load_model_and_processor(tiny["qwen2_5_vl"], dtype="float8")
    with pytest.raises(ValueError, match="min_pixels"):
        load_model_and_processor(tiny["qwen2_5_vl"], max_pixels=100, min_pixels=1000)
    with pytest.raises(ValueError, match="max_anyres_num"):
        load_model_and_processor(tiny["qwen2_5_vl"], max_anyres_num=2)


def test_loader_max_anyres_num_limits_internvl_tiles(tiny):
    wide = Image.new("RGB", (168, 84))
    _, processor = load_model_and_processor(tiny["internvl"])
    tiles = processor(text=["<IMG_CONTEXT>"], images=[wide], return_tensors="pt")["pixel_values"].shape[0]
    assert tiles == 3  # two crops + a thumbnail
    _, processor = load_model_and_processor(tiny["internvl"], max_anyres_num=1)
    out = processor(text=["<IMG_CONTEXT>"], images=[wide], return_tensors="pt")
    assert out["pixel_values"].shape[0] == 1
    assert (out["input_ids"] == processor.image_token_id).sum().item() == 9
    with pytest.raises(ValueError, match="max_pixels"):
        load_model_and_processor(tiny["internvl"], max_pixels=1000)


def test_loader_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "no" / "such" / "model")
    with pytest.raises(ModelLoadError, match="no/such/model"):
        load_model_and_processor(missing)
    with pytest.raises(ModelLoadError, match="nobody-here/not-a-model"):  # offline hub lookup fails fast
        load_model_and_processor("nobody-here/not-a-model")
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="weights.bin"):
        load_model_and_processor(a_file)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json") as err:
        load_model_and_processor(empty)
    assert str(empty) in str(err.value)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read the model config") as err:
        load_model_and_processor(empty)
    assert str(empty) in str(err.value)


# ---------------------------------------------------------------- vision tower


@pytest.mark.parametrize("family", FAMILIES)
def test_freeze_vision_tower(tiny, family):
    model, _ = load_model_and_processor(tiny[family])
    assert is_vision_model(model)
    tower = {"qwen2_5_vl": "model.visual.", "internvl": "model.vision_tower.", "glm4v": "model.visual."}[family]
    projector = {"qwen2_5_vl": ".merger.", "internvl": "multi_modal_projector", "glm4v": ".merger."}[family]
    params = dict(model.named_parameters())
    expected = sum(p.numel() for n, p in params.items() if n.startswith(tower) and projector not in n)
    assert expected > 0

    assert freeze_vision_tower(model) == expected
    for name, p in params.items():
        in_tower = name.startswith(tower) and projector not in name
        assert p.requires_grad != in_tower, name
    assert any(projector in n for n in params)  # the projector exists and stays trainable
    assert freeze_vision_tower(model) == 0  # already frozen

    model, _ = load_model_and_processor(tiny[family], freeze_vision_tower=True)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n in params if n.startswith(tower) and projector not in n}


def test_freeze_vision_tower_under_peft(tiny):
    from peft import LoraConfig, get_peft_model

    model, _ = load_model_and_processor(tiny["qwen2_5_vl"])
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert is_vision_model(model)
    base_trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert freeze_vision_tower(model, include_projector=True) == 0  # peft already froze the base
    for name, p in model.named_parameters():
        if "visual" in name:
            p.requires_grad_(True)
    assert freeze_vision_tower(model) > 0
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".visual." in n and ".merger." not in n)
    assert {n for n, p in model.named_parameters() if p.requires_grad and ".visual." not in n} == base_trainable


# ---------------------------------------------------------------- flow model


def test_tiny_flow_model(tmp_path):
    path = make_tiny_flow_model(tmp_path / "flow", seed=0)
    index = json.loads((tmp_path / "flow" / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
    assert index["text_encoder"] == [None, None]

    parts = load_flow_model(path)
    transformer, vae, scheduler = parts["transformer"], parts["vae"], parts["scheduler"]
    n_params = _n_params(transformer) + _n_params(vae)
    print(f"flow: transformer {_n_params(transformer) / 1e6:.3f}M + vae {_n_params(vae) / 1e6:.3f}M parameters")
    assert n_params < 5_000_000

    cfg = transformer.config
    latents = torch.randn(2, cfg.in_channels, cfg.sample_size, cfg.sample_size)
    with torch.no_grad():
        velocity = transformer(
            hidden_states=latents,
            encoder_hidden_states=torch.randn(2, 7, cfg.joint_attention_dim),
            pooled_projections=torch.randn(2, cfg.pooled_projection_dim),
            timestep=torch.tensor([900.0, 100.0]),
        ).sample
        image = vae.decode(latents).sample
    assert velocity.shape == latents.shape and torch.isfinite(velocity).all()
    assert image.shape == (2, 3, 32, 32)

    scheduler.set_timesteps(8)
    sigmas = scheduler.sigmas
    assert sigmas[0].item() == pytest.approx(1.0) and sigmas[-1].item() == 0.0
    assert len(sigmas) == 9 and (sigmas[1:] < sigmas[:-1]).all()


def test_flow_model_is_deterministic_and_errors(tmp_path):
    from safetensors.torch import load_file

    a = load_file(os.path.join(make_tiny_flow_model(tmp_path / "a", seed=1), "transformer",
                               "diffusion_pytorch_model.safetensors"))
    b = load_file(os.path.join(make_tiny_flow_model(tmp_path / "b", seed=1), "transformer",
                               "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ModelLoadError, match="vae"):
        os.makedirs(tmp_path / "partial" / "transformer")
        load_flow_model(tmp_path / "partial")
    with pytest.raises(ModelLoadError, match="missing-flow"):
        load_flow_model(tmp_path / "missing-flow")


@pytest.mark.parametrize("use_peft", [False, True])
def test_activation_checkpointing_follows_the_installed_transformers_without_warnings(tiny, use_peft):
    import warnings
    from types import SimpleNamespace

    from utils.core.encoding import encode_prompts
    from utils.core.logprobs import CompletionLogProbs, hf_core
    from utils.core.models import activation_checkpointing_on, prepare_for_training
    from utils.core.prompts import build_messages

    model, processor = load_model_and_processor(tiny["qwen2_5_vl"])
    assert not activation_checkpointing_on(model)
    cfg = SimpleNamespace(gradient_checkpointing=True, use_peft=use_peft, lora_r=2, lora_alpha=4, lora_dropout=0.0,
                          lora_target_modules=["q_proj", "v_proj"])
    with warnings.catch_warnings():
        # the deprecated names warn in transformers 5.24 (PEFT itself still reads one of them while it wraps)
        warnings.simplefilter("ignore" if use_peft else "error", FutureWarning)
        model = prepare_for_training(model, cfg)
    messages, images = [build_messages("What colour is it?", num_images=1)], [[Image.new("RGB", (56, 56), "red")]]
    batch = encode_prompts(processor, messages, images, sample_ids=["a"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert activation_checkpointing_on(hf_core(model))
        # a group's log-probs ask the same question on every step (checkpointing turns the shared pass off)
        logps = CompletionLogProbs(model)(batch, torch.tensor([[5, 6], [7, 8]]), torch.ones(2, 2, dtype=torch.long),
                                          prompt_index=torch.tensor([0, 0]))
    assert logps.shape == (2, 2)
    layers = [m for m in hf_core(model).modules() if getattr(m, "gradient_checkpointing", False)]
    assert layers and model.config.use_cache is False
