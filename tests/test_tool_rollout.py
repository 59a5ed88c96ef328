"""The multi-turn tool rollout (utils/core/tool_rollout.py) and the training passes over its trajectories
(utils/core/trajectories.py through utils/core/logprobs.py and packing.py), on the tiny Qwen2.5-VL and Qwen3-VL:
tool tokens masked, errors returned to the model, budgets, each later segment sampled from exactly the conversation
so far, and log-probs of every model segment equal to a plain forward over the whole trajectory on the padded,
shared-prompt and packed passes."""

import json

import pytest
import torch
from PIL import Image

from utils.core.encoding import encode_prompts
from utils.core.logprobs import CompletionLogProbs
from utils.core.rollout import generate_completions, stop_token_ids
from utils.core.tool_formats import tool_format
from utils.core.tool_rollout import ToolRollout, context_batch, segment_seeds
from utils.core.tools import ToolBox

pytestmark = pytest.mark.usefixtures("two_torch_threads")

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
ZOOM = '<tool_call>\n{"name": "zoom_image", "arguments": {"box": [0, 0, 500, 500]}}\n</tool_call>'


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("broken on purpose")


def _image(size=96):
    image = Image.new("RGB", (size, size), "white")
    image.paste((220, 40, 40), (0, 0, size // 2, size // 2))
    return image


def _setup(family_models, family, max_completion_length=400, max_iterations=None):
    model, processor = family_models(family)
    tokenizer = processor.tokenizer
    stops = stop_token_ids(model, tokenizer)
    fmt = tool_format(processor, [tokenizer.decode([i]) for i in stops])
    toolbox = ToolBox(["zoom_image", broken], timeout=5)
    loop = ToolRollout(processor, toolbox, fmt, stop_ids=stops, max_completion_length=max_completion_length,
                       max_iterations=max_iterations, model_type=model.config.model_type)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape is red?"}]}]
    return model, processor, toolbox, loop, prompt


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def _first(tokenizer, texts):
    ids = [_ids(tokenizer, t) for t in texts]
    width = max(map(len, ids))
    out, mask = torch.full((len(ids), width), tokenizer.pad_token_id), torch.zeros(len(ids), width, dtype=torch.long)
    for i, row in enumerate(ids):
        out[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    return out, mask, None


SCRIPTS = [
    [ZOOM, "<answer>red</answer>"],  # one zoom, then the answer
    ["<answer>blue</answer>"],  # answers at once
    ["<tool_call>\n{oops}\n</tool_call>", "<answer>red</answer>"],  # an unreadable call
    ['<tool_call>\n{"name": "broken", "arguments": {"x": 1}}\n</tool_call>', ZOOM, "<answer>red</answer>"],
]


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_tokens_are_masked_and_errors_go_back_to_the_model(family_models, family):
    model, processor, toolbox, loop, prompt = _setup(family_models, family)
    tokenizer = processor.tokenizer
    traj = _run_rows(loop, processor, toolbox, prompt, SCRIPTS)
    assert traj.tool_calls == [1, 0, 1, 2] and traj.tool_errors == [0, 0, 1, 1] and traj.turns == [2, 1, 2, 3]
    assert not traj.truncated.any()
    for r, script in enumerate(SCRIPTS):
        ids, model_mask = traj.completion_ids[r], traj.model_mask[r]
        n = int(traj.completion_mask[r].sum())
        # the model's tokens are its turns as sampled, in order; everything else is the template's
        assert ids[:n][model_mask[:n].bool()].tolist() == [t for text in script for t in _ids(tokenizer, text)]
        assert traj.tool_tokens[r] == int((model_mask[:n] == 0).sum())
    # the tool image sits in the trajectory's tool tokens, and nowhere in the model's
    image_token = processor.image_token_id
    assert int((traj.completion_ids[0] == image_token).sum()) > 0
    assert not ((traj.completion_ids == image_token) & traj.model_mask.bool()).any()
    # TRL's completion messages: the call, the tool's answer (errors as {"error": ...}), the final turn
    messages = traj.completions[3]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert json.loads(messages[1]["content"][0]["text"]) == {"error": "RuntimeError: broken on purpose"}
    assert messages[3]["content"][0]["type"] == "image" and messages[3]["content"][0]["image"].size[0] > 0
    assert "could not read the tool call" in traj.completions[2][1]["content"][0]["text"]
    assert messages[-1] == {"role": "assistant", "content": "<answer>red</answer>"}
    assert len(traj.tool_images[0]) == 1 and traj.tool_images[1] == []


def _run_rows(loop, processor, toolbox, prompt, scripts, **kwargs):
    """Run the loop with each row's scripted turns (the loop tells which rows are still running by their ids)."""
    tokenizer = processor.tokenizer
    turn = {r: 1 for r in range(len(scripts))}
    prompt_len = len(encode_prompts(processor, [prompt], [[_image()]], sample_ids=["p"],
                                    tools=toolbox.schemas)["input_ids"][0])

    def generate(batch, seeds, room, images):
        rows = []
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            seq = ids[mask.bool()].tolist()[prompt_len:]
            # which row is this? the one whose scripted turns so far open this trajectory
            for r, script in enumerate(scripts):
                first = _ids(tokenizer, script[0])
                if seq[:len(first)] == first and r not in rows and turn[r] < len(script):
                    rows.append(r)
                    break
        texts = []
        for r in rows:
            texts.append(scripts[r][turn[r]])
            turn[r] += 1
        ids = [_ids(tokenizer, t)[:room] for t in texts]
        width = max(map(len, ids))
        out = torch.full((len(ids), width), tokenizer.pad_token_id)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for i, row in enumerate(ids):
            out[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        return out, mask, None

    n = len(scripts)
    return loop.run([prompt] * n, [[_image()]] * n, [str(i) for i in range(n)], torch.arange(n),
                    _first(tokenizer, [s[0] for s in scripts]), generate, pad_token_id=tokenizer.pad_token_id,
                    device="cpu", tools=toolbox.schemas, keys=[0] * n)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_later_segment_is_sampled_from_exactly_the_conversation_so_far(family_models, family):
    """Segment 1 from the loop's context batch equals generate on the rendered conversation (prompt, the call,
    the tool's image) encoded by the processor, with the segment's seeds."""
    model, processor, toolbox, loop, prompt = _setup(family_models, family)
    tokenizer = processor.tokenizer
    stops = stop_token_ids(model, tokenizer)
    seen = {}

    def generate(batch, seeds, room, images):
        ids, mask = generate_completions(model, batch, row_seeds=seeds, max_new_tokens=12, temperature=1.0,
                                         eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
        seen.update(batch=batch, ids=ids, mask=mask)
        return ids, mask, None

    loop.max_iterations = 1
    traj = loop.run([prompt], [[_image()]], ["a"], torch.tensor([7]), _first(tokenizer, [ZOOM]), generate,
                    pad_token_id=tokenizer.pad_token_id, device="cpu", tools=toolbox.schemas)
    zoomed = traj.tool_images[0][0]
    call = {"type": "function", "function": {"name": "zoom_image", "arguments": {"box": [0, 0, 500, 500]}}}
    conversation = prompt + [{"role": "assistant", "content": [], "tool_calls": [call]},
                             {"role": "tool", "name": "zoom_image", "content": [{"type": "image"}]}]
    reference = encode_prompts(processor, [conversation], [[_image(), zoomed]], sample_ids=["a"],
                               tools=toolbox.schemas)
    batch = seen["batch"]
    assert batch["input_ids"].tolist() == reference["input_ids"].tolist()
    for key in reference:
        assert torch.equal(batch[key], reference[key]), key
    expected, _ = generate_completions(model, reference, row_seeds=segment_seeds(torch.tensor([7]), 1),
                                       max_new_tokens=12, temperature=1.0, eos_token_id=stops,
                                       pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(seen["ids"], expected)


def _plain_logps(model, processor, prompt_ids, images, completion, mm_prompt, mm_completion):
    """Log-probs of completion[t] from one forward over prompt + completion with every image, as the model sees it."""
    ids = torch.cat([prompt_ids, completion])[None]
    pixels = processor.image_processor(images=images, return_tensors="pt")
    mm = torch.cat([mm_prompt, mm_completion])[None]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm,
                       pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"]).logits[0].float()
    logps = torch.log_softmax(logits[len(prompt_ids) - 1:-1], -1)
    return logps.gather(-1, completion[:, None])[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_logps_of_every_model_segment_equal_a_plain_forward_on_every_pass(family_models, family):
    model, processor, toolbox, loop, prompt = _setup(family_models, family)
    traj = _run_rows(loop, processor, toolbox, prompt, SCRIPTS)
    prompts = encode_prompts(processor, [prompt], [[_image()]], sample_ids=["p"], tools=toolbox.schemas)
    n = len(SCRIPTS)
    repeated = encode_prompts(processor, [prompt] * n, [[_image()]] * n, sample_ids=list("abcd"),
                              tools=toolbox.schemas)
    label_mask = traj.completion_mask * traj.model_mask
    results = {}
    for name, padding_free, batch, index in (("padded", False, repeated, None), ("shared", False, prompts, [0] * n),
                                             ("packed", True, prompts, [0] * n)):
        policy = CompletionLogProbs(model, padding_free=padding_free)
        with torch.no_grad():
            results[name] = policy(batch, traj.completion_ids, traj.completion_mask, 1.0, prompt_index=index,
                                   completion_inputs=traj.completion_inputs, label_mask=label_mask)
    mm = traj.completion_inputs["mm_token_type_ids"]
    for r in range(n):
        length = int(traj.completion_mask[r].sum())
        plain = _plain_logps(model, processor, prompts["input_ids"][0], [_image()] + traj.tool_images[r],
                             traj.completion_ids[r, :length], prompts["mm_token_type_ids"][0], mm[r, :length])
        keep = label_mask[r, :length].bool()
        for name, logps in results.items():
            assert torch.allclose(logps[r, :length][keep], plain[keep], atol=2e-5), (name, r)
            assert (logps[r, :length][~keep] == 0).all(), name


def test_budget_truncates_and_marks_the_trajectory(family_models):
    model, processor, toolbox, loop, prompt = _setup(family_models, "qwen2_5_vl", max_completion_length=100)
    tokenizer = processor.tokenizer
    # the call fits, its tool result (an image and the template's turn) does not: the trajectory ends truncated
    traj = _run_rows(loop, processor, toolbox, prompt, [[ZOOM, "<answer>red</answer>"]])
    assert traj.truncated.tolist() == [True] and traj.tool_tokens == [0] and traj.turns == [1]
    assert traj.completion_mask.sum() == len(_ids(tokenizer, ZOOM))
    # no more rounds than --max_tool_calling_iterations: the second call is not run
    _, processor, toolbox, loop, prompt = _setup(family_models, "qwen2_5_vl", max_iterations=1)
    traj = _run_rows(loop, processor, toolbox, prompt, [SCRIPTS[3]])
    assert traj.tool_calls == [1] and traj.turns == [2] and not traj.truncated.any()


def test_context_batch_left_pads_rows_of_different_lengths(family_models):
    from utils.core.tool_rollout import _Row

    _, processor = family_models("qwen2_5_vl")
    a = dict(encode_prompts(processor, [[{"role": "user", "content": "hi"}]], [[]], sample_ids=["a"]))
    rows = [_Row(prompt=a, prompt_images=[], ids=[5, 6, 7], model=[1, 1, 1]), _Row(prompt=a, prompt_images=[])]
    batch = context_batch(rows, 0, "cpu")
    n = a["input_ids"].shape[1]
    assert batch["input_ids"].shape == (2, n + 3) and batch["attention_mask"][1, :3].sum() == 0
    assert batch["input_ids"][0, -3:].tolist() == [5, 6, 7]
