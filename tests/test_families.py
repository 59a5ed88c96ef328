"""Every tiny model family (tiny/models.py), built once per session from its own config and processor classes:
its image tokens, SFT's assistant-only labels under its chat template, and completion log-probs (unshared and,
where `can_share_prompts` allows, through the shared prompt pass) equal to a plain forward of the model."""

import pytest
import torch

from tests.family_helpers import TEXT_FAMILIES, VLM_FAMILIES, completions, group_batches, image, plain_logprobs, user
from utils.core.encoding import encode_prompts, image_tokens_per_image
from utils.core.logprobs import CompletionLogProbs, can_share_prompts, expand_prompts
from utils.core.models import image_token_id, load_model_and_processor
from utils.core.sft_data import IGNORE_INDEX, encode_sft_batch

pytestmark = pytest.mark.usefixtures("two_torch_threads")

# The families whose group of completions shares one prompt pass (the rest pay their prompt once per completion).
SHARED = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "gemma4", "glm4v", "smolvlm", "llava_onevision", "qwen3"}


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_image_token_is_the_one_the_model_counts(family_models, family):
    model, processor = family_models(family)
    assert image_token_id(processor) == image_token_id(model.config)
    batch = encode_prompts(processor, [[user("What colour?", True)]], [[image()]], sample_ids=["a"])
    need = image_tokens_per_image(processor, image())
    assert int((batch["input_ids"] == image_token_id(model.config)).sum()) == need > 0


@pytest.mark.parametrize("family", VLM_FAMILIES + TEXT_FAMILIES)
def test_sft_labels_are_exactly_the_assistant_turns(family_models, family):
    model, processor = family_models(family)
    with_image = family not in TEXT_FAMILIES
    messages = [user("What colour is the circle?", with_image),
                {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]},
                user("And the square?", False),
                {"role": "assistant", "content": [{"type": "text", "text": "blue"}]}]
    images = [image()] if with_image else []
    batch = encode_sft_batch(processor, [messages, messages[:2]], [images, images], sample_ids=["two", "one"])
    tokenizer = getattr(processor, "tokenizer", processor)
    end_of_turn = {"gemma3": "<end_of_turn>", "gemma4": "<turn|>", "smolvlm": "<end_of_utterance>",
                   "glm4v": "<|endoftext|>"}.get(family, "<|im_end|>")
    for row, answers in enumerate([["It is red.", "blue"], ["It is red."]]):
        labels = batch["labels"][row]
        keep = labels != IGNORE_INDEX
        assert (labels[keep] == batch["input_ids"][row][keep]).all()
        runs, run = [], []
        for pos in range(len(labels)):
            if keep[pos]:
                run.append(int(labels[pos]))
            elif run:
                runs.append(run)
                run = []
        runs += [run] if run else []
        # each labelled run is one assistant turn, its end-of-turn token included, nothing of the prompt
        assert [tokenizer.decode(r).strip() for r in runs] == [a + end_of_turn for a in answers], family


@pytest.mark.parametrize("family", VLM_FAMILIES + TEXT_FAMILIES)
def test_completion_logprobs_equal_a_plain_forward(family_models, family):
    model, processor = family_models(family)
    with_image = family not in TEXT_FAMILIES
    # the unshared path: each completion's prompt encoded on its own row, as train_grpo does for such families
    prompts, repeated, index = group_batches(processor, family)
    tokenizer = getattr(processor, "tokenizer", processor)
    completion, mask = completions(tokenizer, 4)
    expected = plain_logprobs(model, repeated, completion, mask)
    wrapped = CompletionLogProbs(model)
    with torch.no_grad():
        unshared = wrapped(repeated, completion, mask)
    torch.testing.assert_close(unshared * mask, expected, atol=2e-5, rtol=1e-4)
    shares = can_share_prompts(model, [1 if with_image else 0] * 2)
    assert shares == (family in SHARED), family  # the support table's "shared prompt pass" column
    if shares:
        with torch.no_grad():
            shared = wrapped(prompts, completion, mask, prompt_index=torch.tensor(index))
            expanded = wrapped(expand_prompts(prompts, index), completion, mask)  # the activation-checkpointing path
        torch.testing.assert_close(shared * mask, expected, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(expanded * mask, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(SHARED))
def test_shared_prefill_generation_samples_what_repeated_prompts_sample(family_models, family):
    """Generation with a group's prompt prefilled once (its cache index-selected to the completions) samples the
    same tokens as generation from each completion's own copy of the prompt."""
    from utils.core.rollout import generate_completions, stop_token_ids
    from utils.core.seeds import completion_seeds

    model, processor = family_models(family)
    prompts, repeated, index = group_batches(processor, family)
    tokenizer = getattr(processor, "tokenizer", processor)
    args = dict(row_seeds=completion_seeds(0, 0, range(4)), max_new_tokens=6, temperature=1.0,
                eos_token_id=stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id)
    alone, alone_mask = generate_completions(model, repeated, **args)
    shared, shared_mask = generate_completions(model, prompts, prompt_index=torch.tensor(index), **args)
    assert torch.equal(alone * alone_mask, shared * shared_mask)


@pytest.mark.parametrize("family", sorted(SHARED))
def test_shared_prefill_continues_at_each_rows_own_positions(family_models, family):
    """The next-token scores after a shared prefill equal those of generation from repeated prompts, left-padded rows
    included (generate places a continuation after the row's own tokens, so the prefill must too): sampled tokens
    alone can hide a shifted position in a tiny random model."""
    from transformers import GenerationConfig

    from utils.core.rollout import _shared_prefill, cache_kwargs

    model, processor = family_models(family)
    prompts, repeated, index = group_batches(processor, family)
    assert (repeated["attention_mask"] == 0).any()  # some rows are left-padded
    config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, temperature=None, top_k=None,
                              top_p=None, pad_token_id=getattr(processor, "tokenizer", processor).pad_token_id)
    args = dict(generation_config=config, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        alone = model.generate(**repeated, **args).scores
        batch, cache = _shared_prefill(model, prompts, torch.tensor(index))
        shared = model.generate(**batch, **cache_kwargs(model, cache), **args).scores
    for a, b in zip(alone, shared, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)



def test_a_family_whose_processor_cannot_run_is_refused_in_one_line(family_models, tmp_path, monkeypatch):
    """SmolVLM2's SmolVLMProcessor needs num2words (not in requirements.txt): the load fails naming the family and
    the package, before any weights are read."""
    import transformers

    from utils.core.models import ModelLoadError

    model, processor = family_models("smolvlm")
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)

    def needs_num2words(*args, **kwargs):
        raise ImportError("Package `num2words` is required to run SmolVLM processor. Install it with `pip install "
                          "num2words`.\nmore")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", needs_num2words)
    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded before the processor was refused"))
    with pytest.raises(ModelLoadError, match=r"\(idefics3\): its processor needs a package .*`num2words` is required"):
        load_model_and_processor(str(tmp_path))
