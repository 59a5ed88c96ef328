"""Padding-free packing (utils/core/packing.py): the packed log-prob pass equals the padded one, values and gradients,
on every tiny family, with ragged completions, shared and unshared prompts, several packed rows, LoRA, gradient
checkpointing and eager attention; SFT's packed NLL equals its padded one; unsupported models are refused."""

import pytest
import torch

from tiny.models import make_tiny_llm, make_tiny_vlm
from tiny.shapes import make_shapes_vqa
from utils.core.config import ConfigError
from utils.core.encoding import encode_prompts
from utils.core.logprobs import CompletionLogProbs, expand_prompts
from utils.core.models import load_model_and_processor
from utils.core.packing import packed_completion_hidden, packing_unsupported_reason, resolve_padding_free
from utils.core.prompts import build_messages

pytestmark = pytest.mark.usefixtures("two_torch_threads")

# every tiny family the packed pass supports (Gemma 3, Gemma 4 and Qwen3.5 are refused: see the test below)
# (the fast tier keeps one family per kind of prompt pass; the others run in the full tier)
FAMILIES = ["qwen2_5_vl", "internvl", "glm4v", "text"] + [
    pytest.param(f, marks=pytest.mark.full) for f in ("qwen3_vl", "internvl3_5", "smolvlm", "llava_onevision",
                                                      "text_qwen3")]
# fp32 sums in another order: log-probs to 1e-5, gradients to 1e-4 of each tensor's largest entry
LOGP_TOL, GRAD_TOL = 1e-5, 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    text = request.param.startswith("text")
    path = (make_tiny_llm(str(root / "m"), seed=0, family="qwen3" if request.param == "text_qwen3" else "qwen2")
            if text else make_tiny_vlm(str(root / "m"), family=request.param, seed=0))
    model, processor = load_model_and_processor(path)
    rows = [make_shapes_vqa(3, seed=5)[i] for i in (0, 2)]
    images = [[] if text else [r["image"]] for r in rows]
    messages = [build_messages(r["question"] + " Look closely." * i, num_images=len(im))
                for i, (r, im) in enumerate(zip(rows, images))]
    prompts = encode_prompts(processor, messages, images, sample_ids=["a", "b"])
    return dict(name=request.param, path=path, model=model, processor=processor, prompts=prompts)


