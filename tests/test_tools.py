"""Tools (utils/core/tools.py, tool_formats.py, image_tools.py): schemas from signatures and docstrings, timed calls
whose failures become messages for the model, each family's tool-call format read from its chat template (real
templates from TRL's package), and the built-in image tools within the pixel budget."""

import json
import os
import time

import pytest
from PIL import Image

from tests.tool_helpers import broken, sleepy
from tiny.tokenizer import make_tiny_tokenizer
from utils.core.config import ConfigError
from utils.core.image_tools import crop_image, fit_pixels, rotate_image, zoom_image
from utils.core.tool_formats import PROBE_CALL, tool_format
from utils.core.tools import ToolBox, tool_schema

STOPS = ["<|im_end|>", "<|eot_id|>", "<turn|>", "<eos>", "<|tool_response>"]


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def undocumented(x: int):
    return x


def test_schema_comes_from_signature_and_docstring_without_context_keywords():
    schema = tool_schema(zoom_image)
    parameters = schema["function"]["parameters"]
    assert schema["function"]["name"] == "zoom_image" and set(parameters["properties"]) == {"box", "image_index"}
    assert parameters["required"] == ["box"] and "0-1000" in parameters["properties"]["box"]["description"]
    with pytest.raises(ConfigError, match="--tools undocumented: no JSON schema"):
        tool_schema(undocumented)


def test_failures_come_back_as_error_messages_never_a_crash():
    box = ToolBox([add, broken, sleepy], timeout=0.3)
    assert box.call("add", {"a": 2, "b": 3}).content == [{"type": "text", "text": "5"}]
    cases = {("broken", json.dumps({"x": 1})): "RuntimeError: broken tool called with 1",
             ("nope", "{}"): "unknown tool 'nope'",
             ("add", json.dumps({"a": 1})): "bad arguments for add",
             ("add", json.dumps({"a": 1, "b": 2, "images": []})): "'images' is not an argument of add"}
    for (name, args), message in cases.items():
        result = box.call(name, json.loads(args))
        assert result.error and message in result.error and message in result.content[0]["text"]
        assert json.loads(result.content[0]["text"]) == {"error": result.error}
    start = time.perf_counter()
    result = box.call("sleepy", {"seconds": 5})
    assert result.timed_out and "sleepy timed out after 0.3 s" in result.error and time.perf_counter() - start < 2


def test_image_results_and_trl_content_blocks_become_parts():
    def look(kind: str):
        """Look.

        Args:
            kind: What.
        """
        image = Image.new("L", (4, 4))
        return image if kind == "one" else [{"type": "image", "image": image}, {"type": "text", "text": "done"}]

    box = ToolBox([look])
    one, two = box.call("look", {"kind": "one"}), box.call("look", {"kind": "two"})
    assert one.content == [{"type": "image"}] and one.images[0].mode == "RGB"
    assert two.content == [{"type": "image"}, {"type": "text", "text": "done"}] and len(two.images) == 1


def test_builtin_names_and_bad_specs():
    assert list(ToolBox(["crop_image", "zoom_image", "rotate_image"]).functions) == ["crop_image", "zoom_image",
                                                                                    "rotate_image"]
    with pytest.raises(ConfigError, match="not a built-in tool"):
        ToolBox(["zoom"])
    with pytest.raises(ConfigError, match="cannot import it"):
        ToolBox(["no_such_module:f"])


# ---- formats, from the families' real chat templates ----


def _template(name):
    import trl

    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{name}.jinja")) as f:
        return f.read()


class _Templated:
    """A text-only tokenizer under another family's chat template."""

    def __init__(self, template):
        self.template, self.tok = template, make_tiny_tokenizer("qwen2_5_vl")

    def apply_chat_template(self, messages, **kwargs):
        return self.tok.apply_chat_template(messages, chat_template=self.template, **kwargs)


@pytest.mark.parametrize("template, expected", [
    ("qwen3_vl", "hermes"), ("qwen3", "hermes"), ("qwen3_5_nothink", "qwen_xml"), ("gemma4_v5", "gemma4"),
    ("llama3_1", "llama3"), ("qwen2_5_vl", "renders no tool calls"), ("gemma3", "fails on a tool-calling"),
    ("idefics3", "fails on a tool-calling"),
])
def test_each_family_format_is_read_from_its_template_or_refused(template, expected):
    processor = _Templated(_template(template))
    if expected in ("hermes", "qwen_xml", "gemma4", "llama3"):
        fmt = tool_format(processor, STOPS)
        assert fmt.name == expected
        # the parser reads back what the template writes, for a call with nested arguments
        call = {"type": "function", "function": {"name": "zoom_image", "arguments": {"box": [0, 333, 667, 1000],
                                                                                      "note": "a, b"}}}
        head = processor.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True,
                                            tokenize=False)
        text = processor.apply_chat_template([{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "", "tool_calls": [call]}],
                                             tokenize=False)
        message, errors = fmt.parse(text[len(head):].replace("<|im_end|>", "").replace("<|eot_id|>", ""))
        assert message["tool_calls"] == [call] and errors == []
    else:
        with pytest.raises(ConfigError, match=expected):
            tool_format(processor, STOPS, model_name=template)


