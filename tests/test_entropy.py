"""The policy entropy: from the fused log-prob pass (values and gradients against the full softmax), the
high-entropy token mask and the entropy bonus against hand-computed losses (TRL's semantics), and its logging in
train_grpo.py (metrics.jsonl and TensorBoard) and train_mixgrpo.py."""

import math

import pytest
import torch

from kernels import fused_token_logprobs
from tests.test_mixgrpo import tiny  # noqa: F401  (the tiny Mix-GRPO policy and generator fixture)
from utils.core.losses import clipped_policy_loss, high_entropy_mask

ENTROPY = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.7, 0.2, 5.0, 5.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


@pytest.mark.parametrize("quantile, kept", [
    (1.0, [[1, 1, 1, 1], [1, 1, 0, 0]]),  # every completion token
    (0.5, [[0, 1, 1, 0], [1, 0, 0, 0]]),  # >= the median of the six masked values, (0.3 + 0.5) / 2
    (0.0, [[0, 1, 0, 0], [0, 0, 0, 0]]),  # the highest only (padding's 5.0 never counts)
])
def test_high_entropy_mask_keeps_the_top_quantile_of_masked_tokens(quantile, kept):
    assert high_entropy_mask(ENTROPY, MASK, quantile).int().tolist() == kept


def test_high_entropy_mask_takes_the_quantile_over_every_process():
    """Another process's entropies (gathered with -1 padding) move the threshold: with [0.8, 0.85] there the
    median of eight values is (0.5 + 0.7) / 2 = 0.6."""
    other = torch.tensor([0.8, 0.85, -1.0, -1.0])
    mask = high_entropy_mask(ENTROPY, MASK, 0.5, gather=lambda local: torch.cat([local, other]))
    assert mask.int().tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_entropy_mask_keeps_the_surrogate_on_kept_tokens_and_the_kl_on_all():
    """At ratio 1 the surrogate per token is -A; bnpo divides by all completion tokens (TRL's normaliser)."""
    logps = torch.log(torch.tensor([[0.5, 0.25, 0.5, 0.5], [0.5, 0.5, 1.0, 1.0]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.5, 0.5], [0.5, 0.25, 1.0, 1.0]]))
    adv = torch.tensor([2.0, -1.0])
    keep = high_entropy_mask(ENTROPY, MASK, 0.5)  # tokens (0, 1), (0, 2), (1, 0)
    loss, stats = clipped_policy_loss(logps, logps.detach(), adv, MASK, beta=0.1, ref_logps=ref, loss_type="bnpo",
                                      entropy_mask=keep, entropy=ENTROPY)
    k3 = lambda r: r - math.log(r) - 1  # noqa: E731  exp(ref - logp) - (ref - logp) - 1 with r = p_ref / p
    surrogate = (-2.0) * 2 + 1.0  # two kept tokens of row 0 (A = 2), one of row 1 (A = -1)
    kl = k3(0.5) + k3(0.5)  # (0, 0): 0.25 / 0.5; (1, 1): 0.25 / 0.5; the others have r = 1
    assert loss.item() == pytest.approx((surrogate + 0.1 * kl) / 6, abs=1e-6)
    loss.backward()
    # d/d logp: -A on kept tokens (rho' = rho = 1), plus beta * (1 - r) from k3, over the six tokens
    grad = torch.zeros(2, 4)
    grad[0, 1], grad[0, 2], grad[1, 0] = -2.0, -2.0, 1.0
    grad[0, 0] += 0.1 * (1 - 0.5)
    grad[1, 1] += 0.1 * (1 - 0.5)
    assert torch.allclose(logps.grad, grad * MASK / 6, atol=1e-6)
    assert stats["entropy"].item() == pytest.approx((0.1 + 0.9 + 0.5 + 0.3 + 0.7 + 0.2) / 6)
    assert stats["entropy_high_frac"].item() == pytest.approx(2 / 6)  # 0.9 and 0.7 exceed 0.672


@pytest.mark.parametrize("loss_type, steps, divisor", [("grpo", 1, 1), ("dapo", 2, 2), ("dr_grpo", 2, 1)])
def test_entropy_bonus_is_the_mean_entropy_of_trained_tokens(loss_type, steps, divisor):
    """loss = policy loss - coef * H, H the mean entropy over the trained tokens whatever the loss type; dapo's
    loss spans the step's micro-batches, so its H is divided by their number (accelerate divides the others)."""
    logps = torch.zeros(2, 4)
    entropy = ENTROPY.clone().requires_grad_()
    kw = dict(loss_type=loss_type, max_completion_length=4, num_items_in_batch=6, gradient_accumulation_steps=steps)
    base, _ = clipped_policy_loss(logps, logps, torch.tensor([1.0, -1.0]), MASK, **kw)
    loss, _ = clipped_policy_loss(logps, logps, torch.tensor([1.0, -1.0]), MASK, entropy=entropy, entropy_coef=0.05,
                                  **kw)
    h = (0.1 + 0.9 + 0.5 + 0.3 + 0.7 + 0.2) / 6
    assert (loss - base).item() == pytest.approx(-0.05 * h / divisor, abs=1e-7)
    loss.backward()
    assert torch.allclose(entropy.grad, -0.05 / 6 / divisor * MASK)
    keep = high_entropy_mask(ENTROPY, MASK, 0.5)
    masked, _ = clipped_policy_loss(logps, logps, torch.tensor([1.0, -1.0]), MASK, entropy=ENTROPY, entropy_coef=0.05,
                                    entropy_mask=keep, **kw)
    base_masked, _ = clipped_policy_loss(logps, logps, torch.tensor([1.0, -1.0]), MASK, entropy_mask=keep, **kw)
    assert (masked - base_masked).item() == pytest.approx(-0.05 * (0.9 + 0.5 + 0.7) / 3 / divisor, abs=1e-7)
    with pytest.raises(ValueError, match="entropy_coef != 0 needs the per-token entropy"):
        clipped_policy_loss(logps, logps, torch.tensor([1.0, -1.0]), MASK, entropy_coef=0.05, **kw)


