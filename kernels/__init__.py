"""Kernels: fused token log-prob from the LM head, token log-prob from logits, group advantages.

Each has a plain torch path (the CPU path and the reference) and a Triton path for CUDA.
"""

from .advantages import group_advantages
from .logprob import fused_token_logprobs, naive_token_logprobs, token_logprobs

__all__ = ["fused_token_logprobs", "token_logprobs", "group_advantages", "naive_token_logprobs"]
