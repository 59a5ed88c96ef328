"""GRPO and SFT: the run skeleton, config, data, models, rollout, log-probs, losses, checkpoints, logging."""