@pytest.mark.parametrize("trainable_head", [True, False], ids=["trainable_head", "frozen_head"])
def test_fused_entropy_and_its_gradient_equal_the_full_softmax(trainable_head):
    """The entropy bonus's gradient flows through the fused kernel (both head cases: the frozen head's forward
    keeps the expected head row, which an entropy gradient must not take as the whole story)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 16, generator=gen).requires_grad_()
    weight = (torch.randn(40, 16, generator=gen) * 0.5).requires_grad_(trainable_head)
    labels = torch.randint(0, 40, (3, 5), generator=gen)
    labels[2, 3:] = -100
    up = torch.randn(3, 5, generator=gen, dtype=torch.float64)

    def grads(logp, ent):
        params = [p for p in (hidden, weight) if p.requires_grad]
        return torch.autograd.grad((logp * up).sum() - 0.3 * (ent * up.flip(0)).sum(), params)

    logp, ent = fused_token_logprobs(hidden, weight, labels, temperature=0.7, return_entropy=True, backend="torch")
    log_all = torch.log_softmax((hidden.double() @ weight.double().t()) / 0.7, -1)  # the float64 reference
    keep = labels != -100
    ref_logp = log_all.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * keep
    ref_ent = -(log_all.exp() * log_all).sum(-1) * keep
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)
    for got, want in zip(grads(logp.double(), ent.double()), grads(ref_logp, ref_ent)):
        assert torch.allclose(got.double(), want.double(), atol=1e-5)


# ---- the scripts ----


@pytest.mark.slow
def test_train_grpo_logs_entropy_and_trains_with_the_bonus_and_mask(tmp_path):
    """One packed GRPO step with --entropy_coef and --top_entropy_quantile: entropy and entropy_high_frac in
    metrics.jsonl and in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.test_train_grpo import config, run
    from tiny.models import make_tiny_vlm
    from tiny.shapes import make_shapes_vqa
    from utils.core.tracking import read_jsonl

    data = str(tmp_path / "shapes")
    make_shapes_vqa(8, seed=0, kinds=("color",)).save_to_disk(data)
    assets = {"qwen": make_tiny_vlm(str(tmp_path / "qwen"), seed=0), "data": data}
    run(config(assets, tmp_path / "out", max_steps=1, report_to="tensorboard", entropy_coef=0.01,
               top_entropy_quantile=0.5, padding_free=True, reward_funcs=["tests.grpo_helpers:completion_length"]))
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")[0]
    assert metrics["entropy"] > 0 and 0.0 <= metrics["entropy_high_frac"] <= 1.0
    # the tiny random policy is near uniform over its vocabulary: every token is above 0.672 nats
    assert metrics["entropy_high_frac"] == 1.0
    events = list((tmp_path / "out").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert {"entropy", "entropy_high_frac"} <= set(acc.Tags()["scalars"])


def test_bad_entropy_flags_fail_before_loading(tmp_path):
    from tests.test_train_grpo import config, run
    from utils.core.config import ConfigError

    assets = {"qwen": str(tmp_path / "missing"), "data": str(tmp_path / "missing")}
    with pytest.raises(ConfigError, match="--top_entropy_quantile 1.5 must be in"):
        run(config(assets, tmp_path, top_entropy_quantile=1.5))
    with pytest.raises(ConfigError, match="--use_pcgrad projects one surrogate per reward"):
        run(config(assets, tmp_path, use_pcgrad=True, entropy_coef=0.1,
                   reward_funcs=["tests.grpo_helpers:completion_length", "tests.grpo_helpers:negative_length"]))


def test_mixgrpo_text_loss_reports_the_policy_entropy(tiny):  # noqa: F811  (the fixture)
    """train_mixgrpo.py logs `<stage>/entropy_text` (and its high share) from the stats of its text loss."""
    from dataclasses import replace

    import train_mixgrpo as tm
    from tests.test_mixgrpo import rollout

    cfg = replace(tiny["cfg"], kl_weight_text=0.0)
    roll = rollout(tiny, cfg)
    adv = torch.linspace(-1, 1, 8)
    _, stats = tm.mixgrpo_loss(cfg, tm.MixGRPOModel(tiny["policy"], tiny["gen"]), roll, adv, adv, ref_logps=None,
                               ref_mean=None, text_tokens=roll["mask"].sum().float(), n_images=8, world=1)
    with torch.no_grad():
        _, entropy = tiny["policy"](roll["batch"], roll["ids"], roll["mask"], cfg.temperature, True)
    mask = roll["mask"].float()
    assert stats["entropy_text"].item() == pytest.approx(((entropy * mask).sum() / mask.sum()).item(), rel=1e-5)
    assert stats["entropy_text"] > 0 and 0 <= stats["entropy_high_frac_text"] <= 1