def test_the_tiny_chatml_template_writes_qwen3_vl_s_tool_turns():
    """Calls and results exactly as Qwen3-VL's released template writes them; the schemas in the same <tools> lines
    of the system turn (without Qwen's English instructions around them, as the tiny templates leave out default
    system prompts)."""
    tiny, qwen3_vl = make_tiny_tokenizer("qwen2_5_vl"), _Templated(_template("qwen3_vl"))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]},
                {"role": "tool", "name": "probe_tool", "content": "r1"},
                {"role": "tool", "name": "probe_tool", "content": "r2"}]
    tools = [tool_schema(add)]
    ours = tiny.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    theirs = qwen3_vl.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    after_system = "<|im_end|>\n<|im_start|>user\n"
    assert ours[ours.index(after_system):] == theirs[theirs.index(after_system):]
    schema_lines = "<tools>\n" + json.dumps(tools[0]) + "\n</tools>"
    assert schema_lines in ours and schema_lines in theirs and ours.startswith("<|im_start|>system\nBe brief.\n\n")
    assert tiny.apply_chat_template(messages[:2], tokenize=False) == qwen3_vl.apply_chat_template(
        messages[:2], tokenize=False).replace("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", "")


def test_bad_calls_are_listed_not_raised():
    fmt = tool_format(make_tiny_tokenizer("qwen2_5_vl"), STOPS)
    message, errors = fmt.parse('Zoom.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
                                "\n<tool_call>\n{oops}\n</tool_call>\n<tool_call>\n{\"name\": \"b\"")
    assert message["content"] == "Zoom." and [c["function"]["name"] for c in message["tool_calls"]] == ["a"]
    assert len(errors) == 2 and "could not read" in errors[0] and "not closed" in errors[1]
    assert fmt.parse("<answer>3</answer>") == ({"role": "assistant", "content": "<answer>3</answer>"}, [])


def test_the_suffix_is_what_the_template_puts_after_the_model_s_stop_token():
    processor = _Templated(_template("qwen3_vl"))
    fmt = tool_format(processor, STOPS)
    suffix = fmt.tool_suffix(processor, {"tool_calls": [PROBE_CALL]},
                             [{"role": "tool", "name": "probe_tool", "content": "42"}])
    assert suffix == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


# ---- image tools ----


def _grid(size=300):
    image = Image.new("RGB", (size, size), "white")
    image.paste((255, 0, 0), (size // 3, 0, 2 * size // 3, size // 3))  # top middle cell red
    return image


def test_crop_and_zoom_return_the_region_within_the_pixel_budget():
    image = _grid()
    crop = crop_image([333, 0, 667, 333], images=[image], max_pixels=84 * 84)
    assert crop.size[0] * crop.size[1] <= 84 * 84 and crop.getpixel((crop.size[0] // 2, crop.size[1] // 2)) == (
        255, 0, 0)
    zoom = zoom_image([333, 0, 667, 333], images=[image], max_pixels=168 * 168)
    assert 160 * 160 <= zoom.size[0] * zoom.size[1] <= 168 * 168  # enlarged to the budget, not past it
    small = crop_image([0, 0, 100, 100], images=[image], max_pixels=84 * 84)
    assert small.size == (30, 30)  # a crop under the budget keeps its own resolution


@pytest.mark.parametrize("kwargs, message", [
    ({"box": [500, 0, 400, 100]}, "0 <= x1 < x2 <= 1000"), ({"box": [0, 0, 1]}, "box must be"),
    ({"box": [0, 0, "a", 1]}, "4 numbers"), ({"box": [0, 0, 10, 10], "image_index": 3}, "image_index 3"),
])
def test_bad_boxes_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        crop_image(images=[_grid()], max_pixels=None, **kwargs)


def test_rotate_keeps_the_whole_image():
    image = Image.new("RGB", (60, 30), "white")
    image.putpixel((0, 0), (0, 0, 255))
    turned = rotate_image(90, images=[image], max_pixels=None)
    assert turned.size == (30, 60) and turned.getpixel((0, 59)) == (0, 0, 255)
    with pytest.raises(ValueError, match="degrees"):
        rotate_image(720, images=[image])
    assert fit_pixels(Image.new("RGB", (200, 100)), 5000).size == (100, 50)


# ---- the tool rewards ----


def test_tool_rewards_read_the_trajectory_and_the_call_counts():
    from rewards import get_reward
    from utils.core.reward_calls import check_reward_call

    ok = [{"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]},
          {"role": "tool", "content": [{"type": "image"}]}, {"role": "assistant", "content": "<answer>3</answer>"}]
    failed = ok[:1] + [{"role": "tool", "content": [{"type": "text", "text": '{"error": "boom"}'}]}] + ok[2:]
    plain = [{"role": "assistant", "content": "<answer>3</answer>"}]
    assert get_reward("tool_format")([ok, failed, plain]) == [1.0, 0.0, None]
    budget = get_reward("tool_budget", max_calls=1, penalty=0.25)
    assert budget([ok, ok, plain], tool_calls=[1, 3, 0]) == [0.0, -0.5, 0.0]
    check_reward_call(budget, "tool_budget", ["answer", "tool_calls"])
    with pytest.raises(ConfigError, match="needs 'tool_calls'"):
        check_reward_call(budget, "tool_budget", ["answer"])  # a run without --tools passes no counts
