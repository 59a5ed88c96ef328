"""The lean decoding loop (utils.core.rollout.lean_decode) samples exactly the tokens HF `generate`'s own loop samples,
on every tiny family: prompts shared by a group (one prefill) or repeated per completion, rows that stop at different
tokens, suppressed ids, top-k / top-p and greedy decoding."""

import pytest
import torch

import utils.core.rollout as rollout
from tests.family_helpers import TEXT_FAMILIES, VLM_FAMILIES, group_batches, image, user
from tests.test_families import SHARED
from utils.core.encoding import encode_prompts
from utils.core.seeds import completion_seeds

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def both_decoders(model, batch, monkeypatch, **kwargs):
    """(lean, generate) results of generate_completions, how many full-attention layers the lean loop moved into
    preallocated buffers, and the batch sizes it compacted to."""
    moved, sizes = [], []
    preallocate, keep = rollout.preallocate_cache, rollout.Compaction.keep

    def counting(cache, capacity):
        preallocate(cache, capacity)
        moved.append(sum(isinstance(layer, rollout.PreallocatedLayer) for layer in cache.layers))

    def counting_keep(self, *args):
        running, model_kwargs = keep(self, *args)
        sizes.append(running.numel())
        return running, model_kwargs

    monkeypatch.setattr(rollout, "preallocate_cache", counting)
    monkeypatch.setattr(rollout.Compaction, "keep", counting_keep)
    lean = rollout.generate_completions(model, batch, decoder="lean", **kwargs)
    reference = rollout.generate_completions(model, batch, decoder="generate", **kwargs)
    assert len(moved) == 1, "the lean loop did not run"
    return lean, reference, moved[0], sizes


def two_prompts(processor, family, index=None):
    """The encoded batch of two prompts (with an image each, for a VLM), or of their copies at `index`."""
    with_image = family not in TEXT_FAMILIES
    messages = [[user("What colour is the circle?", with_image)], [user("How many?", with_image)]]
    images = [[image()], [image((20, 200, 20), (60, 84))]] if with_image else [[], []]
    index = [0, 1] if index is None else index.tolist()
    return encode_prompts(processor, [messages[i] for i in index], [images[i] for i in index],
                          sample_ids=[str(i) for i in index])


def stop_ids(model, tokenizer, extra):
    """The model's stop tokens plus `extra` ordinary ids, so that rows of a random tiny model stop at different
    tokens within a few steps."""
    return sorted(set(rollout.stop_token_ids(model, tokenizer)) | set(extra))


@pytest.mark.parametrize("family", VLM_FAMILIES + TEXT_FAMILIES)
def test_lean_loop_samples_what_generate_samples(family_models, family, monkeypatch):
    """12 completions of two prompts (prefilled once each where the family shares prompts) whose rows stop at
    different tokens: finished rows leave the lean loop's batch, and every token equals generate's."""
    model, processor = family_models(family)
    tokenizer = getattr(processor, "tokenizer", processor)
    shared = family in SHARED
    index = torch.tensor([0] * 6 + [1] * 6)
    batch = two_prompts(processor, family, index=None if shared else index)
    # rows stop early at an ordinary token (a tenth of the byte tokens stop), and ids that would be drawn are banned
    eos = stop_ids(model, tokenizer, range(3, 259, 10))
    banned = list(range(4, 259, 3))
    kwargs = dict(row_seeds=completion_seeds(0, 0, range(12)), max_new_tokens=16, temperature=1.0,
                  eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, suppress_token_ids=banned,
                  prompt_index=index if shared else None)
    (ids, mask), (ref_ids, ref_mask), moved, sizes = both_decoders(model, batch, monkeypatch, **kwargs)
    assert torch.equal(ids, ref_ids) and torch.equal(mask, ref_mask), family
    lengths = mask.sum(1)
    assert lengths.min() < ids.shape[1] <= lengths.max() + 1, f"{family}: no row stopped early"
    assert not torch.isin(ids[mask.bool()], torch.tensor(banned)).any()
    assert (ids[~mask.bool()] == tokenizer.pad_token_id).all()  # finished rows are padded
    kinds = set(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ["full_attention"])
    if "full_attention" in kinds:
        assert moved > 0, f"{family}: no KV layer was preallocated"
    if "linear_attention" not in kinds:  # recurrent state layers cannot select rows: no compaction there
        assert sizes and sizes[-1] < 12, f"{family}: finished rows were not dropped ({sizes})"


@pytest.mark.parametrize("sampling", [dict(top_k=5), dict(top_p=0.7), dict(top_k=20, top_p=0.9, temperature=0.7),
                                      dict(temperature=0.0)])
@pytest.mark.parametrize("family", ["qwen2_5_vl"])
def test_lean_loop_with_top_k_top_p_and_greedy(family_models, family, sampling, monkeypatch):
    model, processor = family_models(family)
    prompts, _, index = group_batches(processor, family)
    tokenizer = getattr(processor, "tokenizer", processor)
    kwargs = dict(dict(temperature=1.0), **sampling)
    (ids, mask), (ref_ids, ref_mask), _, _ = both_decoders(
        model, prompts, monkeypatch, row_seeds=completion_seeds(3, 1, range(4)), max_new_tokens=10,
        eos_token_id=rollout.stop_token_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id,
        prompt_index=torch.tensor(index), **kwargs)
    assert torch.equal(ids, ref_ids) and torch.equal(mask, ref_mask)
    if sampling.get("temperature") == 0.0:  # greedy: the completions of one prompt are equal
        assert torch.equal(ids[0], ids[1]) and torch.equal(ids[2], ids[3])
    else:
        assert not torch.equal(ids[0], ids[1])


def test_preallocated_layer_holds_what_concatenation_holds():
    from transformers.cache_utils import DynamicLayer

    torch.manual_seed(0)
    grown, first = DynamicLayer(), (torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4))
    grown.update(*first)
    buffered = rollout.PreallocatedLayer(grown, capacity=9)
    storage = buffered.keys.untyped_storage().data_ptr()
    for _ in range(4):
        new = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
        expected, got = grown.update(*new), buffered.update(*new)
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    assert buffered.get_seq_length() == 9 and buffered.keys.untyped_storage().data_ptr() == storage  # no copies


def test_an_unknown_decoder_is_refused(family_models):
    model, processor = family_models("qwen3")
    with pytest.raises(ValueError, match="decoder 'fast'"):
        rollout.generate_completions(model, {}, row_seeds=None, max_new_tokens=1, temperature=1.0, eos_token_id=[0],
                                     pad_token_id=0, decoder="fast")


def test_decode_processors_score_as_generate_processors():
    """The loop's processors give generate's scores: a minimum length the prompt reaches is dropped (a longer one
    kept, and it still masks EOS), suppression with its mask built once gives SuppressTokensLogitsProcessor's -inf."""
    from transformers.generation import logits_process as lp

    torch.manual_seed(0)
    ids, scores = torch.zeros(3, 6, dtype=torch.long), torch.randn(3, 11)
    reference = [lp.MinLengthLogitsProcessor(6, eos_token_id=[2]), lp.SuppressTokensLogitsProcessor([1, 7])]
    kept = rollout.decode_processors(reference, prompt_length=6, device="cpu")
    assert len(kept) == 1 and isinstance(kept[0], rollout.SuppressedTokens)
    assert torch.equal(kept[0](ids, scores), reference[1](ids, scores))
    longer = [lp.MinLengthLogitsProcessor(8, eos_token_id=[2])]
    assert rollout.decode_processors(longer, prompt_length=6, device="cpu") == longer
