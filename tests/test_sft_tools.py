"""SFT on tool-use conversations: LLaMA-Factory's sharegpt `function_call` / `observation` turns with a `tools`
column and TRL's `tool_calls` / `tool` messages load to the same conversation, train on the assistant turns (tool
calls included) only, with tool results (text and images) masked like prompts, and the bad ones are refused naming
the file, row and column."""

import json

import pytest
import torch
from PIL import Image

from utils.core.data import load_sharegpt
from utils.core.errors import DataValidationError
from utils.core.sft_data import IGNORE_INDEX, encode_sft_batch, sharegpt_conversation, sharegpt_tools
from utils.core.tools import tool_schema

CALL = {"name": "zoom_image", "arguments": {"box": [0, 0, 500, 500]}}


def zoom_image(box: list[int]):
    """Zoom.

    Args:
        box: The region.
    """


def _png(path, colour):
    Image.new("RGB", (84, 84), colour).save(path)
    return path.name


def _rows(tmp_path):
    a, b = _png(tmp_path / "a.png", (200, 0, 0)), _png(tmp_path / "b.png", (0, 200, 0))
    bare = [{k: v for k, v in tool_schema(zoom_image)["function"].items()}]  # LLaMA-Factory: bare functions
    llama_factory = {"conversations": [{"from": "human", "value": "<image>What shape is top left?"},
                                       {"from": "function_call", "value": json.dumps(CALL)},
                                       {"from": "observation", "value": "<image>"},
                                       {"from": "gpt", "value": "<answer>circle</answer>"}],
                     "images": [a, b], "tools": json.dumps(bare)}
    trl = {"conversations": [{"role": "user", "content": "<image>What shape is top left?"},
                             {"role": "assistant", "content": None,
                              "tool_calls": [{"type": "function", "function": CALL}]},
                             {"role": "tool", "content": "<image>"},
                             {"role": "assistant", "content": "<answer>circle</answer>"}],
           "images": [a, b], "tools": json.dumps([tool_schema(zoom_image)])}
    return llama_factory, trl


def _load(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_sharegpt(str(path), messages_column="conversations")


def test_llama_factory_and_trl_tool_rows_are_the_same_conversation(tmp_path):
    llama_factory, trl = _rows(tmp_path)
    a, b = _load(tmp_path, [llama_factory], "lf.jsonl")[0], _load(tmp_path, [trl], "trl.jsonl")[0]
    assert sharegpt_conversation(a)[0] == sharegpt_conversation(b)[0]
    messages = sharegpt_conversation(a)[0]
    assert messages[1]["tool_calls"] == [{"type": "function", "function": CALL}]
    assert messages[2] == {"role": "tool", "content": [{"type": "image"}]}
    assert sharegpt_tools(a) == sharegpt_tools(b) == [tool_schema(zoom_image)]


def test_labels_cover_the_tool_call_and_the_answer_not_the_tool_result(tmp_path, family_models):
    _, processor = family_models("qwen2_5_vl")
    tokenizer = processor.tokenizer
    row = _load(tmp_path, [_rows(tmp_path)[0]])[0]
    messages, images = sharegpt_conversation(row)
    batch = encode_sft_batch(processor, [messages], [images], sample_ids=["t"], tools=[sharegpt_tools(row)])
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    call_text = '<tool_call>\n{"name": "zoom_image", "arguments": {"box": [0, 0, 500, 500]}}\n</tool_call>'
    expected = (tokenizer(call_text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
                + tokenizer("<answer>circle</answer>", add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
    assert labels[labels != IGNORE_INDEX].tolist() == expected
    # both images (the prompt's and the tool's) are in the sequence, neither is labelled
    image_positions = ids == processor.image_token_id
    assert int(image_positions.sum()) == 18 and (labels[image_positions] == IGNORE_INDEX).all()
    text = tokenizer.decode(ids)
    assert "<tools>" in text and '"name": "zoom_image"' in text and "<tool_response>" in text


@pytest.mark.parametrize("turns, message", [
    ([{"from": "human", "value": "q"}, {"from": "function_call", "value": "{not json"}],
     "message 1: the tool call is not JSON"),
    ([{"from": "human", "value": "q"}, {"from": "function_call", "value": json.dumps({"arguments": {}})}],
     "message 1: a tool call needs a name"),
    ([{"from": "human", "value": "q"}, {"from": "observation", "value": "r"}, {"from": "gpt", "value": "a"}],
     "message 1 is a tool result that follows no tool call"),
])
def test_bad_tool_turns_name_file_row_and_column(tmp_path, turns, message):
    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    with pytest.raises(DataValidationError, match=r"rows.jsonl row 1, column 'conversations': " + message):
        _load(tmp_path, [good, {"conversations": turns}])


def test_plain_rows_keep_their_two_key_messages(tmp_path):
    rows = _load(tmp_path, [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}])
    assert rows[0]["conversations" if "conversations" in rows.column_names else "messages"] == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


@pytest.mark.slow
def test_train_sft_runs_on_tool_conversations(tmp_path):
    import train_sft
    from tests.launch_helpers import fresh_accelerate_state
    from tiny.models import make_tiny_vlm

    llama_factory, _ = _rows(tmp_path)
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps({**llama_factory, "messages": llama_factory.pop("conversations")}) + "\n")
    model = make_tiny_vlm(tmp_path / "qwen", seed=0)
    out = tmp_path / "run"
    try:
        train_sft.main(train_sft.SFTConfig(model_name_or_path=model, dataset_name=str(data), dataset_format="sharegpt",
                                           output_dir=str(out), max_steps=3, per_device_train_batch_size=1,
                                           learning_rate=1e-3, report_to="none", save_steps=3, logging_steps=1))
    finally:
        fresh_accelerate_state()
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 3 and losses[-1] < losses[0] and torch.isfinite(torch.tensor(losses)).all()
