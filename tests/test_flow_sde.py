"""The flow SDE step: moments, closed-form log-prob, given samples, the sigma == 1 rule, per-sample sigmas, dtypes."""

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from utils.t2i.sde import image_kl, ode_step, sde_std_t, sde_step_from_std, sde_step_with_logprob


def _inputs(shape=(2, 4, 6), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _closed_form(v, x, sigma, sigma_next, a=0.7, sigma_max=None):
    s = sigma_max if sigma == 1 else sigma
    std_t = a * math.sqrt(sigma / (1 - s))
    dt = sigma_next - sigma
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_t * math.sqrt(-dt)


def test_mean_std_and_sample_moments():
    v, x = _inputs((2, 3))
    mean_ref, std_ref = _closed_form(v, x, 0.8, 0.6)
    _, _, mean, std = sde_step_with_logprob(v, x, 0.8, 0.6)
    assert torch.allclose(mean, mean_ref, atol=1e-6)
    assert std.shape == (2, 1) and torch.allclose(std, torch.full((2, 1), std_ref), atol=1e-7)
    draws = 20000
    xs, vs = x.repeat(draws, 1), v.repeat(draws, 1)
    prev, _, _, _ = sde_step_with_logprob(vs, xs, 0.8, 0.6, generator=torch.Generator().manual_seed(1))
    prev = prev.view(draws, 2, 3)
    assert torch.allclose(prev.mean(0), mean_ref, atol=4 * std_ref / math.sqrt(draws))
    assert torch.allclose(prev.std(0), torch.full((2, 3), std_ref), rtol=0.03)


def test_log_prob_is_the_gaussian_density_averaged():
    v, x = _inputs()
    prev, log_prob, mean, std = sde_step_with_logprob(v, x, 0.5, 0.25, noise_level=1.0,
                                                      generator=torch.Generator().manual_seed(0))
    ref = Normal(mean, std).log_prob(prev).mean(dim=(1, 2))
    assert log_prob.shape == (2,) and torch.allclose(log_prob, ref, atol=1e-5)


def test_given_prev_sample_is_not_resampled():
    v, x = _inputs()
    target = torch.randn_like(x)
    prev, log_prob, mean, std = sde_step_with_logprob(v, x, 0.5, 0.3, prev_sample=target)
    assert torch.equal(prev, target)
    assert torch.allclose(log_prob, Normal(mean, std).log_prob(target).mean(dim=(1, 2)), atol=1e-5)
    # the same log-prob as the draw it came from
    drawn, lp, _, _ = sde_step_with_logprob(v, x, 0.5, 0.3, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(sde_step_with_logprob(v, x, 0.5, 0.3, prev_sample=drawn)[1], lp, atol=0)


def test_sigma_one_needs_sigma_max():
    v, x = _inputs()
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step_with_logprob(v, x, 1.0, 0.8)
    _, _, mean, std = sde_step_with_logprob(v, x, 1.0, 0.8, sigma_max=0.8)
    mean_ref, std_ref = _closed_form(v, x, 1.0, 0.8, sigma_max=0.8)
    assert torch.allclose(mean, mean_ref, atol=1e-6) and torch.allclose(std, torch.full_like(std, std_ref))
    with pytest.raises(ValueError, match="smaller"):
        sde_step_with_logprob(v, x, 0.5, 0.5)


def test_per_sample_tensor_sigmas_equal_one_by_one():
    v, x = _inputs((3, 5))
    sigma, sigma_next = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([0.9, 0.5, 0.0])
    target = torch.randn_like(x)
    _, log_prob, mean, std = sde_step_with_logprob(v, x, sigma, sigma_next, sigma_max=0.9, prev_sample=target)
    for i in range(3):
        _, lp, m, s = sde_step_with_logprob(v[i:i + 1], x[i:i + 1], float(sigma[i]), float(sigma_next[i]),
                                            sigma_max=0.9, prev_sample=target[i:i + 1])
        assert torch.allclose(log_prob[i:i + 1], lp, atol=1e-6) and torch.allclose(mean[i:i + 1], m, atol=1e-6)
        assert torch.allclose(std[i], s[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_computed_in_fp32(dtype):
    v, x = _inputs(dtype=dtype)
    target = torch.randn(x.shape).to(dtype)
    prev, log_prob, mean, std = sde_step_with_logprob(v, x, 0.6, 0.4, prev_sample=target)
    ref = sde_step_with_logprob(v.float(), x.float(), 0.6, 0.4, prev_sample=target.float())
    assert prev.dtype == log_prob.dtype == mean.dtype == std.dtype == torch.float32
    for got, want in zip((prev, log_prob, mean, std), ref):
        assert torch.equal(got, want)
    assert ode_step(v, x, 0.6, 0.4).dtype == torch.float32


def test_per_sample_generators_do_not_depend_on_the_batch():
    v, x = _inputs((2, 8))
    both = sde_step_with_logprob(v, x, 0.5, 0.2, generator=[torch.Generator().manual_seed(s) for s in (1, 2)])[0]
    second = sde_step_with_logprob(v[1:], x[1:], 0.5, 0.2, generator=[torch.Generator().manual_seed(2)])[0]
    assert torch.equal(both[1:], second)


def test_ode_step_and_r3_cap_and_kl():
    v, x = _inputs()
    assert torch.allclose(ode_step(v, x, 0.75, 0.5), x - 0.25 * v)
    assert torch.allclose(ode_step(v, x, torch.tensor([0.75, 0.5]), torch.tensor([0.5, 0.0])),
                          x + v * torch.tensor([-0.25, -0.5]).view(2, 1, 1))
    std_t = sde_std_t(torch.tensor([1.0, 0.97, 0.5]), noise_level=1.0, noise_cap="r3")
    assert torch.allclose(std_t, torch.tensor([(1 / 0.05) ** 0.5, (0.97 / 0.05) ** 0.5, 1.0]))
    # sde_step_from_std with flow_grpo's std_t is the contract function
    a = sde_step_from_std(v, x, 0.5, 0.3, sde_std_t(0.5), prev_sample=x)
    b = sde_step_with_logprob(v, x, 0.5, 0.3, prev_sample=x)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    with pytest.raises(ValueError, match="noise_cap"):
        sde_std_t(0.5, noise_cap="nope")
    m1, m2 = _inputs(seed=5)
    std = torch.tensor([0.3, 0.7])
    ref = kl_divergence(Normal(m1, std.view(2, 1, 1)), Normal(m2, std.view(2, 1, 1))).mean(dim=(1, 2))
    assert torch.allclose(image_kl(m1, m2, std), ref, atol=1e-6)
    assert torch.allclose(image_kl(m1, m2, std.view(2, 1, 1)), ref, atol=1e-6)
