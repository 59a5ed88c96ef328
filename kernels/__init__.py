"""Kernels, one op per file beside its torch path: log-prob from the LM head (`logprob.py`), log-prob from
logits (`logits_logprob.py`), group advantages (`advantages.py`); what they share is in `tiling.py`.

Each has a plain torch path (the CPU path and the reference) and a Triton path for CUDA.
"""

from .advantages import group_advantages
from .logits_logprob import naive_token_logprobs, token_logprobs
from .logprob import fused_token_logprobs

__all__ = ["fused_token_logprobs", "token_logprobs", "group_advantages", "naive_token_logprobs"]
