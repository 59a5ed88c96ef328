"""Gemma 4's KV-sharing layers (the small checkpoints' last layers reuse an earlier layer's keys and values instead
of their own) under the shared prompt pass: the completions read the producer layer's cache-extended keys, so their
log-probs still equal a plain forward over each completion's own copy of its prompt."""

import copy

import pytest
import torch

from tests.family_helpers import completions, group_batches, plain_logprobs
from utils.core.logprobs import CompletionLogProbs, can_share_prompts

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def test_kv_sharing_layers_share_the_prompt_pass(family_models):
    from transformers import Gemma4ForConditionalGeneration

    tiny, processor = family_models("gemma4")
    config = copy.deepcopy(tiny.config)
    text = config.text_config
    text.num_hidden_layers, text.num_kv_shared_layers = 4, 2
    text.layer_types = ["sliding_attention", "full_attention"] * 2
    if hasattr(text, "kv_sharing_modes"):  # the config names the modes from transformers 5.2x on (not in 5.20)
        assert text.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).eval()
    prompts, repeated, index = group_batches(processor, "gemma4")
    completion, mask = completions(processor.tokenizer, 4)
    assert can_share_prompts(model, [1, 1])
    with torch.no_grad():
        shared = CompletionLogProbs(model)(prompts, completion, mask, prompt_index=torch.tensor(index))
    torch.testing.assert_close(shared * mask, plain_logprobs(model, repeated, completion, mask), atol=2e-5, rtol=1e-4)
