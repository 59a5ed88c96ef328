"""The tiny model families of tiny/models.py as the family tests use them (the `family_models` fixture of
tests/conftest.py builds each once per session)."""

from tiny.tokenizer import ALL_FAMILIES

VLM_FAMILIES = list(ALL_FAMILIES)
TEXT_FAMILIES = ["qwen3"]


def build_family(out, family):
    """(model in eval mode, processor or tokenizer) of a tiny `family`, saved to `out` and loaded back as a user
    would load it."""
    from tiny.models import make_tiny_llm, make_tiny_vlm
    from utils.models import load_model_and_processor

    if family in TEXT_FAMILIES:
        make_tiny_llm(out, family=family, seed=0)
    else:
        make_tiny_vlm(out, family=family, seed=0)
    model, processor = load_model_and_processor(out, dtype="float32")
    return model.eval(), processor
