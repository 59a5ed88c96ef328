"""The tiny edit generator (tiny/edit_generator.py): a small build on a fixture Qwen-Image pipeline saves a
QwenImageEditPipeline folder that the edit adapter loads and edits with; its training batch puts the input image's
latents beside the noise, as the edit path does at inference; the edit-success metric on hand-made cases."""

import json
import os

import pytest
import torch

from tiny.edit_generator import (
    SUMMARY,
    edit_loss,
    edit_outcome,
    edit_texts,
    encode_edit_rows,
    load_generator,
    outcome_table,
    to_tensor,
)
from tiny.edits import edit_triples
from tiny.generator import sample_images
from tiny.generator_config import TinyEditGeneratorConfig
from tiny.pipelines import make_tiny_qwenimage
from tiny.shapes import render_objects

SIZE = 32
pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def triples():
    return edit_triples(10, seed=3, image_size=SIZE)  # two of each kind


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(fixture generator folder, a 2-step edit build from it on 8 triples)."""
    from tiny.edit_generator import build_tiny_edit_generator

    base = make_tiny_qwenimage(tmp_path_factory.mktemp("generator"), layers=1, base_dim=8)
    cfg = TinyEditGeneratorConfig(output_dir=str(tmp_path_factory.mktemp("edit") / "out"), generator=base,
                                  train_rows=8, steps=2, batch_size=4, log_every=1)
    return base, build_tiny_edit_generator(cfg, log=lambda msg: None)


def test_built_folder_loads_through_the_edit_adapter_and_edits(built, triples):
    from diffusers import DiffusionPipeline, QwenImageTransformer2DModel

    from utils.t2i.adapters import QwenImageGenerator, load_flow_generator

    base, path = built
    assert DiffusionPipeline.load_config(path)["_class_name"] == "QwenImageEditPipeline"
    gen = load_flow_generator(path, edit_area=SIZE * SIZE)
    assert type(gen) is QwenImageGenerator and gen.edit is not None
    before = to_tensor([r["image_before"] for r in triples[:3]])
    out = sample_images(gen, edit_texts(triples[:3]), size=SIZE, num_steps=2, images=before, image_scale=1.5,
                        interval=(0.4, 1.0))
    assert out.shape == (3, 3, SIZE, SIZE) and 0 <= out.min() and out.max() <= 1
    # the generator's VAE and frozen text encoder, as they were; the transformer trained from its
    source = load_generator(base, SIZE)
    for mine, theirs in ((gen.vae, source.vae), (gen.text_encoder, source.text_encoder)):
        for (name, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    start = QwenImageTransformer2DModel.from_pretrained(os.path.join(base, "transformer")).state_dict()
    assert any(not torch.equal(a, start[k]) for k, a in gen.transformer.state_dict().items())
    with open(os.path.join(path, SUMMARY)) as f:
        assert json.load(f)["generator_path"] == os.path.abspath(base)


def test_training_batch_puts_the_input_image_beside_the_noise(built, triples):
    """edit_loss feeds the transformer [noisy target tokens | input-image tokens] with the text read beside the input
    image, exactly the tokens and text states the adapter's edit path builds at inference; a row trained without
    the image gets the noise tokens alone."""
    gen = load_generator(built[0], SIZE)
    rows = [r for r in triples if r["kind"] != "none"][:4]
    data = encode_edit_rows(gen, rows, SIZE)
    before = to_tensor([r["image_before"] for r in rows])
    infer = gen.encode_condition(edit_texts(rows), before, height=SIZE, width=SIZE, negative_prompt=None)
    seen = []
    real = gen.denoiser

    def spy(**kw):
        seen.append(kw)
        return real(**kw)

    gen.denoiser = spy
    idx = torch.arange(len(rows))
    cfg = TinyEditGeneratorConfig(cfg_dropout=0.0, image_dropout=0.0)
    edit_loss(gen, data, idx, torch.Generator().manual_seed(0), cfg)
    hidden, n = seen[0]["hidden_states"], data["target"].shape[1]
    assert hidden.shape[1] == 2 * n and seen[0]["img_shapes"][0] == infer.shared["img_shapes"]
    torch.testing.assert_close(hidden[:, n:], infer.image_latents, atol=1e-6, rtol=0)
    assert not torch.allclose(hidden[:, n:], data["target"], atol=1e-3)  # the input, not the edited scene
    torch.testing.assert_close(seen[0]["encoder_hidden_states"], infer.pos["embeds"], atol=1e-6, rtol=0)
    seen.clear()
    edit_loss(gen, data, idx, torch.Generator().manual_seed(0), TinyEditGeneratorConfig(image_dropout=0.99,
                                                                                      cfg_dropout=0.0))
    assert seen[0]["hidden_states"].shape[1] == n and len(seen[0]["img_shapes"][0]) == 1


def test_edit_success_metric_on_hand_made_cases(triples):
    by_kind = {r["kind"]: r for r in triples}
    assert edit_outcome(by_kind["none"]["image_before"], by_kind["none"])["success"]  # identity on "no edit"
    assert edit_outcome(by_kind["add"]["image_before"], by_kind["add"]) == dict(success=False, kept=True,
                                                                                carried=False)
    for r in triples:  # the target render is always a success
        assert edit_outcome(r["image_after"], r)["success"], r["id"]
    # the edit carried out but another object removed: not kept
    row = by_kind["recolor"]
    after = json.loads(row["after"])
    other = next(o for o in after if o["cell"] != json.loads(row["edit"])["cell"])
    broken = render_objects([o for o in after if o is not other], SIZE)
    assert edit_outcome(broken, row) == dict(success=False, kept=False, carried=True)
    table = outcome_table(to_tensor([r["image_before"] for r in triples]), triples)
    assert table["none"]["success"] == 1.0 and table["all"]["success"] == 0.2 and table["add"]["kept"] == 1.0


def test_cached_build_is_keyed_by_the_generator_it_starts_from(tmp_path, monkeypatch):
    import tiny.cache as cache

    monkeypatch.setattr(cache, "CACHE_DIR", str(tmp_path))
    base = {"name": str(tmp_path / "tiny-generator-aaaa")}
    monkeypatch.setattr(cache, "tiny_generator_path", lambda: base["name"])
    calls = []

    def fake_build(cmd, **kw):
        calls.append(cmd)
        os.makedirs(cmd[cmd.index("--output_dir") + 1])

    monkeypatch.setattr("subprocess.run", fake_build)
    first = cache.tiny_edit_generator_path(steps=3)
    assert os.path.basename(first).startswith(cache.TINY_EDIT_GENERATOR + "-") and f"--generator={base['name']}" in \
        calls[0] and "--steps=3" in calls[0]
    assert cache.tiny_edit_generator_path(steps=3) == first and len(calls) == 1  # reused
    base["name"] = str(tmp_path / "tiny-generator-bbbb")  # a rebuilt generator: a new edit generator
    assert cache.tiny_edit_generator_path(steps=3) != first and len(calls) == 2
    with pytest.raises(ValueError, match="--cfg_dropout"):
        cache.tiny_edit_generator_path(image_dropout=0.95)


def test_pick_rows_swaps_in_no_change_rows():
    """copy_steps: the first steps train on "no change" rows alone; copy_share: a share of the later rows; neither
    set: the batch as drawn, and nothing drawn from the generator (a default build's batches stay as they were)."""
    from tiny.edit_generator import pick_rows

    idx, copy_rows = torch.arange(100, 164), torch.tensor([0, 5, 10])
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert torch.equal(pick_rows(idx, g, 0, copy_rows, TinyEditGeneratorConfig()), idx)
    assert torch.equal(g.get_state(), state)
    first = TinyEditGeneratorConfig(copy_steps=10)
    assert set(pick_rows(idx, g, 9, copy_rows, first).tolist()) <= {0, 5, 10}
    assert torch.equal(pick_rows(idx, g, 10, copy_rows, first), idx)
    mixed = pick_rows(idx, g, 0, copy_rows, TinyEditGeneratorConfig(copy_share=0.5))
    swapped = (mixed < 100).sum().item()
    assert 16 <= swapped <= 48 and torch.equal(mixed[mixed >= 100], idx[mixed >= 100])


def test_later_config_fields_leave_the_first_builds_cache_keys_alone():
    """A config with the first builds' values keys as those builds did (no copy_share, copy_steps, zero_cond_t)."""
    first = TinyEditGeneratorConfig(zero_cond_t=False, steps=1000).spec()
    assert not {"copy_share", "copy_steps", "zero_cond_t"} & set(first)
    assert TinyEditGeneratorConfig(steps=1000, copy_steps=5).spec() == first | dict(zero_cond_t=True, copy_steps=5)
    with pytest.raises(ValueError, match="--copy_share"):
        TinyEditGeneratorConfig(copy_share=1.5)


def test_zero_cond_t_modulates_the_input_image_tokens_alone(built, triples, tmp_path):
    """zero_cond_t changes what the input image's tokens see (timestep 0), not a row without them, and survives
    the save."""
    from diffusers import QwenImageTransformer2DModel

    from tiny.edit_generator import set_zero_cond_t

    gen = load_generator(built[0], SIZE)
    data = encode_edit_rows(gen, triples[:2], SIZE)
    embeds, mask = data["pos"][0][None], None
    x, t = torch.randn(data["target"][:1].shape, generator=torch.Generator().manual_seed(0)), torch.tensor([700.0])

    def velocities():
        with torch.no_grad():
            edit = gen.condition_from_embeds(embeds, mask, height=SIZE, width=SIZE, image_latents=data["source"][:1])
            plain = gen.condition_from_embeds(embeds, mask, height=SIZE, width=SIZE)
            return gen.velocity(x, t, edit), gen.velocity(x, t, plain)

    before = velocities()
    set_zero_cond_t(gen.transformer)
    after = velocities()
    assert not torch.allclose(before[0], after[0], atol=1e-4)
    torch.testing.assert_close(before[1], after[1], atol=1e-6, rtol=0)
    gen.transformer.save_pretrained(tmp_path)
    loaded = QwenImageTransformer2DModel.from_pretrained(tmp_path)
    assert loaded.config.zero_cond_t and all(b.zero_cond_t for b in loaded.transformer_blocks)
