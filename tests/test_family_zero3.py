"""ZeRO-3 on every tiny family. In process (a 1-process gloo group, DeepSpeed's CPU accelerator): the family loads
sharded as under accelerate_configs/zero3.yaml (`zero3_init_flag`: from_pretrained inside zero.Init), every weight
is partitioned away from its module, the sharded log-probs (through the shared prompt pass where the family has it)
equal the unsharded model's plain forward, generation runs on the gathered weights (`zero3_gathered`), a ZeRO-3
step moves the policy, and the gathered 16-bit copy that checkpoints write saves under the family's own weight
names and loads back as the stepped policy.
Two-process ZeRO-3 launches of the scripts run on Qwen2.5-VL (test_train_grpo.py, test_sft.py, test_multinode.py):
every family takes the same ZeRO-3 code path, which this file shows per family."""

import copy
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.family_helpers import TEXT_FAMILIES, VLM_FAMILIES, completions, group_batches, plain_logprobs
from tests.launch_helpers import EXTENSIONS, free_port
from utils.core.logprobs import CompletionLogProbs, can_share_prompts

pytestmark = [pytest.mark.slow, pytest.mark.full]

ZERO3 = {"train_micro_batch_size_per_gpu": 4, "zero_allow_untested_optimizer": True,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                               "stage3_gather_16bit_weights_on_model_save": True}}


@pytest.fixture(scope="module")
def zero3_group():
    """A 1-process gloo group for DeepSpeed in this process (its CPU accelerator), removed afterwards."""
    env = dict(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", EXTENSIONS))
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
        ds_comm.cdb = None
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_sharded(path):
    """The family's folder loaded as zero3.yaml's zero3_init_flag loads it: parameters partitioned at creation."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    from utils.core.models import load_model_and_processor

    keep = HfDeepSpeedConfig(ZERO3)  # noqa: F841 (transformers holds it by weak reference while loading)
    try:
        return load_model_and_processor(path, dtype="float32")[0]
    finally:
        unset_hf_deepspeed_config()


@pytest.mark.parametrize("family", VLM_FAMILIES + TEXT_FAMILIES)
def test_family_under_zero3_matches_the_unsharded_model(zero3_group, family_models, family, tmp_path):
    import deepspeed

    from utils.core.models import load_model_and_processor
    from utils.core.rollout import generate_completions, stop_token_ids
    from utils.core.seeds import completion_seeds
    from utils.core.zero3 import zero3_gathered

    base, processor = family_models(family)
    path = base.name_or_path  # the family's folder, as the session built it
    prompts, repeated, index = group_batches(processor, family)
    tokenizer = getattr(processor, "tokenizer", processor)
    completion, mask = completions(tokenizer, 4)
    expected = plain_logprobs(base, repeated, completion, mask)
    gen = dict(row_seeds=completion_seeds(0, 0, range(4)), max_new_tokens=4, temperature=1.0,
               eos_token_id=stop_token_ids(base, tokenizer), pad_token_id=tokenizer.pad_token_id)
    expected_ids, expected_mask = generate_completions(base, repeated, **gen)

    policy = CompletionLogProbs(load_sharded(path))
    engine, *_ = deepspeed.initialize(model=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.1),
                                      config=copy.deepcopy(ZERO3))
    assert sum(p.numel() for p in engine.module.parameters()) == 0  # every weight partitioned away
    share = can_share_prompts(policy.model, [0 if family in TEXT_FAMILIES else 1] * 2)
    args = (prompts, completion, mask, 1.0, False, torch.tensor(index)) if share else (repeated, completion, mask)
    logps = engine(*args)
    torch.testing.assert_close(logps.detach() * mask, expected, atol=2e-5, rtol=1e-4)
    with zero3_gathered(engine) as module:
        ids, ids_mask = generate_completions(module.model, repeated, **gen)
    assert torch.equal(ids * ids_mask, expected_ids * expected_mask)
    engine.backward(-(logps * mask).sum() / mask.sum())
    engine.step()
    with torch.no_grad():
        after = engine(*args)
    assert (after - logps.detach()).abs().max() > 1e-3  # the step moved the policy

    # the checkpoint's HF copy: the gathered state dict, saved by the family's own save_pretrained
    state = {k.removeprefix("model."): v for k, v in engine._zero3_consolidated_16bit_state_dict().items()}
    policy.model.save_pretrained(str(tmp_path), state_dict=state)
    processor.save_pretrained(str(tmp_path))
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert names ^ set(load_file(os.path.join(path, "model.safetensors"))) <= {"lm_head.weight"}
    back = load_model_and_processor(str(tmp_path), dtype="float32")[0].eval()
    torch.testing.assert_close(plain_logprobs(back, repeated, completion, mask), after * mask, atol=2e-5, rtol=1e-4)

