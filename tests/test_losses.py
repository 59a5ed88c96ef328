"""The GRPO loss variants against hand-computed examples (docs/grpo.md)."""

import math

import pytest
import torch

from utils.core.losses import clipped_policy_loss, k3_kl

# Two sequences: the first has 2 real tokens (one padding), the second 3.
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([1.0, -0.5])


def on_policy(**kw):
    logps = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]]))
    return clipped_policy_loss(logps, logps.detach(), ADV, MASK, **kw)


def test_grpo_averages_tokens_then_sequences():
    # ratio 1 everywhere: per-token loss = -A. seq 1: -1 (2 tokens), seq 2: +0.5 (3 tokens).
    loss, _ = on_policy(loss_type="grpo")
    assert loss.item() == pytest.approx((-1.0 + 0.5) / 2)


def test_bnpo_averages_over_all_tokens():
    loss, _ = on_policy(loss_type="bnpo")
    assert loss.item() == pytest.approx((2 * -1.0 + 3 * 0.5) / 5)


def test_dr_grpo_divides_by_batch_times_max_length():
    loss, _ = on_policy(loss_type="dr_grpo", max_completion_length=4)
    assert loss.item() == pytest.approx((2 * -1.0 + 3 * 0.5) / (2 * 4))


def test_dapo_divides_by_global_tokens_per_process():
    # 10 tokens in the global batch over 2 processes: each process divides its sum by 5.
    loss, _ = on_policy(loss_type="dapo", num_items_in_batch=torch.tensor(10.0), num_processes=2)
    assert loss.item() == pytest.approx((2 * -1.0 + 3 * 0.5) / 5)


def test_clipping_with_asymmetric_epsilons():
    old = torch.zeros(2, 1)
    logps = torch.log(torch.tensor([[1.5], [0.5]]))
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 1)
    # seq 1: ratio 1.5, A=+1 -> min(1.5, 1.28) = 1.28; seq 2: ratio 0.5, A=-1 -> min(-0.5, -0.8) = -0.8
    loss, stats = clipped_policy_loss(logps, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28, loss_type="grpo")
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2)
    assert stats["clip_ratio"].item() == pytest.approx(1.0)
    # Inside the trust region nothing is clipped and the gradient flows.
    logps_in = torch.log(torch.tensor([[1.1], [0.9]])).requires_grad_()
    loss_in, stats_in = clipped_policy_loss(logps_in, old, adv, mask, epsilon_low=0.2, loss_type="grpo")
    assert loss_in.item() == pytest.approx((-1.1 + 0.9) / 2)
    assert stats_in["clip_ratio"].item() == 0.0
    loss_in.backward()
    # d/dlogp of -rho*A/2 = -rho*A/2
    assert logps_in.grad.flatten().tolist() == pytest.approx([-1.1 / 2, 0.9 / 2])


def test_clipped_tokens_get_no_gradient():
    logps = torch.log(torch.tensor([[1.5]])).requires_grad_()
    loss, _ = clipped_policy_loss(logps, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), epsilon_low=0.2)
    loss.backward()
    assert logps.grad.item() == 0.0


def test_k3_kl_and_beta():
    logps = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    expected_kl = 0.5 - math.log(0.5) - 1  # exp(ref - logp) - (ref - logp) - 1
    assert k3_kl(logps, ref).item() == pytest.approx(expected_kl)
    loss, stats = clipped_policy_loss(logps, logps, torch.tensor([2.0]), torch.ones(1, 1), beta=0.1, ref_logps=ref)
    assert loss.item() == pytest.approx(-2.0 + 0.1 * expected_kl)
    assert stats["kl"].item() == pytest.approx(expected_kl)
    assert k3_kl(logps, logps).item() == 0.0


def test_sequence_level_importance_sampling_uses_mean_log_ratio():
    # GSPO: rho = exp(mean over real tokens of log-ratio), shared by every token of the sequence.
    old = torch.zeros(1, 3)
    logps = torch.tensor([[0.1, 0.3, 5.0]])  # third token is padding and must not count
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = clipped_policy_loss(logps, old, torch.tensor([1.0]), mask, epsilon_low=0.5,
                                  importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(-math.exp(0.2))
    token_loss, _ = clipped_policy_loss(logps, old, torch.tensor([1.0]), mask, epsilon_low=0.5)
    assert token_loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(0.3)) / 2)


def test_bad_loss_type_names_the_flag():
    with pytest.raises(ValueError, match="--loss_type"):
        on_policy(loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        on_policy(loss_type="dr_grpo")


def test_importance_weights_scale_the_surrogate_not_the_kl():
    # on-policy (rho = 1): per-token loss = -w * A + beta * k3, mean over the 5 real tokens (bnpo)
    logps = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.4, 0.3, 0.5], [0.2, 0.1, 0.3]]))
    w = torch.tensor([[0.5, 2.0, 7.0], [1.0, 0.0, 4.0]], requires_grad=True)
    beta = 0.3
    loss, stats = clipped_policy_loss(logps, logps.detach(), ADV, MASK, beta=beta, ref_logps=ref, loss_type="bnpo",
                                      is_weights=w)
    kl = k3_kl(logps.detach(), ref)
    per_token = -w.detach() * ADV[:, None] + beta * kl
    assert loss.item() == pytest.approx(((per_token * MASK).sum() / 5).item())
    unweighted, plain_stats = clipped_policy_loss(logps, logps.detach(), ADV, MASK, beta=beta, ref_logps=ref,
                                                  loss_type="bnpo")
    assert unweighted.item() != pytest.approx(loss.item())
    assert stats["kl"].item() == pytest.approx(plain_stats["kl"].item())  # the KL term is not weighted
    # gradient: d/dlogp of -w rho A is -w A (rho = 1); of beta k3 is beta (1 - exp(ref - logp))
    loss.backward()
    want = (-w.detach() * ADV[:, None] + beta * (1 - torch.exp(ref - logps.detach()))) * MASK / 5
    assert torch.allclose(logps.grad, want, atol=1e-6)
    assert w.grad is None  # the weights are constants of the loss
    # one weight per sequence ([B, 1], the sequence_* modes) scales each sequence's surrogate
    seq, _ = clipped_policy_loss(logps.detach(), logps.detach(), ADV, MASK, loss_type="grpo",
                                 is_weights=torch.tensor([[2.0], [0.5]]))
    assert seq.item() == pytest.approx((2.0 * -1.0 + 0.5 * 0.5) / 2)


def test_kl_bias_correction_moves_the_gradient_not_the_loss():
    """TRL's use_bias_correction_kl: the k3 term times rho. On-policy rho is 1, so the loss is the same, and the
    gradient of beta * k3 * rho with respect to logp is beta * (1 - exp(ref - logp) + k3), not beta * (1 - exp(..))."""
    ref = torch.log(torch.tensor([[0.25, 0.4]]))
    beta, adv, mask = 0.1, torch.zeros(1), torch.ones(1, 2)  # no surrogate gradient: only the KL's
    grads, losses = [], []
    for corrected in (False, True):
        logps = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_()
        loss, _ = clipped_policy_loss(logps, logps.detach(), adv, mask, beta=beta, ref_logps=ref, loss_type="dapo",
                                      kl_bias_correction=corrected)
        loss.backward()
        grads.append(logps.grad.clone())
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1])
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    plain = beta * (1 - torch.exp(ref - logp)) / 2  # dapo: / tokens
    torch.testing.assert_close(grads[0], plain)
    torch.testing.assert_close(grads[1], plain + beta * k3_kl(logp, ref) / 2)
