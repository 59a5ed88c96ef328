"""Counter-based seeds and the noise drawn from them, and the Gumbel-max sampler that turns that noise into tokens.

Sampling is done with the Gumbel-max trick on counter-based noise: the noise for completion `k`
at position `t` depends only on (seed, k, t, token), so a completion is the same whether it was
generated alone, in a batch of 64, on one process or on eight. That makes runs reproducible
across world sizes and makes resume exact without restoring any generator state. `utils.core.rollout`
samples with it through HF `generate`.
"""

import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB as int64
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_LOW_BITS = {n: (1 << n) - 1 for n in (33, 34, 37, 53)}  # masks of the n lowest bits


def _splitmix64(x):
    """SplitMix64 finaliser on int64 tensors (wrapping arithmetic; a logical shift is the arithmetic shift with the
    sign copies masked off)."""
    x = x ^ (x >> 30).bitwise_and_(_LOW_BITS[34])
    x.mul_(_MIX1)
    x ^= (x >> 27).bitwise_and_(_LOW_BITS[37])
    x.mul_(_MIX2)
    x ^= (x >> 31).bitwise_and_(_LOW_BITS[33])
    return x


def counter_uniform(row_seeds, step, vocab_size):
    """Uniform(0, 1) noise that depends only on (row seed, step, token id).

    `step` is an int (returns [B, V]) or a 1-D tensor of steps (returns [B, S, V]).
    """
    device = row_seeds.device
    steps = torch.as_tensor(step, dtype=torch.long, device=device)
    base = _splitmix64(row_seeds.long().view(-1, *([1] * steps.dim())) * _GOLDEN + steps)
    tokens = torch.arange(vocab_size, device=device, dtype=torch.long)
    bits = _splitmix64(base.unsqueeze(-1) + tokens * _GOLDEN)
    mantissa = (bits >> 10).bitwise_and_(_LOW_BITS[53])  # 53 random bits
    return mantissa.double().add_(0.5).div_(float(1 << 53))


def completion_seeds(seed, round_index, global_indices):
    """One int64 seed per completion, from the run seed, the generation round and its global index."""
    idx = torch.as_tensor(global_indices, dtype=torch.long)
    # Stay in int64 tensors throughout: Python ints would not wrap around like the hash needs.
    round_term = torch.full_like(idx, int(round_index)) * _GOLDEN
    return _splitmix64(_splitmix64(torch.full_like(idx, int(seed)) + round_term) + idx)


class GumbelSampler(LogitsProcessor):
    """Turns greedy decoding into sampling from softmax(logits / T) (after optional top-k/top-p).

    argmax(log p + Gumbel noise) is an exact sample from p; the noise comes from `counter_uniform`.
    """

    # Noise for several decoding steps is drawn at once (one batch of hash ops instead of one per token)
    # as long as the block stays under this many elements; large vocabularies draw a step at a time.
    block_elements = 1 << 22

    def __init__(self, row_seeds, prompt_length, temperature=1.0, top_k=None, top_p=None, max_new_tokens=None):
        self.row_seeds = row_seeds
        self.prompt_length = prompt_length
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self._block, self._block_start = None, None
        self.warpers = []
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k=int(top_k)))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=float(top_p)))

    def gumbel(self, step, vocab_size, device):
        """Gumbel noise [B, V] for one decoding step, served from a cached block of steps."""
        block = self._block
        if (block is None or not (self._block_start <= step < self._block_start + block.shape[1])
                or block.shape[-1] != vocab_size):
            remaining = (self.max_new_tokens - step) if self.max_new_tokens else 1
            n = max(1, min(remaining, self.block_elements // max(1, len(self.row_seeds) * vocab_size)))
            u = counter_uniform(self.row_seeds.to(device), torch.arange(step, step + n, device=device), vocab_size)
            self._block, self._block_start = u.log_().neg_().log_().neg_().float(), step  # Gumbel: -log(-log u)
        return self._block[:, step - self._block_start]

    def select_rows(self, rows):
        """Keep only `rows` (a 1-D index) of the batch: the decoding loop dropped the others."""
        self.row_seeds = self.row_seeds[rows.to(self.row_seeds.device)]
        if self._block is not None:
            self._block = self._block[rows.to(self._block.device)]

    def __call__(self, input_ids, scores):
        scores = scores.float()
        if self.temperature <= 0:  # greedy
            return scores
        if self.temperature != 1.0:  # (dividing by 1 changes no number: skipped, as a copy per token)
            scores = scores / self.temperature
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        step = input_ids.shape[1] - self.prompt_length
        return scores + self.gumbel(step, scores.shape[-1], scores.device)
