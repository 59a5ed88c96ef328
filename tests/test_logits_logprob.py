"""kernels/logits_logprob.py's torch path over several tiles and row chunks of its own tile sizes (test_kernels.py's
small tiles are the LM-head op's, in kernels/logprob.py), and the names kernels/ exports from each op's file."""

import math

import pytest
import torch

import kernels
import kernels.logits_logprob as logits_logprob
import kernels.logprob as logprob
from kernels import naive_token_logprobs, token_logprobs

V = 100  # not a multiple of the 32-column tile


@pytest.fixture
def tiles(monkeypatch):
    """32-column tiles and 3-row chunks; returns the (rows, columns) of every tile the forward and backward read."""
    monkeypatch.setattr(logits_logprob, "VOCAB_TILE", 32)
    monkeypatch.setattr(logits_logprob, "TILE_ELEMENTS", 32 * 3)
    seen = []
    original = logits_logprob._gather_tile

    def gather(logits, idx, v0, v1, inv_t, scratch):
        seen.append((idx.shape[0], v1 - v0))
        return original(logits, idx, v0, v1, inv_t, scratch)

    monkeypatch.setattr(logits_logprob, "_gather_tile", gather)
    return seen


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_token_logprobs_over_several_tiles(tiles, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, V, generator=gen) * 3).requires_grad_()
    labels = torch.randint(0, V, (7,), generator=gen)
    labels[1] = -100
    logp = token_logprobs(logits, labels, temperature=temperature, backend="torch")
    # 6 kept rows in chunks of 3, each across 4 tiles (the last one ragged)
    assert sorted(tiles) == sorted([(3, 32), (3, 32), (3, 32), (3, 4)] * 2)
    ref = torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    ref = ref * (labels != -100)
    assert (logp.double() - ref).abs().max() < 2e-6
    upstream = torch.randn(7, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((logp.double() * upstream).sum(), logits)[0]
    want = torch.autograd.grad((ref * upstream).sum(), logits)[0]
    assert (got.double() - want).abs().max() < 2e-6
    assert len(tiles) == 16  # the backward reads each (chunk, tile) pair once more


def test_a_whole_masked_tile_gives_no_nan(tiles):
    logits = torch.randn(2, V)
    logits[:, :40] = -math.inf  # the first tile is all -inf, the second partly
    labels = torch.tensor([50, 99])
    logp = token_logprobs(logits, labels)
    assert len({cols for _, cols in tiles}) > 1
    assert torch.allclose(logp.double(), torch.log_softmax(logits.double(), -1)[torch.arange(2), labels], atol=2e-6)


def test_each_op_is_exported_from_its_file():
    assert kernels.fused_token_logprobs.__module__ == "kernels.logprob"
    assert kernels.token_logprobs.__module__ == "kernels.logits_logprob"
    assert kernels.naive_token_logprobs.__module__ == "kernels.logits_logprob"
    assert kernels.group_advantages.__module__ == "kernels.advantages"
    # kernels.logprob keeps the names it exported before the split
    assert logprob.token_logprobs is token_logprobs and logprob.naive_token_logprobs is naive_token_logprobs
