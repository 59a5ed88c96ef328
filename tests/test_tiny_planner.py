"""tiny/planner.py: the shape-reading probe, and the cached tiny planner reading the prompt."""

import pytest
import torch

from tiny.models import make_tiny_vlm
from tiny.planner import colour_reading, load_planner, planner_plans, shape_reading
from tiny.shapes import DEFAULT_COLORS, SHAPES


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return load_planner(make_tiny_vlm(tmp_path_factory.mktemp("vlm"), vocab_size=1024, seed=0))


def test_shape_and_colour_reading_are_exactly_chance_when_nothing_flows_from_the_prompt(vlm):
    model, processor = vlm
    assert abs(shape_reading(model, processor) - 1 / len(SHAPES)) > 1e-5  # an untrained model moves a little
    assert abs(colour_reading(model, processor) - 1 / len(DEFAULT_COLORS)) > 1e-5
    saved = {}
    for i, layer in enumerate(model.model.language_model.layers):  # no attention output: each position sees itself
        saved[i] = layer.self_attn.o_proj.weight.detach().clone()
        layer.self_attn.o_proj.weight.data.zero_()
    try:
        assert shape_reading(model, processor) == pytest.approx(1 / len(SHAPES), abs=1e-6)
        assert colour_reading(model, processor) == pytest.approx(1 / len(DEFAULT_COLORS), abs=1e-6)
    finally:
        for i, layer in enumerate(model.model.language_model.layers):
            layer.self_attn.o_proj.weight.data.copy_(saved[i])


@pytest.mark.full
@pytest.mark.slow
def test_the_tiny_planner_reads_the_prompt():
    """The default tiny planner (shipped in tiny/weights/, about 2 CPU minutes to retrain): it names the prompt's
    shape and colour, and most of its greedy plans name exactly the requested objects (the 384-token tiny VLM stays
    at chance, 1/3, and 13 of 120)."""
    from tiny.generator import heldout_rows
    from tiny.t2i import plan_matches_request

    torch.set_num_threads(1)
    model, processor = load_planner("tiny-planner")
    assert shape_reading(model, processor) > 0.9
    assert colour_reading(model, processor) > 0.9  # 0.200 (chance) with tied, trained embeddings
    rows = heldout_rows(120)
    right = sum(plan_matches_request(p, r) for p, r in zip(planner_plans(model, processor, rows), rows))
    assert right >= 80, right


def test_colour_reading_is_one_for_a_planner_that_copies_the_prompts_colour(vlm):
    """A stand-in whose next token is the colour named in the prompt (as the plan spells it: no leading space)
    reads colours exactly; one that always writes red reads 1 / len(colours)."""
    _, processor = vlm
    tok = processor.tokenizer
    prompt_ids = {tok.encode(f" {c}", add_special_tokens=False)[0]: tok.encode(c, add_special_tokens=False)[0]
                  for c in DEFAULT_COLORS}

    class Copier(torch.nn.Module):
        def __init__(self, always=None):
            super().__init__()
            self.always = always

        def forward(self, input_ids):
            logits = torch.zeros(1, input_ids.shape[1], len(tok))
            named = [prompt_ids[int(i)] for i in input_ids[0] if int(i) in prompt_ids]
            logits[0, -1, self.always if self.always is not None else named[-1]] = 50.0
            return type("Out", (), {"logits": logits})

    assert colour_reading(Copier(), processor) == pytest.approx(1.0)
    red = tok.encode("red", add_special_tokens=False)[0]
    assert colour_reading(Copier(always=red), processor) == pytest.approx(1 / len(DEFAULT_COLORS))


def test_the_planner_rows_are_the_generator_rows_then_rows_that_all_name_colours():
    from tiny import cache
    from tiny.shapes import PALETTE
    from tiny.t2i import make_t2i_prompts, plan_objects

    rows = cache._planner_sft_rows()
    n, extra = cache.PLANNER_ROWS["n"], cache.PLANNER_COLOUR_ROWS["n"]
    assert len(rows) == n + extra and len({r["id"] for r in rows}) == len(rows)
    assert rows[:n] == cache._plan_rows(n)
    asked = make_t2i_prompts(extra, seed=cache.PLANNER_COLOUR_ROWS["seed"], tags=cache.PLANNER_COLOUR_ROWS["tags"])
    for row, meta in zip(rows[n:], asked):
        question, answer = (m["content"] for m in row["messages"])
        assert question.endswith(meta["prompt"]) and any(f" {c} " in f" {meta['prompt']} " for c in PALETTE)
        planned = {color for color, _ in plan_objects(answer.removeprefix("<think>").removesuffix("</think>"))}
        assert {item["color"] for item in meta["include"]} == planned  # the plan keeps the prompt's colours
