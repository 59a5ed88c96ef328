"""The flow-matching SDE step with its Gaussian log-prob, the ODE step, and the image KL (Flow-GRPO / R3 / MixGRPO).

Time sigma runs from 1 (noise) to 0 (image); dt = sigma_next - sigma < 0; v is the predicted velocity.
The SDE step is the reverse-time SDE whose marginals match the ODE x' = x + v dt (Flow-GRPO), discretised
as one Gaussian transition, so its log-density is what GRPO's ratio needs:

    std_t = a * sqrt(sigma / (1 - sigma'))      a = noise_level; sigma' = sigma_max where sigma == 1, else sigma
    mean  = x * (1 + std_t^2 dt / (2 sigma)) + v * (1 + std_t^2 (1 - sigma) / (2 sigma)) dt
    x'    = mean + std_t sqrt(-dt) eps

Everything is computed in fp32 (fp64 stays fp64), whatever the dtype of the velocity and the sample.
"""

from __future__ import annotations

import math

import torch

NOISE_CAPS = ("flow_grpo", "r3")
R3_SIGMA_CAP = 0.95  # R3 caps sigma in std_t's denominator at every step, not only at sigma == 1


def _compute_dtype(*tensors):
    dtype = torch.float32
    for t in tensors:
        if torch.is_tensor(t) and t.dtype == torch.float64:
            dtype = torch.float64
    return dtype


def _per_sample(value, batch, like):
    """A float or a [B] tensor (or [B, 1, ...]) -> [B, 1, ..., 1] matching `like`'s rank."""
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if t.numel() == 1:
        t = t.reshape(1).expand(batch)
    elif t.numel() != batch:
        raise ValueError(f"expected a float or {batch} values (one per batch element), got shape {tuple(t.shape)}")
    return t.reshape(batch, *([1] * (like.ndim - 1)))


def sde_std_t(sigma, *, noise_level=0.7, sigma_max=None, noise_cap="flow_grpo"):
    """std_t of the SDE step for sigma (float or tensor), per noise rule (fp32 tensor shaped like sigma).

    noise_cap="flow_grpo": sigma' = sigma_max (the schedule's second sigma) where sigma == 1, else sigma.
    noise_cap="r3": sigma' = min(sigma, 0.95) at every step (R3's rule; sigma_max is not used).
    """
    sigma = torch.as_tensor(sigma)
    sigma = sigma.to(_compute_dtype(sigma))
    if noise_cap == "flow_grpo":
        at_one = sigma == 1
        denom_sigma = sigma
        if bool(at_one.any()):
            if sigma_max is None:
                raise ValueError("sde_step: sigma == 1 needs sigma_max (the schedule's second sigma) for std_t")
            sigma_max = torch.as_tensor(sigma_max, dtype=sigma.dtype, device=sigma.device)
            denom_sigma = torch.where(at_one, sigma_max, sigma)
    elif noise_cap == "r3":
        denom_sigma = sigma.clamp(max=R3_SIGMA_CAP)
    else:
        raise ValueError(f"noise_cap: unknown rule {noise_cap!r}; choose one of {NOISE_CAPS}")
    return noise_level * torch.sqrt(sigma / (1 - denom_sigma))


def randn_like_batch(shape, *, generator=None, device=None, dtype=torch.float32):
    """Standard normal noise; `generator` may be one torch.Generator or a list of one per batch element
    (as diffusers' randn_tensor takes), so a sample's noise does not depend on the rest of the batch."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
        return torch.cat([randn_like_batch((1, *shape[1:]), generator=g, device=device, dtype=dtype)
                          for g in generator])
    gen_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=gen_device, dtype=dtype).to(device)


def sde_step_from_std(velocity, sample, sigma, sigma_next, std_t, *, prev_sample=None, generator=None):
    """The SDE step for a given std_t (float or [B]); see `sde_step_with_logprob` for what it returns."""
    dtype = _compute_dtype(velocity, sample)
    v, x = velocity.to(dtype), sample.to(dtype)
    batch = x.shape[0]
    sig, sig_next = _per_sample(sigma, batch, x), _per_sample(sigma_next, batch, x)
    std_t = _per_sample(std_t, batch, x)
    dt = sig_next - sig
    if bool((dt >= 0).any()):
        raise ValueError("sde_step: sigma_next must be smaller than sigma (time runs from 1 to 0)")
    mean = x * (1 + std_t**2 / (2 * sig) * dt) + v * (1 + std_t**2 * (1 - sig) / (2 * sig)) * dt
    std = std_t * torch.sqrt(-dt)
    if prev_sample is None:
        prev_sample = mean + std * randn_like_batch(x.shape, generator=generator, device=x.device, dtype=dtype)
    else:
        prev_sample = prev_sample.to(dtype)
    # The sample is data for its own log-density: no gradient flows through it.
    target = prev_sample.detach()
    log_prob = -((target - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    log_prob = log_prob.mean(dim=tuple(range(1, x.ndim)))
    return prev_sample, log_prob, mean, std


def sde_step_with_logprob(velocity, sample, sigma, sigma_next, *, noise_level=0.7, sigma_max=None,
                          prev_sample=None, generator=None):
    """One SDE step x_sigma -> x_sigma_next and the Gaussian log-density of the result.

    velocity, sample: [B, ...]; sigma, sigma_next: floats or [B] tensors with sigma_next < sigma.
    Where sigma == 1, sigma_max (the schedule's second sigma) replaces sigma in std_t's (1 - sigma);
    it is required then. With prev_sample given it is not resampled: its log-prob under the step is returned.
    Returns (prev_sample, log_prob [B] (mean over non-batch dims, constants included), mean, std) where
    std = std_t * sqrt(-dt) has shape [B, 1, ...].
    """
    std_t = sde_std_t(sigma, noise_level=noise_level, sigma_max=sigma_max, noise_cap="flow_grpo")
    return sde_step_from_std(velocity, sample, sigma, sigma_next, std_t, prev_sample=prev_sample,
                             generator=generator)


def ode_step(velocity, sample, sigma, sigma_next):
    """Euler step of the probability-flow ODE: x + v * (sigma_next - sigma), in fp32 (the scheduler's step)."""
    dtype = _compute_dtype(velocity, sample)
    x = sample.to(dtype)
    dt = _per_sample(sigma_next, x.shape[0], x) - _per_sample(sigma, x.shape[0], x)
    return x + velocity.to(dtype) * dt


def image_kl(mean_theta, mean_ref, std):
    """KL between two SDE-step Gaussians of equal std: mean over non-batch dims of (m_theta - m_ref)^2 / (2 std^2)."""
    dtype = _compute_dtype(mean_theta, mean_ref)
    diff = mean_theta.to(dtype) - mean_ref.to(dtype)
    std = torch.as_tensor(std, dtype=dtype, device=diff.device)
    if std.ndim == 1:
        std = std.reshape(-1, *([1] * (diff.ndim - 1)))
    return (diff**2 / (2 * std**2)).mean(dim=tuple(range(1, diff.ndim)))
