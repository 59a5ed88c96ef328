"""Counter-based Gumbel sampling: exact distribution, and independence from batch composition."""

import torch

from utils.core.rollout import completion_mask
from utils.core.seeds import GumbelSampler, completion_seeds, counter_uniform


def test_counter_uniform_is_deterministic_and_uniform():
    seeds = completion_seeds(7, 0, range(64))
    u1 = counter_uniform(seeds, 3, 1000)
    u2 = counter_uniform(seeds, 3, 1000)
    assert torch.equal(u1, u2)
    assert (u1 > 0).all() and (u1 < 1).all()
    assert abs(u1.mean().item() - 0.5) < 0.01
    assert abs(u1.var().item() - 1 / 12) < 0.002
    # Different step, seed or round gives different noise.
    assert not torch.equal(u1, counter_uniform(seeds, 4, 1000))
    assert not torch.equal(seeds, completion_seeds(7, 1, range(64)))
    assert not torch.equal(seeds, completion_seeds(8, 0, range(64)))
    # Quantiles of the pooled noise match the uniform CDF.
    q = torch.quantile(u1.flatten()[:100000].float(), torch.tensor([0.1, 0.5, 0.9]))
    assert torch.allclose(q, torch.tensor([0.1, 0.5, 0.9]), atol=0.01)


def sample(logits, seeds, temperature=1.0, top_k=None, top_p=None, step=0):
    sampler = GumbelSampler(seeds, prompt_length=5, temperature=temperature, top_k=top_k, top_p=top_p)
    input_ids = torch.zeros(len(seeds), 5 + step, dtype=torch.long)
    return sampler(input_ids, logits).argmax(-1)


def test_gumbel_max_samples_from_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n = 40000
    for temperature in (0.7, 1.3):
        draws = sample(logits.expand(n, -1), completion_seeds(1, 0, range(n)), temperature)
        freq = torch.bincount(draws, minlength=5).float() / n
        expected = torch.softmax(logits / temperature, -1)
        # 4 sigma of a binomial proportion at n = 40000 is < 0.01
        assert torch.allclose(freq, expected, atol=0.01), (temperature, freq, expected)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0, 0.5]).expand(5000, -1)
    seeds = completion_seeds(3, 0, range(5000))
    assert set(sample(logits, seeds, top_k=2).tolist()) == {0, 1}
    p = torch.softmax(logits[0], -1)
    assert set(sample(logits, seeds, top_p=float(p[0] + 0.01)).tolist()) == {0, 1}


def test_sample_depends_on_row_seed_not_on_batch_position():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    seeds = completion_seeds(5, 2, range(8))
    full = sample(logits, seeds, step=4)
    # The same rows in another order, and split in two batches, draw the same tokens.
    perm = torch.randperm(8)
    assert torch.equal(sample(logits[perm], seeds[perm], step=4), full[perm])
    halves = torch.cat([sample(logits[:3], seeds[:3], step=4), sample(logits[3:], seeds[3:], step=4)])
    assert torch.equal(halves, full)
    # A different decoding step draws fresh noise.
    noise_a = counter_uniform(seeds, 4, 50)
    noise_b = counter_uniform(seeds, 5, 50)
    assert not torch.equal(noise_a, noise_b)


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 0, 0, 0, 0]])
    mask = completion_mask(ids, eos_token_id=2)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    mask2 = completion_mask(torch.tensor([[5, 9, 1]]), eos_token_id=[2, 9])
    assert mask2.tolist() == [[1, 1, 0]]


def test_completion_seeds_for_late_rounds_and_large_seeds():
    # Rounds far into training overflow a Python-int product; the hash must wrap in int64 instead.
    for round_index in (2, 10_000, 2**40):
        s = completion_seeds(2**31 - 1, round_index, range(4))
        assert s.dtype == torch.long and len(set(s.tolist())) == 4


def test_block_noise_equals_per_step_noise():
    seeds = completion_seeds(11, 3, range(5))
    block = counter_uniform(seeds, torch.arange(2, 9), 37)
    for k, step in enumerate(range(2, 9)):
        assert torch.equal(block[:, k], counter_uniform(seeds, step, 37))
    # The sampler's cached blocks give the same draws as drawing each step on its own.
    logits = torch.randn(5, 37)
    cached = GumbelSampler(seeds, prompt_length=4, max_new_tokens=20)
    single = GumbelSampler(seeds, prompt_length=4)
    for step in range(20):
        ids = torch.zeros(5, 4 + step, dtype=torch.long)
        assert torch.equal(cached(ids, logits), single(ids, logits))
