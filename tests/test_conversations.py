"""TRL's prompt formats (utils/core/conversations.py): conversational prompts with parts in any order and turn,
images / image columns, plain-text prompts, the column path building the same conversation, and the checks that
name the file, row and column before any compute."""

import json

import datasets
import pytest
from PIL import Image

from utils.core.conversations import (
    canonical_messages,
    load_prompt_set,
    prompt_images,
    prompt_messages,
    prompt_question,
    reward_columns,
)
from utils.core.errors import DataValidationError


def _png(path, colour):
    Image.new("RGB", (28, 28), colour).save(path)
    return path.name


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


SYSTEM = {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]}


def test_trl_conversation_with_a_system_turn_and_images_in_later_turns(tmp_path):
    a, b = _png(tmp_path / "a.png", (200, 0, 0)), _png(tmp_path / "b.png", (0, 0, 200))
    prompt = [SYSTEM,
              {"role": "user", "content": [{"type": "text", "text": "First:"}, {"type": "image"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "Seen."}]},
              {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Same colour?"}]}]
    path = _jsonl(tmp_path / "train.jsonl", [{"prompt": prompt, "images": [a, b], "solution": "no"}])
    data = load_prompt_set(path)
    row = data[0]
    messages = prompt_messages(row)
    # the parts keep their order and their turn; Arrow's None keys are gone
    assert messages[1]["content"] == [{"type": "text", "text": "First:"}, {"type": "image"}]
    assert messages[3]["content"][0] == {"type": "image"}
    assert [im.getpixel((0, 0)) for im in prompt_images(row)] == [(200, 0, 0), (0, 0, 200)]
    assert reward_columns(data.column_names) == ["images", "solution"]
    assert prompt_question(row) == "Same colour?"


def test_string_user_content_takes_the_images_before_its_text_as_trl_does(tmp_path):
    a = _png(tmp_path / "a.png", (0, 200, 0))
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "What colour?"}], "image": a}])
    row = load_prompt_set(path)[0]
    assert prompt_messages(row) == [{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": "What colour?"}]}]
    assert len(prompt_images(row)) == 1


def test_a_saved_trl_dataset_with_stored_images_loads_unchanged(tmp_path):
    prompt = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Colour?"}]}]
    data = datasets.Dataset.from_dict({"prompt": [prompt], "images": [[Image.new("RGB", (8, 8), "red")]]},
                                      features=datasets.Features({
                                          "prompt": [{"role": datasets.Value("string"), "content": [
                                              {"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
                                          "images": datasets.List(datasets.Image())}))
    data.save_to_disk(str(tmp_path / "saved"))
    loaded = load_prompt_set(str(tmp_path / "saved"))
    assert prompt_messages(loaded[0])[0]["content"][0] == {"type": "image"}


def test_plain_text_prompts_stay_strings_and_refuse_media(tmp_path):
    row = load_prompt_set(_jsonl(tmp_path / "t.jsonl", [{"prompt": "2 + 2 =", "answer": "4"}]))[0]
    assert prompt_messages(row) == "2 + 2 ="
    a = _png(tmp_path / "a.png", (0, 0, 0))
    with pytest.raises(DataValidationError, match=r"p.jsonl row 0, column 'images': a plain-text prompt"):
        load_prompt_set(_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "images": [a]}]))


@pytest.mark.parametrize("prompt, images, message", [
    ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}], 2,
     "1 image placeholder(s) but 2 image(s)"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], 0,
     "the last message (message 1) is an assistant turn"),
    ([{"role": "user", "content": [{"type": "audio"}]}], 0, "message 0, part 0 has type 'audio'"),
    ([{"role": "user", "content": "q"}, SYSTEM, {"role": "user", "content": "r"}], 0,
     "message 1 is a system turn; only the first"),
    ([SYSTEM, {"role": "tool", "content": "x"}, {"role": "user", "content": "q"}], 0,
     "message 1 (tool) comes before any user turn"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}], 0, "tool message after a user turn"),
    ([{"role": "robot", "content": "q"}], 0, "message 0 has role 'robot'"),
])
def test_bad_prompts_name_file_row_and_column_before_compute(tmp_path, prompt, images, message):
    files = [_png(tmp_path / f"{i}.png", (i, i, i)) for i in range(images)]
    good = {"prompt": [{"role": "user", "content": [{"type": "text", "text": "fine"}]}], "images": []}
    path = _jsonl(tmp_path / "bad.jsonl", [good, {"prompt": prompt, "images": files}])
    with pytest.raises(DataValidationError) as err:
        load_prompt_set(path)
    assert str(err.value).startswith(f"{path} row 1, column 'prompt': ") and message in str(err.value)


def test_an_inline_image_payload_is_refused_with_where_to_put_it():
    with pytest.raises(ValueError, match="put the media in the 'images' column"):
        canonical_messages([{"role": "user", "content": [{"type": "image", "image": "x.png"}]}])


def test_the_column_path_builds_the_same_conversation_as_a_trl_row(tmp_path, family_models):
    from utils.core.encoding import encode_prompts

    model, processor = family_models("qwen2_5_vl")
    image = Image.new("RGB", (84, 84), (10, 200, 10))
    columns = {"question": "What colour is the circle?", "image": image, "choices": None}
    system = prompt_messages(columns, prompt_template="think_answer")[0]
    trl_row = {"prompt": [system, {"role": "user", "content": "What colour is the circle?"}], "images": [image]}
    a = encode_prompts(processor, [prompt_messages(columns, prompt_template="think_answer")], [[image]],
                       sample_ids=["vqa"])
    b = encode_prompts(processor, [prompt_messages(trl_row)], [prompt_images(trl_row)], sample_ids=["trl"])
    assert a["input_ids"].tolist() == b["input_ids"].tolist()
    assert (a["pixel_values"] == b["pixel_values"]).all()


def test_the_vqa_columns_still_load_through_the_same_entry(tmp_path):
    from tiny.shapes import make_shapes_vqa

    make_shapes_vqa(4, seed=0).save_to_disk(str(tmp_path / "shapes"))
    data = load_prompt_set(str(tmp_path / "shapes"), require_steps=False)
    assert "question" in data.column_names and prompt_messages(data[0])[-1]["role"] == "user"
