"""The optimizer flags of the three training scripts (utils.core.optim, transformers' / TRL's names): --optim's torch
AdamW forms, --adam_beta1/2 and --adam_epsilon reaching the optimizer, other optimizers refused naming what they
need, and --warmup_steps as transformers reads it."""

import types

import pytest
import torch

import train_grpo
import train_mixgrpo
import train_sft
from utils.core.config import ConfigError, parse_config
from utils.core.optim import build_optimizer, check_optimizer_flags, num_warmup_steps

SCRIPTS = [(train_grpo.GRPOConfig, lambda c: train_grpo.validate(c, 1)), (train_sft.SFTConfig, train_sft.validate),
           (train_mixgrpo.MixGRPOConfig, lambda c: train_mixgrpo.validate(c, c.policy_group_size))]


def flags(**kw):
    base = dict(optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, warmup_steps=0,
                warmup_ratio=0.0, learning_rate=1e-2, weight_decay=0.1)
    return types.SimpleNamespace(**{**base, **kw})


def test_the_flags_reach_torch_adamw():
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = build_optimizer(params, flags(optim="adamw_torch_fused", adam_beta1=0.8, adam_beta2=0.9, adam_epsilon=1e-6))
    group = opt.param_groups[0]
    assert isinstance(opt, torch.optim.AdamW) and group["fused"] is True
    assert (group["betas"], group["eps"], group["weight_decay"], group["lr"]) == ((0.8, 0.9), 1e-6, 0.1, 1e-2)
    assert not build_optimizer(params, flags()).param_groups[0]["fused"]


def test_fused_and_foreach_adamw_take_the_same_steps_on_the_cpu():
    torch.manual_seed(0)
    start, grads = torch.randn(64), [torch.randn(64) for _ in range(5)]
    ends = []
    for form in ("adamw_torch", "adamw_torch_fused"):
        p = torch.nn.Parameter(start.clone())
        opt = build_optimizer([p], flags(optim=form))
        for g in grads:
            p.grad = g.clone()
            opt.step()
        ends.append(p.detach())
    assert not torch.equal(ends[0], start)
    torch.testing.assert_close(ends[0], ends[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("value, message", [
    (dict(optim="adamw_bnb_8bit"), "--optim adamw_bnb_8bit needs bitsandbytes"),
    (dict(optim="adamw_torch_8bit"), "--optim adamw_torch_8bit needs torchao"),
    (dict(optim="galore_adamw"), "needs galore-torch"),
    (dict(optim="sgd"), "--optim sgd is not an AdamW"),
    (dict(optim="adamw"), "--optim 'adamw' is not one of adamw_torch, adamw_torch_fused"),
    (dict(adam_beta2=1.0), "--adam_beta2 1.0 must be in"),
    (dict(adam_epsilon=0.0), "--adam_epsilon 0.0 must be > 0"),
    (dict(warmup_steps=-1), "--warmup_steps -1 must be >= 0"),
    (dict(warmup_steps=2.5), "a count of steps must be whole"),
    (dict(warmup_steps=10, warmup_ratio=0.1), "give one"),
])
def test_what_cannot_run_is_refused_naming_the_flag(value, message):
    with pytest.raises(ConfigError, match=message):
        check_optimizer_flags(flags(**value))


def test_warmup_steps_is_a_count_or_a_share():
    assert num_warmup_steps(flags(warmup_steps=7), 100) == 7
    assert num_warmup_steps(flags(warmup_steps=0.25), 10) == 3  # ceil, as transformers
    assert num_warmup_steps(flags(warmup_ratio=0.1), 100) == 10
    assert num_warmup_steps(types.SimpleNamespace(warmup_steps=0), 100) == 0  # a script without --warmup_ratio


@pytest.mark.parametrize("config, validate", SCRIPTS, ids=["grpo", "sft", "mixgrpo"])
def test_every_training_script_reads_and_checks_the_flags(config, validate):
    cfg = parse_config(config, ["--optim", "adamw_torch_fused", "--adam_beta1", "0.8", "--adam_epsilon", "1e-6",
                                "--warmup_steps", "3"])
    assert (cfg.optim, cfg.adam_beta1, cfg.adam_epsilon, cfg.warmup_steps) == ("adamw_torch_fused", 0.8, 1e-6, 3)
    validate(cfg)
    with pytest.raises(ConfigError, match="--optim adamw_8bit needs bitsandbytes"):
        validate(parse_config(config, ["--optim", "adamw_8bit"]))