def ragged_completions(vocab=200, lengths=(9, 3, 1, 5, 9, 2)):
    gen = torch.Generator().manual_seed(0)
    width = max(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(10, vocab, (len(lengths), width), generator=gen).masked_fill(mask == 0, 0)
    return ids, mask, torch.randn(ids.shape, generator=gen)


PROMPT_INDEX = torch.tensor([0, 0, 0, 1, 1, 1])


def logps_and_grads(model, policy, prompts, ids, mask, weights, *, shared, entropy=False):
    """Log-probs (and entropy) of the completions and the gradients of a weighted sum of them."""
    model.zero_grad()
    batch = prompts if shared else expand_prompts(prompts, PROMPT_INDEX)
    out = policy(batch, ids, mask, 0.7, return_entropy=entropy, prompt_index=PROMPT_INDEX if shared else None)
    logps, ent = out if entropy else (out, None)
    loss = (logps * weights).sum() + (0.3 * (ent * weights).sum() if entropy else 0.0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (logps.detach(), None if ent is None else ent.detach()), grads


def assert_same(padded, packed):
    (lp_a, ent_a), grads_a = padded
    (lp_b, ent_b), grads_b = packed
    assert torch.allclose(lp_a, lp_b, atol=LOGP_TOL), (lp_a - lp_b).abs().max()
    if ent_a is not None:
        assert torch.allclose(ent_a, ent_b, atol=LOGP_TOL), (ent_a - ent_b).abs().max()
    assert grads_a.keys() == grads_b.keys() and grads_a
    # a gradient that is zero in exact arithmetic (a key bias under softmax) is float noise: scale it by the model's
    largest = max(g.abs().max() for g in grads_a.values())
    for name in grads_a:
        scale = torch.maximum(grads_a[name].abs().max(), 1e-4 * largest)
        assert (grads_a[name] - grads_b[name]).abs().max() <= GRAD_TOL * scale, name


def test_packed_equals_padded_on_every_family(family, monkeypatch):
    """Shared prompts (a unit: the prompt and its completions), then per-completion prompts under a token budget
    that spreads them over several rows (padded to the longest): both equal the padded pass."""
    import utils.core.packing as packing

    model, prompts = family["model"], family["prompts"]
    ids, mask, weights = ragged_completions()
    padded = logps_and_grads(model, CompletionLogProbs(model), prompts, ids, mask, weights, shared=False,
                             entropy=True)
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(packing, "MAX_PACKED_TOKENS", int(prompts["attention_mask"].sum(-1).max()) + 10)
        packed = logps_and_grads(model, CompletionLogProbs(model, padding_free=True), prompts, ids, mask, weights,
                                 shared=shared, entropy=True)
        assert_same(padded, packed)


def test_packed_pass_has_no_padding_and_restarts_positions(family, monkeypatch):
    """The packed rows hold the prompts' valid tokens and each completion's inputs (its last token predicts
    nothing), and a row is no longer than the longest unit; positions restart at 0 for each prompt; a token
    budget splits the rows further."""
    import utils.core.packing as packing

    model, prompts = family["model"], family["prompts"]
    ids, mask, _ = ragged_completions()
    with torch.no_grad():
        _, packed = packed_completion_hidden(model.base_model, prompts, PROMPT_INDEX, ids, mask)
        units = [int(prompts["attention_mask"][p].sum()) + int((mask[PROMPT_INDEX == p].sum(-1) - 1).sum())
                 for p in (0, 1)]
        assert packed.tokens == sum(units) and packed.input_ids.shape[1] == max(units)
        pos = packed.position_ids if packed.position_ids.dim() == 2 else packed.position_ids[0]
        assert pos[0, 0] == 0 and pos.view(-1)[packed.start[(1, 0)]] == 0
        monkeypatch.setattr(packing, "MAX_PACKED_TOKENS", int(prompts["attention_mask"].sum(-1).max()) + 10)
        _, packed = packed_completion_hidden(model.base_model, expand_prompts(prompts, PROMPT_INDEX), None, ids, mask)
    assert len(packed.rows) > 1 and packed.input_ids.shape[1] < packed.tokens


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = make_tiny_vlm(str(tmp_path_factory.mktemp("qwen") / "m"), seed=0)
    rows = [make_shapes_vqa(3, seed=5)[i] for i in (0, 2)]
    return path, rows


def qwen_prompts(processor, rows):
    messages = [build_messages(r["question"] + " Look closely." * i, num_images=1) for i, r in enumerate(rows)]
    return encode_prompts(processor, messages, [[r["image"]] for r in rows], sample_ids=["a", "b"])


@pytest.mark.parametrize("variant", ["lora_checkpointing", "eager"])
def test_packed_equals_padded_under_lora_checkpointing_and_eager(qwen, variant):
    path, rows = qwen
    model, processor = load_model_and_processor(path, attn_implementation="eager" if variant == "eager" else None)
    if variant == "lora_checkpointing":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    prompts = qwen_prompts(processor, rows)
    ids, mask, weights = ragged_completions()
    padded = logps_and_grads(model, CompletionLogProbs(model), prompts, ids, mask, weights, shared=False)
    packed = logps_and_grads(model, CompletionLogProbs(model, padding_free=True), prompts, ids, mask, weights,
                             shared=True)
    if variant == "lora_checkpointing":
        assert all("lora" in name for name in packed[1])
    assert_same(padded, packed)


def test_sft_packed_nll_equals_padded(qwen):
    from train_sft import AssistantNLL
    from utils.core.sft_data import encode_sft_batch, vqa_conversation

    path, rows = qwen
    model, processor = load_model_and_processor(path)
    rows = [dict(r, answer=r["answer"] + " because" * (3 * i)) for i, r in enumerate(rows)]  # ragged lengths
    conversations = [vqa_conversation(r) for r in rows]
    batch = encode_sft_batch(processor, [c[0] for c in conversations], [c[1] for c in conversations],
                             sample_ids=["a", "b"])
    assert not batch["attention_mask"].bool().all()  # right padding to remove

    def loss_and_grads(padding_free):
        model.zero_grad()
        loss = AssistantNLL(model, padding_free=padding_free)(batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_a, grads_a = loss_and_grads(False)
    loss_b, grads_b = loss_and_grads(True)
    assert torch.allclose(loss_a, loss_b, rtol=1e-5)
    for name in grads_a:
        assert (grads_a[name] - grads_b[name]).abs().max() <= GRAD_TOL * grads_a[name].abs().max().clamp(min=1e-12)


def test_unsupported_attention_is_refused_with_the_reason(qwen):
    path, _ = qwen
    model, _ = load_model_and_processor(path)
    assert packing_unsupported_reason(model) is None
    model.config.get_text_config()._attn_implementation = "flex_attention"
    model.config._attn_implementation = "flex_attention"
    reason = packing_unsupported_reason(model)
    assert reason and "flex_attention" in reason
    with pytest.raises(ConfigError, match="--padding_free: attention 'flex_attention'"):
        resolve_padding_free(True, model)
    notices = []
    assert resolve_padding_free(None, model, notices.append) is False and "flex_attention" in notices[0]
    assert resolve_padding_free(False, model) is False


@pytest.mark.parametrize("family, reason", [
    ("gemma3", "attend bidirectionally"), ("gemma4", "sliding-window layers"), ("qwen3_5", "linear-attention layers")])
def test_families_the_packed_pass_cannot_serve_are_refused(family, reason, tmp_path):
    """Gemma 3's image tokens see each other both ways, Gemma 4 has sliding-window layers, Qwen3.5's linear
    attention runs a recurrence along the row: packed, Qwen3.5's completions would read each other's state."""
    model, processor = load_model_and_processor(make_tiny_vlm(str(tmp_path / "m"), family=family, seed=0))
    assert reason in packing_unsupported_reason(model)
    with pytest.raises(ConfigError, match=reason):
        resolve_padding_free(True, model)
    if family == "qwen3_5":  # forced through anyway, the shared prompt's completions leak into each other
        rows = [make_shapes_vqa(3, seed=5)[i] for i in (0, 2)]
        messages = [build_messages(r["question"], num_images=1) for r in rows]
        prompts = encode_prompts(processor, messages, [[r["image"]] for r in rows], sample_ids=["a", "b"])
        ids, mask, _ = ragged_completions()
        with torch.no_grad():
            padded = CompletionLogProbs(model)(expand_prompts(prompts, PROMPT_INDEX), ids, mask, 1.0)
            packed = CompletionLogProbs(model, padding_free=True)(prompts, ids, mask, 1.0, prompt_index=PROMPT_INDEX)
        assert (padded - packed).abs().max() > 1e-3


def test_non_prefix_completion_mask_is_an_error(qwen):
    path, rows = qwen
    model, processor = load_model_and_processor(path)
    ids, mask, _ = ragged_completions()
    mask[0, 2] = 0
    with pytest.raises(ValueError, match="completion_mask must be ones then zeros"):
        CompletionLogProbs(model, padding_free=True)(qwen_prompts(processor, rows), ids, mask,
                                                     prompt_index=PROMPT_INDEX)


def test_packed_equals_padded_with_several_images_per_prompt(tmp_path):
    """Prompts with two images and one (the 3-row rope reads each prompt's own image grids, in order)."""
    model, processor = load_model_and_processor(make_tiny_vlm(str(tmp_path / "m"), family="qwen2_5_vl", seed=0))
    rows = make_shapes_vqa(12, seed=7)
    ids, mask, weights = ragged_completions()
    images = [[rows[2 * i]["image"], rows[2 * i + 1]["image"]] if i % 3 else [rows[2 * i]["image"]]
              for i in range(len(ids))]
    messages = [build_messages(rows[i]["question"], num_images=len(im)) for i, im in enumerate(images)]
    prompts = encode_prompts(processor, messages, images, sample_ids=[str(i) for i in range(len(ids))])

    def run(policy):  # one prompt row per completion, as the unshared rollout gives them
        model.zero_grad()
        logps = policy(prompts, ids, mask, 0.7)
        (logps * weights).sum().backward()
        return (logps.detach(), None), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert_same(run(CompletionLogProbs(model)), run(CompletionLogProbs(model, padding_free=True)))


class FakeAttention(torch.nn.Module):
    def __init__(self, groups, is_causal=True):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, is_causal


def random_pieces(unit_shapes, vocab=50):
    """Units of (prefix length, completion lengths) as Packed pieces (1-D positions, no side inputs)."""
    gen = torch.Generator().manual_seed(1)
    pieces = []
    for prefix, completions in unit_shapes:
        unit = [(-1, torch.randint(vocab, (prefix,), generator=gen), torch.arange(prefix), {})]
        unit += [(c, torch.randint(vocab, (n,), generator=gen), prefix + torch.arange(n), {})
                 for c, n in enumerate(completions)]
        pieces.append(unit)
    return pieces


def test_segment_attention_equals_the_dense_mask_and_skips_masked_pairs(monkeypatch):
    """Per-piece SDPA over the keys each piece sees equals SDPA under the dense row mask at every real token
    (grouped KV heads, two units in a row, a row of its own, row padding), and computes only the visible pairs."""
    import torch.nn.functional as F

    import utils.core.packed_attention as attention
    import utils.core.packing as packing

    shapes = [(5, [3, 1, 4]), (2, [2]), (9, [6, 5])]
    pieces = random_pieces(shapes)
    packed = packing.Packed(pieces, max_tokens=10**6, device="cpu")
    assert len(packed.rows) == 2 and packed.width == 20  # units 0 and 1 share the first row (13 + 4 tokens)
    gen = torch.Generator().manual_seed(2)
    rows, width = len(packed.rows), packed.width
    q = torch.randn(rows, 4, width, 8, generator=gen, requires_grad=True)
    k = torch.randn(rows, 2, width, 8, generator=gen, requires_grad=True)
    v = torch.randn(rows, 2, width, 8, generator=gen, requires_grad=True)
    module = FakeAttention(groups=2)

    pairs = []
    sdpa = F.scaled_dot_product_attention

    def counting_sdpa(query, key, value, **kw):
        n_q, n_k = query.shape[-2], key.shape[-2]
        pairs.append(n_q * (n_q + 1) // 2 if kw.get("is_causal") else int(kw["attn_mask"].sum()))
        assert kw.get("is_causal") or n_q * n_k == kw["attn_mask"].numel()
        return sdpa(query, key, value, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting_sdpa)
    out, _ = attention.segment_attention(module, q, k, v, None, scaling=0.3, packed_segments=packed.segments)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)

    dense = packed.attention_mask() == 0  # eager's additive mask, as booleans
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = sdpa(q, kk, vv, attn_mask=dense, scale=0.3).transpose(1, 2)
    real = (packed.owner >= 0)[..., None, None]
    assert out.shape == want.shape
    assert torch.allclose(out * real, want * real, atol=1e-6)
    assert (out * ~real).abs().sum() == 0

    grad = torch.randn(out.shape, generator=gen) * real
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-5)
    # every visible pair once, each prefix causal over itself: no masked block is computed
    causal = lambda n: n * (n + 1) // 2  # noqa: E731
    visible = sum(causal(p) + sum(n * p + causal(n) for n in comps) for p, comps in shapes)
    tokens = packed.owner >= 0
    assert sum(pairs) == visible == int((dense[:, 0] & tokens[:, :, None] & tokens[:, None, :]).sum())
    assert sum(pairs) < 0.6 * rows * width * width


def test_segment_attention_leaves_other_calls_to_sdpa():
    """Without packed segments (generation, the padded pass), or in a bidirectional layer that the same kwargs
    reach (a vision tower), the call is transformers' sdpa; a causal layer of another shape is an error."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import utils.core.packed_attention as attention
    import utils.core.packing as packing

    assert AttentionInterface._global_mapping["sdpa"] is attention.segment_attention
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=gen) for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    for module, segments in ((FakeAttention(1), None), (FakeAttention(1, is_causal=False), "unused")):
        got, _ = attention.segment_attention(module, q, k, v, mask, scaling=0.5, packed_segments=segments)
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.5)
        assert torch.equal(got, want)
    packed = packing.Packed(random_pieces([(3, [2])]), max_tokens=100, device="cpu")
    with pytest.raises(ValueError, match="packed rows of 1 x 5 tokens"):
        attention.segment_attention(FakeAttention(1), q, k, v, None, packed_segments=packed.segments)


def varlen_reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """flash-attention's varlen call as transformers makes it, in plain torch (flash-attn needs CUDA): sequence i
    is queries cu_q[i]:cu_q[i+1] over keys cu_k[i]:cu_k[i+1], the causal mask aligned bottom-right (flash-attn
    >= 2.1), grouped KV heads; [1, heads, n, d] in, ([1, n, heads, d], None) out."""
    assert attention_mask is None and is_causal and query.shape[0] == 1
    assert cu_seq_lens_q.dtype == cu_seq_lens_k.dtype == torch.int32
    assert max_length_q == int(cu_seq_lens_q.diff().max()) and max_length_k == int(cu_seq_lens_k.diff().max())
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    outs = []
    for i in range(len(cu_seq_lens_q) - 1):
        q = query[:, :, cu_seq_lens_q[i]:cu_seq_lens_q[i + 1]]
        k, v = (t[:, :, cu_seq_lens_k[i]:cu_seq_lens_k[i + 1]] for t in (key, value))
        n_q, n_k = q.shape[2], k.shape[2]
        mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling))
    return torch.cat(outs, 2).transpose(1, 2), None


def test_packed_flash_attention_is_one_varlen_call_equal_to_the_dense_mask(monkeypatch):
    """Under flash_attention_2 every piece of every row is one varlen sequence (its prefix's keys, then its own):
    one kernel call per layer whose output, with the kernel's causal mask aligned bottom-right, equals SDPA under
    the dense row mask at every real token (values and gradients; grouped KV heads, row padding zero)."""
    import torch.nn.functional as F

    import utils.core.packed_attention as attention
    import utils.core.packing as packing

    shapes = [(5, [3, 1, 4]), (2, [2]), (9, [6, 5])]
    packed = packing.Packed(random_pieces(shapes), max_tokens=10**6, device="cpu")
    gen = torch.Generator().manual_seed(4)
    rows, width = len(packed.rows), packed.width
    q = torch.randn(rows, 4, width, 8, generator=gen, requires_grad=True)
    k = torch.randn(rows, 2, width, 8, generator=gen, requires_grad=True)
    v = torch.randn(rows, 2, width, 8, generator=gen, requires_grad=True)
    calls = []

    def kernel(*args, **kw):
        calls.append(kw)
        return varlen_reference(*args, **kw)

    monkeypatch.setattr(attention, "flash_attention_forward", kernel)
    out, _ = attention.packed_flash_attention(FakeAttention(groups=2), q, k, v, None, scaling=0.3,
                                            packed_segments=packed.segments, position_ids=torch.zeros(1))
    assert len(calls) == 1
    lengths_q = calls[0]["cu_seq_lens_q"].diff().tolist()
    lengths_k = calls[0]["cu_seq_lens_k"].diff().tolist()
    assert lengths_q == [n for p, comps in shapes for n in [p, *comps]]
    assert lengths_k == [n for p, comps in shapes for n in [p, *(p + c for c in comps)]]

    dense = packed.attention_mask() == 0
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense,
                                          scale=0.3).transpose(1, 2)
    real = (packed.owner >= 0)[..., None, None]
    assert out.shape == want.shape and (out * ~real).abs().sum() == 0
    assert torch.allclose(out * real, want * real, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen) * real
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        assert torch.allclose(a, b, atol=1e-5)


def test_packed_equals_padded_under_flash_attention_2(qwen, monkeypatch):
    """The whole packed log-prob pass of tiny Qwen2.5-VL (3-row rope, images, shared prompts) with its language
    model on flash_attention_2 (the varlen kernel in plain torch) equals the padded sdpa pass."""
    import utils.core.packed_attention as attention
    import utils.core.packing as packing

    path, rows = qwen
    model, processor = load_model_and_processor(path)
    prompts = qwen_prompts(processor, rows)
    ids, mask, weights = ragged_completions()
    padded = logps_and_grads(model, CompletionLogProbs(model), prompts, ids, mask, weights, shared=False)
    calls = []

    def kernel(*args, **kw):
        calls.append(kw.get("cu_seq_lens_q"))
        return varlen_reference(*args, **kw)

    monkeypatch.setattr(attention, "flash_attention_forward", kernel)
    monkeypatch.setattr(packing, "flash_attn_supports_top_left_mask", lambda: False)
    model.config.get_text_config()._attn_implementation = "flash_attention_2"  # the vision tower stays on sdpa
    assert packing_unsupported_reason(model) is None
    packed = logps_and_grads(model, CompletionLogProbs(model, padding_free=True), prompts, ids, mask, weights,
                             shared=True)
    layers = model.config.get_text_config().num_hidden_layers
    pieces = 2 + int((mask.sum(-1) > 1).sum())  # the prompts, and each completion with a token to read
    assert len(calls) == layers and all(c is not None and len(c) == 1 + pieces for c in calls)
    assert_same(padded, packed)
    monkeypatch.setattr(packing, "flash_attn_supports_top_left_mask", lambda: True)
    assert "bottom-right" in packing_unsupported_reason(model)
