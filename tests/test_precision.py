"""utils/core/precision.py: the lost-update estimate against real optimizer steps, and the check's verdicts."""

import pytest
import torch

from utils.core.precision import check_update_precision, lost_step_fraction


def weights(dtype, scale=0.02, seed=0, shape=(256, 64)):
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter((torch.randn(*shape, generator=gen) * scale).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lr", [1e-6, 1e-5, 1e-4, 1e-3])
def test_estimate_matches_what_adamw_really_loses(dtype, lr):
    p = weights(dtype)
    predicted, count = lost_step_fraction([p], lr)
    assert count == p.numel()
    before = p.detach().clone()
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    opt.step()  # the first Adam step is lr * sign(grad) (up to eps): exactly a step of size lr
    unchanged = (p.detach() == before).float().mean().item()
    assert abs(unchanged - predicted) < 0.03, (lr, predicted, unchanged)


def test_fp32_weights_lose_nothing():
    assert lost_step_fraction([weights(torch.float32)], 1e-9) == (0.0, 0)


def test_pure_bf16_at_small_lr_is_refused_with_the_fix():
    opt = torch.optim.AdamW([weights(torch.bfloat16)], lr=1e-6)
    with pytest.raises(ValueError, match=r"--dtype bfloat16 .* AdamW at learning rate 1e-06: .*9[0-9]%.*--bf16"):
        check_update_precision(opt)


@pytest.mark.parametrize("case", ["large_lr", "fp32", "master_weights", "frozen_bf16_base", "sgd"])
def test_set_ups_that_keep_their_updates_pass(case):
    params = [weights(torch.bfloat16)]
    lr, kwargs, cls = 1e-6, {}, torch.optim.AdamW
    if case == "large_lr":
        lr = 1e-2
    elif case == "fp32":
        params = [weights(torch.float32)]
    elif case == "master_weights":  # DeepSpeed keeps fp32 copies
        kwargs = {"master_weights": True}
    elif case == "frozen_bf16_base":  # LoRA: bf16 base frozen, fp32 adapters trained
        params[0].requires_grad_(False)
        params.append(weights(torch.float32, shape=(8, 64)))
    else:
        cls = torch.optim.SGD  # its step scales with the gradient: not judged
    check_update_precision(cls(params, lr=lr), **kwargs)


@pytest.mark.parametrize("zero_stage, mixed_precision, master", [
    (None, "bf16", False),  # no DeepSpeed: the optimizer steps the weights themselves
    (2, "no", True), (3, "bf16", True),  # ZeRO keeps fp32 partitions
    (0, "bf16", True), (0, "no", False),  # stage 0: only DeepSpeed's bf16 / fp16 optimizers keep fp32 copies
])
def test_deepspeed_master_weights(zero_stage, mixed_precision, master):
    from types import SimpleNamespace

    from utils.core.precision import deepspeed_master_weights

    plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), mixed_precision=mixed_precision)
    assert deepspeed_master_weights(accelerator) is master
