"""LoRA and the frozen vision tower. --freeze_vision_tower with --use_peft freezes the tower's adapters too (all-linear
LoRA wraps it): train_grpo.py and train_sft.py trained them, only train_mixgrpo.py froze them.

The reference pass of a LoRA run (adapters off) leaves every adapter weight's requires_grad as it was. peft's
disable_adapter() turns the adapters back on with set_adapter(), which marks every adapter weight trainable: the
frozen vision tower's LoRA (--use_peft --freeze_vision_tower, every r3_* recipe) came back trainable after the first
KL pass, outside the optimizer, so ZeRO-3 saved it nowhere and the resume failed on it (a KeyError in DeepSpeed's
load_checkpoint), and under DDP its gradients were computed and never cleared."""

import types

import pytest
import torch
from torch import nn

import train_mixgrpo as tm
from utils.core.logprobs import AdapterDisabledReference


class _Policy(nn.Module):
    """The shape of CompletionLogProbs that the references use: `.model` is the peft model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


@pytest.fixture
def lora_llm(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tiny.models import make_tiny_llm

    base = AutoModelForCausalLM.from_pretrained(make_tiny_llm(str(tmp_path / "llm"), hidden_size=32, seed=0))
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    frozen = []
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.5)  # LoRA moved off B = 0: the reference really differs from the policy
        if "lora_" in name and ".layers.0." in name:  # one block's LoRA frozen, as the vision tower's is
            p.requires_grad_(False)
            frozen.append(name)
    assert frozen
    return model


def _trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _check_reference(model, reference_logits):
    ids = torch.tensor([[3, 5, 7, 11]])
    before = _trainable(model)
    with torch.no_grad():
        policy = model(input_ids=ids).logits
        got = reference_logits(ids)
    assert _trainable(model) == before  # the frozen LoRA is still frozen, the rest still trainable
    with torch.no_grad(), model.disable_adapter():  # (peft's own switch, last: it unfreezes the adapters)
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected)  # the adapters really were off
    assert not torch.allclose(got, policy)


def test_grpo_lora_reference_keeps_frozen_adapters_frozen(lora_llm):
    policy = _Policy(lora_llm)
    ref = AdapterDisabledReference(policy, types.SimpleNamespace(unwrap_model=lambda m: m))
    _check_reference(lora_llm, ref)


def test_mixgrpo_text_reference_keeps_frozen_adapters_frozen(lora_llm):
    gen = types.SimpleNamespace(transformer=nn.Linear(2, 2))
    mix = tm.MixGRPOModel(_Policy(lora_llm), gen)
    _check_reference(lora_llm, lambda ids: mix(text=(ids,), reference=True)["text"])


@pytest.mark.parametrize("projector", [False, True])
def test_freeze_vision_tower_with_lora_freezes_the_towers_adapters(projector):
    from tiny.cache import tiny_vlm_path
    from utils.core.models import load_model_and_processor, prepare_for_training

    model, _ = load_model_and_processor(tiny_vlm_path(), freeze_vision_tower=True)
    cfg = types.SimpleNamespace(gradient_checkpointing=False, use_peft=True, lora_r=2, lora_alpha=4, lora_dropout=0.0,
                                lora_target_modules=["all-linear"], freeze_vision_tower=True,
                                freeze_multi_modal_projector=projector)
    model = prepare_for_training(model, cfg)
    trainable = _trainable(model)
    assert any(".language_model." in n and "lora_" in n for n in trainable)  # the LM's LoRA trains
    tower = {n for n in trainable if ".visual." in n and ".merger." not in n}
    assert not tower, sorted(tower)[:3]
    merger = {n for n in trainable if ".visual.merger." in n}
    assert (not merger) if projector else merger  # the projector's LoRA trains unless it is frozen too
