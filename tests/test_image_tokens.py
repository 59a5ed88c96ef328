"""The image-token guard: a prompt whose image tokens are cut or repeated is refused with ImageTokenError (naming
the sample) in prompt encoding, the log-prob forward and SFT batches, never dropped silently."""

import pytest
import torch
from PIL import Image

from utils.core.encoding import check_features_match_tokens, check_image_tokens, encode_prompts, image_tokens_per_image
from utils.core.errors import ImageTokenError

pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from tiny.models import make_tiny_vlm
    from utils.core.models import load_model_and_processor

    path = make_tiny_vlm(str(tmp_path_factory.mktemp("guard") / "qwen"), seed=0)
    return load_model_and_processor(path, dtype="float32")


def _image(size=84):
    return Image.new("RGB", (size, size), (200, 30, 30))


def _messages(text="What colour is the circle?"):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_tokens_per_image_follow_the_image_size(qwen):
    _, processor = qwen
    assert image_tokens_per_image(processor, _image(84)) == 9  # 6x6 patches of 14 px, merged 2x2
    assert image_tokens_per_image(processor, _image(168)) == 36


def test_cut_or_repeated_image_tokens_are_refused_naming_the_sample(qwen):
    _, processor = qwen
    batch = encode_prompts(processor, [_messages(), _messages()], [[_image()], [_image()]], sample_ids=["a", "b"])
    ids = batch["input_ids"]
    check_image_tokens(processor, ids, [[_image()], [_image()]], ["a", "b"])  # as encoded: accepted
    image_id = processor.image_token_id
    cut = ids.clone()
    cut[1, (cut[1] == image_id).nonzero()[-1]] = processor.tokenizer.pad_token_id  # the last image token cut
    with pytest.raises(ImageTokenError, match=r"sample 'b': 8 image tokens where its 1 image\(s\) need 9.*cut"):
        check_image_tokens(processor, cut, [[_image()], [_image()]], ["a", "b"])
    with pytest.raises(ImageTokenError, match=r"sample 'a': 9 image tokens where its 0 image\(s\) need 0.*repeated"):
        check_image_tokens(processor, ids, [[], [_image()]], ["a", "b"])  # tokens of an image the row does not have


def test_a_prompt_that_spells_out_an_image_token_is_refused(qwen):
    """A literal <|image_pad|> typed in the text is a placeholder without an image: refused, naming the sample."""
    _, processor = qwen
    with pytest.raises(ValueError, match="sample 'typed'"):
        encode_prompts(processor, [_messages("What is <|image_pad|> here?")], [[_image()]], sample_ids=["typed"])


def test_logprob_forward_refuses_prompts_repeated_without_their_pixels(qwen):
    from utils.core.logprobs import CompletionLogProbs

    model, processor = qwen
    batch = encode_prompts(processor, [_messages()], [[_image()]], sample_ids=["a"])
    wrapped = CompletionLogProbs(model)
    completion = torch.tensor([[5, 6, 7]] * 2)
    mask = torch.ones_like(completion)
    # the prompt's ids repeated for two completions, its pixels not: 18 image tokens, 9 features
    repeated = {**batch, "input_ids": batch["input_ids"].repeat(2, 1),
                "attention_mask": batch["attention_mask"].repeat(2, 1)}
    with pytest.raises(ImageTokenError, match="18 image tokens for 9 image features"):
        wrapped(repeated, completion, mask)
    # through prompt_index the pixels follow the ids: accepted
    assert wrapped(batch, completion, mask, prompt_index=torch.tensor([0, 0])).shape == (2, 3)
    cut = {**batch, "input_ids": batch["input_ids"][:, 3:], "attention_mask": batch["attention_mask"][:, 3:]}
    assert (batch["input_ids"][:, :3] != processor.image_token_id).all()  # nothing of the image in the cut: ok
    check_features_match_tokens(model.config, cut)
    image_cols = (batch["input_ids"][0] == processor.image_token_id).nonzero().flatten()
    keep = torch.ones(batch["input_ids"].shape[1], dtype=torch.bool)
    keep[image_cols[:2]] = False
    cut = {**batch, "input_ids": batch["input_ids"][:, keep], "attention_mask": batch["attention_mask"][:, keep]}
    with pytest.raises(ImageTokenError, match="7 image tokens for 9 image features"):
        wrapped(cut, completion[:1], mask[:1])


def test_sft_refuses_a_max_length_cut_inside_an_assistant_image(qwen):
    """An image inside the last assistant turn (sharegpt `<image>` in an answer): a --max_length that falls in it
    used to keep the image's pixels with part of its tokens."""
    from utils.core.sft_data import encode_sft_batch, sharegpt_conversation

    _, processor = qwen
    row = {"messages": [{"role": "user", "content": "Draw the circle."},
                        {"role": "assistant", "content": "Here it is: <image> a red circle."}],
           "images": [_image()]}
    messages, images = sharegpt_conversation(row)
    full = encode_sft_batch(processor, [messages], [images], sample_ids=["draw"])
    image_cols = (full["input_ids"][0] == processor.image_token_id).nonzero().flatten().tolist()
    encode_sft_batch(processor, [messages], [images], sample_ids=["draw"], max_length=image_cols[-1] + 2)  # after it
    with pytest.raises(ImageTokenError, match=r"sample 'draw': 4 image tokens where its 1 image\(s\) need 9.*cut"):
        encode_sft_batch(processor, [messages], [images], sample_ids=["draw"], max_length=image_cols[0] + 4)
