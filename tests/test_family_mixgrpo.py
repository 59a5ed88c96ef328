"""train_mixgrpo.py's policy on every tiny VLM family, in process: its two text rollouts (`text_rollout`) as the
script runs them, the reason stage's text-only prompt and the reflect stage's prompt with the image it drew, each
completion's behaviour log-probs equal to a plain forward of the family's model, the reflect prompt holding the
image's tokens as the family's processor counts them. The families that cannot be the policy are refused in one
line, before anything loads (`check_policy`)."""

import json
import types

import pytest
import torch

import train_mixgrpo as tm
from tests.family_helpers import TEXT_FAMILIES, VLM_FAMILIES, image, plain_logprobs
from utils.core.config import ConfigError
from utils.core.encoding import image_tokens_per_image
from utils.core.logprobs import CompletionLogProbs
from utils.core.models import image_token_id
from utils.core.rollout import special_token_ids_to_suppress, stop_token_ids
from utils.t2i.mixgrpo_model import check_policy
from utils.t2i.r3_format import REASON_PROMPT, REFLECT_PROMPT, user_message

pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_policy_reasons_and_reflects(family_models, family):
    model, processor = family_models(family)
    tokenizer = processor.tokenizer
    stop_ids = stop_token_ids(model, tokenizer)
    cfg = types.SimpleNamespace(max_prompt_length=None, seed=0, temperature=1.0)
    common = dict(policy=CompletionLogProbs(model), processor=processor,
                  accelerator=types.SimpleNamespace(device=torch.device("cpu")), stop_ids=stop_ids,
                  suppress_ids=special_token_ids_to_suppress(tokenizer, stop_ids))
    prompts = ["a photo of a red circle", "two blue squares"]
    drawn = [image((200, 30, 30), (64, 64)), image((20, 20, 200), (64, 64))]
    reason = tm.text_rollout(cfg, 0, [0, 1], [user_message(REASON_PROMPT.format(prompt=p)) for p in prompts],
                             [[], []], 6, sample_ids=prompts, **common)
    reflect = tm.text_rollout(cfg, 1, [0, 1], [user_message(REFLECT_PROMPT.format(prompt=p), True) for p in prompts],
                              [[im] for im in drawn], 6, sample_ids=prompts, **common)
    image_id = image_token_id(model.config)
    for roll, images in ((reason, 0), (reflect, 1)):
        assert roll["mask"].sum() > 0
        expected = plain_logprobs(model, roll["batch"], roll["ids"], roll["mask"])
        torch.testing.assert_close(roll["old_logps"] * roll["mask"], expected, atol=2e-5, rtol=1e-4)
        tokens = (roll["batch"]["input_ids"] == image_id).sum(-1).tolist()
        assert tokens == [images * image_tokens_per_image(processor, im) for im in drawn]


def _generator_folder(tmp_path, encoder):
    """A generator folder as check_policy reads it: its text encoder's config."""
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text(json.dumps({"model_type": encoder}))
    return str(tmp_path)


@pytest.mark.parametrize("family", VLM_FAMILIES + TEXT_FAMILIES)
def test_policy_family_is_checked_against_the_conditioning(family_models, family, tmp_path):
    path = family_models(family)[0].name_or_path
    qwen_image = _generator_folder(tmp_path, "qwen2_5_vl")  # Qwen-Image's text encoder
    if family in TEXT_FAMILIES:
        for conditioning in ("generator", "base"):
            with pytest.raises(ConfigError, match=r"a text-only qwen3; Mix-GRPO's policy must be a VLM"):
                check_policy(tm.MixGRPOConfig(conditioning=conditioning), path, qwen_image)
        return
    check_policy(tm.MixGRPOConfig(conditioning="generator"), path, qwen_image)  # the generator's own encoder reads
    for conditioning in ("base", "policy"):
        if family == "qwen2_5_vl":
            check_policy(tm.MixGRPOConfig(conditioning=conditioning), path, qwen_image)
            continue
        model_type = json.load(open(f"{path}/config.json"))["model_type"]
        with pytest.raises(ConfigError, match=rf"--conditioning {conditioning}: .* in place of its qwen2_5_vl text "
                                              rf"encoder's .* is a {model_type}: use --conditioning generator"):
            check_policy(tm.MixGRPOConfig(conditioning=conditioning), path, qwen_image)
