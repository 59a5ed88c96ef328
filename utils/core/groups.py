"""GRPO groups after scoring: the weighted reward per completion, which groups have reward spread, and DAPO's
dynamic-sampling choice of groups to train on (train_grpo.py's --dynamic_sampling, docs/grpo.md)."""

import math

import torch


def weighted_rewards(rewards, reward_weights):
    """Weighted reward per completion [N]; NaN for an unscorable completion (every reward None)."""
    total = (rewards.nan_to_num(0.0) * reward_weights).sum(-1)
    return total.masked_fill(rewards.isnan().all(-1), float("nan"))


def has_spread(rewards, reward_weights, G, per_objective=False):
    """[groups] True where a group's scorable weighted rewards differ (per reward function too under PCGrad)."""
    columns = [weighted_rewards(rewards, reward_weights)]
    if per_objective:
        columns += [rewards[:, j] * w for j, w in enumerate(reward_weights.tolist()) if w]
    spread = torch.zeros(rewards.shape[0] // G, dtype=torch.bool)
    for col in columns:
        grouped = col.view(-1, G)
        present = ~grouped.isnan()
        high = grouped.nan_to_num(-math.inf).max(-1).values
        low = grouped.nan_to_num(math.inf).min(-1).values
        spread |= (present.sum(-1) >= 2) & (high - low > 1e-6 * high.abs().clamp(min=1.0))
    return spread


def split_groups(generated, G, reward_weights, per_objective):
    """Every group of the generated micro-batches, in order: prompt, token ids (and vLLM's log-probs of them),
    rewards and whether it varies."""
    groups = []
    for mb in generated:
        spread = has_spread(mb["rewards"], reward_weights, G, per_objective)
        for g, prompt in enumerate(mb["prompt_rows"]):
            sampler_logps = mb.get("all_sampler_logps")  # vLLM's per-token log-probs, when it sampled
            groups.append(dict(prompt=prompt, token_ids=mb["all_token_ids"][g * G:(g + 1) * G],
                               sampler_logps=sampler_logps[g * G:(g + 1) * G] if sampler_logps else None,
                               rewards=mb["rewards"][g * G:(g + 1) * G], spread=bool(spread[g])))
    return groups


def choose_groups(groups, needed):
    """The first `needed` groups with spread; when the resample rounds ran out, groups without spread fill the rest
    (their advantages are 0, as in plain GRPO)."""
    kept = [g for g in groups if g["spread"]][:needed]
    return kept + [g for g in groups if not g["spread"]][:needed - len(kept)]


def refill_sizes(missing, prompts_per_micro, group_size, num_processes):
    """Prompts per refill micro-batch for `missing` groups: full micro-batches, then one holding the rest, rounded
    up so that its completions split evenly over the processes."""
    sizes = [prompts_per_micro] * (missing // prompts_per_micro)
    rest = missing % prompts_per_micro
    if rest:
        sizes.append(next(k for k in range(rest, prompts_per_micro + 1) if k * group_size % num_processes == 0))
    return sizes


def dynamic_sampling(generated, sample, needed, prompts_per_micro, G, num_processes, reward_weights, per_objective,
                     max_rounds):
    """DAPO's dynamic sampling: split the generated micro-batches into groups and, while fewer than `needed` groups
    have reward spread, draw refill micro-batches for the missing ones (at most `max_rounds` rounds).
    `sample(num_prompts, micro)` draws, rolls out and scores one more micro-batch, numbered `micro`.
    Returns (every group, in order; the number of refill rounds)."""
    generated, rounds = list(generated), 0
    while True:
        groups = split_groups(generated, G, reward_weights, per_objective)
        missing = needed - sum(g["spread"] for g in groups)
        if missing <= 0 or rounds == max_rounds:
            return groups, rounds
        rounds += 1  # refill with as many new prompts as groups are missing
        for n in refill_sizes(missing, prompts_per_micro, G, num_processes):
            generated.append(sample(n, len(generated)))
