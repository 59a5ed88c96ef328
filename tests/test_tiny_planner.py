"""tiny/planner.py: the shape-reading probe, and the cached tiny planner reading the prompt."""

import pytest
import torch

from tiny.models import make_tiny_vlm
from tiny.planner import load_planner, planner_plans, shape_reading
from tiny.shapes import SHAPES


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return load_planner(make_tiny_vlm(tmp_path_factory.mktemp("vlm"), vocab_size=1024, seed=0))


def test_shape_reading_is_exactly_chance_when_nothing_flows_from_the_prompt(vlm):
    model, processor = vlm
    reading = shape_reading(model, processor)
    assert abs(reading - 1 / len(SHAPES)) > 1e-5  # an untrained model's output moves a little with the prompt
    saved = {}
    for i, layer in enumerate(model.model.language_model.layers):  # no attention output: each position sees itself
        saved[i] = layer.self_attn.o_proj.weight.detach().clone()
        layer.self_attn.o_proj.weight.data.zero_()
    try:
        assert shape_reading(model, processor) == pytest.approx(1 / len(SHAPES), abs=1e-6)
    finally:
        for i, layer in enumerate(model.model.language_model.layers):
            layer.self_attn.o_proj.weight.data.copy_(saved[i])


@pytest.mark.full
@pytest.mark.slow
def test_the_tiny_planner_reads_the_prompt():
    """The default tiny planner (shipped in tiny/weights/, about 2 CPU minutes to retrain): it names the prompt's
    shape and most of its greedy plans name exactly the requested objects (the 384-token tiny VLM stays at chance,
    1/3, and 13 of 120)."""
    from tiny.generator import heldout_rows
    from tiny.t2i import plan_matches_request

    torch.set_num_threads(1)
    model, processor = load_planner("tiny-planner")
    assert shape_reading(model, processor) > 0.9
    rows = heldout_rows(120)
    right = sum(plan_matches_request(p, r) for p, r in zip(planner_plans(model, processor, rows), rows))
    assert right >= 80, right
