"""TR-DPO's reference updates (utils.core.ref_sync, --sync_ref_model): ref <- alpha * policy + (1 - alpha) * ref every
--ref_model_sync_steps optimizer steps, for a reference of its own and for a LoRA run's adapter-free base (which
gets adapters of its own); the mixed weights survive a checkpoint round trip."""

import types

import pytest
import torch
from accelerate.utils import DistributedType

from tests.test_lora_reference import _Policy  # CompletionLogProbs' shape: `.model` is the HF model
from utils.core.logprobs import AdapterDisabledReference
from utils.core.ref_sync import ReferenceSync

ACCELERATOR = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=None), process_index=0,
                                    distributed_type=DistributedType.NO, unwrap_model=lambda m: m)
IDS = torch.tensor([[3, 5, 7, 11, 13]])


def _llm(tmp_path, name="llm"):
    from transformers import AutoModelForCausalLM

    from tiny.models import make_tiny_llm

    return AutoModelForCausalLM.from_pretrained(make_tiny_llm(str(tmp_path / name), hidden_size=32, seed=0))


def _nudge(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)


def test_a_reference_of_its_own_moves_toward_the_policy_every_sync_steps(tmp_path):
    policy, reference = _Policy(_llm(tmp_path)), _Policy(_llm(tmp_path))
    reference.requires_grad_(False)
    _nudge(policy, 0)
    sync = ReferenceSync(ACCELERATOR, policy, reference, alpha=0.6, sync_steps=4)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    assert not sync.after_step(3) and not sync.state_tensors()
    assert all(torch.equal(before[n], p) for n, p in reference.named_parameters())
    assert sync.after_step(4)
    for name, p in reference.named_parameters():
        expected = 0.4 * before[name] + 0.6 * dict(policy.named_parameters())[name]
        torch.testing.assert_close(p, expected, rtol=0, atol=1e-7)
    # a checkpoint round trip into a fresh reference restores the mixed weights exactly
    fresh = _Policy(_llm(tmp_path))
    restored = ReferenceSync(ACCELERATOR, policy, fresh, alpha=0.6, sync_steps=4)
    restored.load_state_tensors({k: v.clone() for k, v in sync.state_tensors().items()})
    assert all(torch.equal(p, dict(reference.named_parameters())[n]) for n, p in fresh.named_parameters())


@pytest.fixture
def lora_policy(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llm(tmp_path), LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                      task_type="CAUSAL_LM", lora_dropout=0.0))
    return _Policy(model)


def test_lora_reference_is_the_base_until_it_syncs_then_gets_adapters_of_its_own(lora_policy):
    policy = lora_policy
    initial = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}
    reference = AdapterDisabledReference(policy, ACCELERATOR)
    sync = ReferenceSync(ACCELERATOR, policy, reference, alpha=1.0, sync_steps=2)
    with torch.no_grad():
        base = reference(IDS)
    _nudge(policy, 1)  # training moved the adapters (B off zero)
    with torch.no_grad():
        trained = policy(IDS)
        assert not torch.allclose(trained, base)
        torch.testing.assert_close(reference(IDS), base, rtol=0, atol=0)  # not synced: the base
        assert sync.after_step(2)  # alpha 1: the reference becomes the policy
        torch.testing.assert_close(reference(IDS), trained, rtol=0, atol=0)
        torch.testing.assert_close(policy(IDS), trained, rtol=0, atol=0)  # the policy's adapters came back
    _nudge(policy, 2)
    with torch.no_grad():
        torch.testing.assert_close(reference(IDS), trained, rtol=0, atol=0)  # unchanged until the next sync
    # alpha 0.5 from the start: the reference's matrices are the mean of the initial and current ones
    half = ReferenceSync(ACCELERATOR, policy, AdapterDisabledReference(policy, ACCELERATOR), alpha=0.5,
                         sync_steps=1)
    half.adapters = {k: v.clone() for k, v in initial.items()}
    half.after_step(1)
    for name, p in policy.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(half.adapters[name], 0.5 * initial[name] + 0.5 * p.detach())
    assert {k[len("adapter."):] for k in half.state_tensors()} == set(initial)
