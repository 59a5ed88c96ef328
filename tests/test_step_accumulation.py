"""How an optimizer step is assembled from micro-batches in train_grpo.py: each micro-batch loss's share of the step
under gradient accumulation (utils.core.losses.accumulation_divisor) and DAPO's dynamic-sampling refill of groups
without
reward spread (utils.core.groups.dynamic_sampling)."""

import pytest
import torch

from utils.core.groups import dynamic_sampling
from utils.core.losses import LOSS_TYPES, accumulation_divisor, clipped_policy_loss

G = 2
WEIGHTS = torch.tensor([1.0])


def test_dapo_micro_batch_losses_add_up_to_the_step_loss():
    """Two micro-batches of one step: their shares sum to the loss of the whole step (dapo: tokens of the step)."""
    torch.manual_seed(0)
    logps = torch.randn(4, 5)
    old = logps + 0.1 * torch.randn(4, 5)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float32)
    tokens = mask.sum()
    whole, _ = clipped_policy_loss(logps, old, adv, mask, loss_type="dapo", num_items_in_batch=tokens)
    divisor = accumulation_divisor("dapo", 2)
    shares = [clipped_policy_loss(logps[s], old[s], adv[s], mask[s], loss_type="dapo", num_items_in_batch=tokens)[0]
              / divisor for s in (slice(0, 2), slice(2, 4))]
    assert divisor == 1
    assert torch.allclose(sum(shares), whole)


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "dapo"])
def test_other_losses_are_averaged_over_the_micro_batches(loss_type):
    """The same step in two equal micro-batches: the mean of their losses is the loss of the whole step."""
    torch.manual_seed(0)
    logps, adv, mask = torch.randn(4, 3), torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, 3)
    losses = [clipped_policy_loss(logps[s], logps[s] - 0.1, adv[s], mask[s], loss_type=loss_type,
                                  max_completion_length=3)[0] for s in (slice(0, 2), slice(2, 4))]
    divisor = accumulation_divisor(loss_type, 2)
    assert divisor == 2
    whole, _ = clipped_policy_loss(logps, logps - 0.1, adv, mask, loss_type=loss_type, max_completion_length=3)
    assert torch.allclose(sum(loss / divisor for loss in losses), whole)  # equal halves: the mean of the halves


def micro_batch(prompts, spreads):
    """A scored micro-batch as train_grpo's sample_micro_batch returns it: G completions per prompt; a group has
    reward spread when its two rewards differ."""
    rewards = torch.tensor([[0.0], [1.0]] * len(prompts))
    for g, spread in enumerate(spreads):
        if not spread:
            rewards[g * G + 1] = 0.0
    return dict(prompt_rows=list(prompts), rewards=rewards,
                all_token_ids=[[p, k] for p in prompts for k in range(G)])


def test_dynamic_sampling_refills_until_enough_groups_vary():
    generated = [micro_batch([0, 1], [True, False]), micro_batch([2, 3], [False, False])]
    draws = iter([[4, 5], [6]])  # the refills' prompts, spreads
    spreads = {4: True, 5: False, 6: True}
    calls = []

    def sample(n, micro):
        prompts = next(draws)
        calls.append((n, micro))
        assert len(prompts) == n
        return micro_batch(prompts, [spreads[p] for p in prompts])

    groups, rounds = dynamic_sampling(generated, sample, needed=3, prompts_per_micro=2, G=G, num_processes=1,
                                      reward_weights=WEIGHTS, per_objective=False, max_rounds=5)
    # round 1: 2 groups missing -> a micro-batch of 2 prompts (one varies); round 2: 1 missing -> 1 prompt
    assert rounds == 2
    assert calls == [(2, 2), (1, 3)]
    assert [g["prompt"] for g in groups] == [0, 1, 2, 3, 4, 5, 6]
    assert [g["spread"] for g in groups] == [True, False, False, False, True, False, True]
    assert len(generated) == 2  # the caller's list is left as it was


def test_dynamic_sampling_stops_after_max_rounds():
    calls = []

    def sample(n, micro):
        calls.append((n, micro))
        return micro_batch(list(range(10 * micro, 10 * micro + n)), [False] * n)

    groups, rounds = dynamic_sampling([micro_batch([0, 1], [False, True])], sample, needed=2, prompts_per_micro=2,
                                      G=G, num_processes=1, reward_weights=WEIGHTS, per_objective=False, max_rounds=2)
    assert rounds == 2
    assert calls == [(1, 1), (1, 2)]
    assert [g["prompt"] for g in groups] == [0, 1, 10, 20]
    assert [g["spread"] for g in groups] == [False, True, False, False]


def test_dynamic_sampling_draws_nothing_when_every_group_varies():
    def sample(n, micro):
        raise AssertionError("no refill expected")

    groups, rounds = dynamic_sampling([micro_batch([0, 1], [True, True])], sample, needed=2, prompts_per_micro=2,
                                      G=G, num_processes=1, reward_weights=WEIGHTS, per_objective=False, max_rounds=3)
    assert rounds == 0 and [g["spread"] for g in groups] == [True, True]
