"""CompletionLogProbs on real tiny models: equal to the model's own logits, and the shared-prompt pass
(a group's completions reuse one prompt forward) equal to the plain one, values and gradients."""

import pytest
import torch

from tiny.models import make_tiny_llm, make_tiny_vlm
from tiny.shapes import make_shapes_vqa
from utils.core.encoding import encode_prompts
from utils.core.logprobs import CompletionLogProbs, can_share_prompts, expand_prompts
from utils.core.models import load_model_and_processor
from utils.core.prompts import build_messages
from utils.core.rollout import generate_completions
from utils.core.seeds import completion_seeds


@pytest.fixture(scope="module", params=["qwen", "text"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    path = make_tiny_vlm(str(root / "m"), seed=0) if request.param == "qwen" else make_tiny_llm(str(root / "m"), seed=0)
    model, processor = load_model_and_processor(path)
    rows = [make_shapes_vqa(3, seed=5)[i] for i in (0, 2)]  # two prompts of different lengths
    images = [[r["image"]] if request.param == "qwen" else [] for r in rows]
    messages = [build_messages(r["question"] + " Look closely." * i, num_images=len(im))
                for i, (r, im) in enumerate(zip(rows, images))]
    prompts = encode_prompts(processor, messages, images, sample_ids=["a", "b"])
    prompt_index = torch.tensor([0, 0, 0, 1, 1, 1])
    tok = getattr(processor, "tokenizer", processor)
    ids, mask = generate_completions(model, expand_prompts(prompts, prompt_index),
                                     row_seeds=completion_seeds(0, 0, range(6)),
                                     max_new_tokens=7, temperature=1.0, eos_token_id=[tok.eos_token_id],
                                     pad_token_id=tok.pad_token_id)
    return model, prompts, prompt_index, ids, mask, images


def test_logprobs_equal_the_models_own_logits(setup):
    model, prompts, prompt_index, ids, mask, _ = setup
    full = expand_prompts(prompts, prompt_index)
    with torch.no_grad():
        ours = CompletionLogProbs(model)(full, ids, mask, temperature=0.7)
        inputs = dict(full)
        inputs["input_ids"] = torch.cat([full["input_ids"], ids], 1)
        inputs["attention_mask"] = torch.cat([full["attention_mask"], mask], 1)
        if "mm_token_type_ids" in full:
            inputs["mm_token_type_ids"] = torch.cat([full["mm_token_type_ids"], torch.zeros_like(ids)], 1)
        logits = model(**inputs).logits[:, full["input_ids"].shape[1] - 1:-1] / 0.7
        expected = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1) * mask
    assert torch.allclose(ours, expected, atol=1e-5)


def test_shared_prompt_pass_matches_plain_pass_with_gradients(setup):
    model, prompts, prompt_index, ids, mask, images = setup
    assert can_share_prompts(model, [len(i) for i in images])
    policy = CompletionLogProbs(model)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(0))

    def grads(logps):
        model.zero_grad()
        (logps * weights * mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = policy(expand_prompts(prompts, prompt_index), ids, mask)
    g_plain = grads(plain)
    shared = policy(prompts, ids, mask, prompt_index=prompt_index)
    g_shared = grads(shared)
    assert torch.allclose(shared, plain, atol=1e-5)
    assert g_plain.keys() == g_shared.keys()
    for name in g_plain:
        assert torch.allclose(g_shared[name], g_plain[name], rtol=1e-3, atol=1e-6), name


def test_sharing_is_refused_where_images_do_not_split_per_prompt(setup):
    model = setup[0]
    if hasattr(model.config, "vision_config"):
        assert not can_share_prompts(model, [2, 1])
        assert can_share_prompts(model, [1, 1])


def test_generation_with_a_shared_prefill_gives_the_same_completions(setup):
    """Each prompt prefilled once and its cache shared by its completions: the same samples as one prefill per
    completion (the sampler's noise depends only on seed, position and token)."""
    model, prompts, prompt_index, ids, mask, _ = setup
    eos = model.generation_config.eos_token_id
    tok_ids = dict(row_seeds=completion_seeds(0, 0, range(6)), max_new_tokens=12, temperature=1.0,
                   eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else [eos], pad_token_id=0)
    plain_ids, plain_mask = generate_completions(model, expand_prompts(prompts, prompt_index), **tok_ids)
    shared_ids, shared_mask = generate_completions(model, prompts, prompt_index=prompt_index, **tok_ids)
    assert torch.equal(shared_ids, plain_ids) and torch.equal(shared_mask, plain_mask)
    # and log-probs scored afterwards agree with the model's view of those tokens
    with torch.no_grad():
        a = CompletionLogProbs(model)(prompts, shared_ids, shared_mask, prompt_index=prompt_index)
        b = CompletionLogProbs(model)(expand_prompts(prompts, prompt_index), plain_ids, plain_mask)
    assert torch.allclose(a, b, atol=1e-5)


def test_shared_prefill_generation_under_lora(setup):
    """PEFT puts the Qwen-VL core (which holds the rope offsets) two wrappers deep; the shared prefill must
    still select its offsets per completion, and sample what the plain prefill samples. (No top-k/top-p here: on
    a random tiny model's near-uniform logits, float noise between batch shapes moves the nucleus boundary.)"""
    from peft import LoraConfig, get_peft_model

    model, prompts, prompt_index, _, _, _ = setup
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    try:
        eos = model.generation_config.eos_token_id
        kw = dict(row_seeds=completion_seeds(0, 0, range(6)), max_new_tokens=8, temperature=1.0,
                  eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else [eos], pad_token_id=0)
        plain = generate_completions(lora, expand_prompts(prompts, prompt_index), **kw)
        shared = generate_completions(lora, prompts, prompt_index=prompt_index, **kw)
        assert torch.equal(shared[0], plain[0]) and torch.equal(shared[1], plain[1])
    finally:
        lora.unload()


def test_the_checkpoints_generation_config_does_not_reshape_the_rollout(setup):
    """`generate` fills what the rollout leaves unset from generation_config.json: a checkpoint's repetition
    penalty (Qwen2.5-VL-Instruct ships 1.05) would reshape the sampled distribution, off-policy to the log-probs.
    The rollout samples the same tokens whatever the checkpoint asks; what it cannot switch off is refused."""
    from utils.core.errors import InputError

    model, prompts, prompt_index, ids, mask, _ = setup
    full = expand_prompts(prompts, prompt_index)
    eos = model.generation_config.eos_token_id
    kwargs = dict(row_seeds=completion_seeds(0, 0, range(6)), max_new_tokens=7, temperature=1.0,
                  eos_token_id=list(eos) if isinstance(eos, (list, tuple)) else [eos], pad_token_id=0)
    saved = model.generation_config
    try:
        model.generation_config = saved.__class__(**saved.to_dict())
        model.generation_config.repetition_penalty = 50.0
        model.generation_config.no_repeat_ngram_size = 1
        model.generation_config.min_new_tokens = 7
        model.generation_config.min_length = 40
        reshaped_ids, reshaped_mask = generate_completions(model, full, **kwargs)
        model.generation_config = saved.__class__(**saved.to_dict())
        plain_ids, plain_mask = generate_completions(model, full, **kwargs)
        assert torch.equal(reshaped_ids, plain_ids) and torch.equal(reshaped_mask, plain_mask)
        model.generation_config.bad_words_ids = [[5]]
        with pytest.raises(InputError, match="generation_config.json sets bad_words_ids"):
            generate_completions(model, full, **kwargs)
    finally:
        model.generation_config = saved
