"""LoRA on every tiny family, in process, through the scripts' own path (`utils.core.models.prepare_for_training` with
the scripts' --use_peft defaults): the policy's completion log-probs (through the shared prompt pass where the
family has it) equal a plain forward of the adapted model, the reference with the adapters off
(`AdapterDisabledReference`, as train_grpo builds it for --use_peft) equals the base model, and one optimizer step
moves the adapter weights and nothing else."""

import copy
import types

import pytest
import torch

from tests.family_helpers import TEXT_FAMILIES, VLM_FAMILIES, completions, group_batches, plain_logprobs
from utils.core.logprobs import AdapterDisabledReference, CompletionLogProbs, can_share_prompts
from utils.core.models import prepare_for_training

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def lora_model(base):
    """A LoRA copy of a family's session model (the session's model is left as it is), its B matrices moved off
    zero so that the adapters change the outputs."""
    cfg = types.SimpleNamespace(gradient_checkpointing=False, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                                lora_target_modules=["all-linear"], freeze_vision_tower=False)
    model = prepare_for_training(copy.deepcopy(base), cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


# The fast tier keeps one family per kind of prompt pass (3-D rope, bidirectional image blocks, tiles, text only);
# the full tier runs every family.
FAST = ("qwen2_5_vl", "gemma4", "internvl", "qwen3")


@pytest.mark.parametrize("family", [f if f in FAST else pytest.param(f, marks=[pytest.mark.slow, pytest.mark.full])
                                    for f in VLM_FAMILIES + TEXT_FAMILIES])
def test_lora_logprobs_reference_and_step(family_models, family):
    base, processor = family_models(family)
    model = lora_model(base)
    prompts, repeated, index = group_batches(processor, family)
    completion, mask = completions(getattr(processor, "tokenizer", processor), 4)
    share = can_share_prompts(model, [0 if family in TEXT_FAMILIES else 1] * 2)
    args = (prompts, completion, mask, 1.0, False, torch.tensor(index)) if share else (repeated, completion, mask)
    policy = CompletionLogProbs(model)
    reference = AdapterDisabledReference(policy, types.SimpleNamespace(unwrap_model=lambda m: m))

    adapted = plain_logprobs(model, repeated, completion, mask)
    original = plain_logprobs(base, repeated, completion, mask)
    assert (adapted - original).abs().max() > 1e-3  # the adapters change the log-probs
    with torch.no_grad():
        torch.testing.assert_close(reference(*args) * mask, original, atol=2e-5, rtol=1e-4)
    logps = policy(*args)  # the step's own forward
    torch.testing.assert_close(logps.detach() * mask, adapted, atol=2e-5, rtol=1e-4)

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    (-(logps * mask).sum() / mask.sum()).backward()
    optimizer.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= trainable, sorted(moved - trainable)[:3]
    # the language model's adapters all train (the tower's too where the prompt shows it an image)
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)
