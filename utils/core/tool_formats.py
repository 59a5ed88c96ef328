"""How each model family writes a tool call, read from its own chat template (docs/tools.md).

`tool_format(processor)` renders a probe conversation (an assistant turn with one tool call, then a tool message)
with the model's chat template and returns the format whose parser reads the probe call back, else refuses the model
with the reason (its template renders no tool calls, drops the tools or the tool results, or writes calls in a form
no parser here reads). The formats:

- `hermes` (Qwen2.5, Qwen3, Qwen3-VL, and the tiny ChatML families): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, results in a user turn as `<tool_response>...</tool_response>`;
- `qwen_xml` (Qwen3.5, Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...`;
- `gemma4` (Gemma 4): `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`, results as `<|tool_response>`;
- `llama3` (Llama 3.1 / 3.2): the whole turn is `{"name": ..., "parameters": {...}}`.

`parse` turns a decoded model segment into TRL's assistant message (`content`: the text before the first call,
`tool_calls`: `[{"type": "function", "function": {"name", "arguments"}}]`) and a list of calls it could not read
(each becomes an error message for the model, never a crash). `tool_suffix` is the text the template puts between
the end of the model's turn and the start of its next one, tool results included: the rollout appends its tokens
after the model's stop token, so the trajectory's ids are exactly the model's own tokens and the template's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from utils.core.config import ConfigError

PROBE_CALL = {"type": "function", "function": {"name": "probe_tool", "arguments": {"query": "probe text", "n": 7}}}
PROBE_SCHEMA = {"type": "function", "function": {
    "name": "probe_tool", "description": "A probe.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "a text"},
                                                    "n": {"type": "integer", "description": "a number"}},
                   "required": ["query", "n"]}}}
PROBE_RESULT = "probe result 4242"


def _json_arguments(raw):
    """Arguments given as a JSON object, or as a JSON string of one (some models quote them)."""
    if isinstance(raw, str):
        raw = json.loads(raw)
    if not isinstance(raw, dict):
        raise ValueError(f"arguments must be a JSON object, got {raw!r:.80}")
    return raw


def _call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


class _Format:
    name = ""
    opener = ""  # where the first call starts (the content before it is the message's text)

    def calls(self, text):
        """[(call or None, error or None)] for each call in `text`."""
        raise NotImplementedError

    def parse(self, text):
        """(assistant message, [errors of calls that could not be read]) for a decoded model turn."""
        start = text.find(self.opener)
        content = text if start < 0 else text[:start].rstrip("\n")
        message = {"role": "assistant", "content": content}
        if start < 0:
            return message, []
        calls, errors = [], []
        for call, error in self.calls(text[start:]):
            if call is not None:
                calls.append(call)
            else:
                errors.append(error)
        if calls:
            message["tool_calls"] = calls
        return message, errors


class Hermes(_Format):
    name, opener = "hermes", "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)

    def calls(self, text):
        out = []
        for match in self._block.finditer(text):
            body, closed = match.group(1).strip(), bool(match.group(2))
            if not closed:
                out.append((None, "the tool call was not closed with </tool_call>"))
                continue
            try:
                parsed = json.loads(body)
                if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
                    raise ValueError('expected {"name": ..., "arguments": {...}}')
                out.append((_call(parsed["name"], _json_arguments(parsed.get("arguments", {}))), None))
            except ValueError as err:
                out.append((None, f"could not read the tool call {body[:120]!r}: {err}"))
        return out


class QwenXML(_Format):
    name, opener = "qwen_xml", "<tool_call>"
    _block = re.compile(r"<tool_call>\s*<function=([^\n>]+)>(.*?)</function>\s*(</tool_call>|$)", re.S)
    _param = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def calls(self, text):
        out = []
        for block in re.split(r"(?=<tool_call>)", text):
            if not block.startswith("<tool_call>"):
                continue
            match = self._block.match(block)
            if not match or not match.group(3):
                out.append((None, f"could not read the tool call {block[:120]!r}"))
                continue
            arguments = {}
            for key, value in self._param.findall(match.group(2)):
                try:
                    arguments[key.strip()] = json.loads(value)
                except ValueError:
                    arguments[key.strip()] = value
            out.append((_call(match.group(1).strip(), arguments), None))
        return out


class Gemma4(_Format):
    name, opener = "gemma4", "<|tool_call>"
    _block = re.compile(r"<\|tool_call>call:(\w+)(\{.*?\})<tool_call\|>", re.S)
    _string = re.compile(r'<\|"\|>(.*?)<\|"\|>', re.S)
    _key = re.compile(r"([{,])\s*([A-Za-z_]\w*)\s*:")

    def to_json(self, body):
        strings = []

        def keep(match):
            strings.append(match.group(1))
            return f"\x00{len(strings) - 1}\x00"

        body = self._key.sub(r'\1"\2":', self._string.sub(keep, body))
        return re.sub("\x00(\\d+)\x00", lambda m: json.dumps(strings[int(m.group(1))]), body)

    def calls(self, text):
        out = []
        for block in re.split(r"(?=<\|tool_call>)", text):
            if not block.startswith("<|tool_call>"):
                continue
            match = self._block.match(block)
            if not match:
                out.append((None, f"could not read the tool call {block[:120]!r}"))
                continue
            try:
                out.append((_call(match.group(1), _json_arguments(json.loads(self.to_json(match.group(2))))), None))
            except ValueError as err:
                out.append((None, f"could not read the arguments of {match.group(1)}: {err}"))
        return out


class Llama3(_Format):
    """Llama 3.1 / 3.2: the whole turn is one JSON object `{"name": ..., "parameters": {...}}`."""

    name, opener = "llama3", '{"name"'

    def calls(self, text):
        try:
            parsed = json.loads(text.strip())
            if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
                raise ValueError('expected {"name": ..., "parameters": {...}}')
            return [(_call(parsed["name"], _json_arguments(parsed.get("parameters", {}))), None)]
        except ValueError as err:
            return [(None, f"could not read the tool call {text[:120]!r}: {err}")]

    def parse(self, text):
        if not text.lstrip().startswith(self.opener):
            return {"role": "assistant", "content": text}, []
        return super().parse(text.lstrip())


FORMATS = (Hermes(), QwenXML(), Gemma4(), Llama3())


def template_messages(processor, messages):
    """Messages as `processor`'s template takes them: a text-only model's template reads string contents."""
    if getattr(processor, "tokenizer", processor) is not processor:
        return messages
    return [{**m, "content": m["content"] if isinstance(m.get("content"), str) else "".join(
        p.get("text", "") for p in m.get("content") or [] if p.get("type") == "text")} for m in messages]


def _render(processor, messages, **kwargs):
    return processor.apply_chat_template(template_messages(processor, messages), tokenize=False, **kwargs)


def _probe_messages():
    return [{"role": "user", "content": [{"type": "text", "text": "hello"}]},
            {"role": "assistant", "content": [], "tool_calls": [PROBE_CALL]}]


def strip_stop_texts(text, stop_texts):
    """`text` without the end-of-turn tokens (and whitespace) it ends with."""
    stops = [s for s in stop_texts if s]
    while True:
        stripped = text.rstrip()
        for stop in stops:
            if stripped.endswith(stop):
                stripped = stripped[: -len(stop)]
        if stripped == text:
            return text
        text = stripped


@dataclass(frozen=True)
class ToolFormat:
    """A model's tool-call format, found from its chat template (`tool_format`)."""

    parser: _Format
    stop_texts: tuple  # the stop tokens as text: the model's turn ends at one of them

    @property
    def name(self):
        return self.parser.name

    def parse(self, text):
        return self.parser.parse(text)

    def tool_suffix(self, processor, assistant, tool_messages):
        """The template's text after the model's stop token: the end of its turn, the tool messages, and the
        opening of its next turn (TRL's `_get_tool_suffix_ids`, in text: the images' placeholders are expanded when
        it is tokenized with them)."""
        head = [{"role": "user", "content": [{"type": "text", "text": "hello"}]},
                {"role": "assistant", "content": [], "tool_calls": assistant.get("tool_calls") or []}]
        prefix = _render(processor, head)
        full = _render(processor, head + list(tool_messages), add_generation_prompt=True)
        if not full.startswith(prefix):
            raise ConfigError("--tools: the chat template renders the assistant's turn differently once a tool result "
                              "follows it, so the tool result cannot be appended to the model's tokens")
        ends = [prefix.rfind(s) + len(s) for s in self.stop_texts if s and prefix.rfind(s) >= 0]
        return full[max(ends) if ends else len(prefix):]


def tool_format(processor, stop_texts, *, model_name="the model"):
    """The tool format of `processor`'s chat template, or a ConfigError that says why the model cannot use tools."""
    try:
        text = _render(processor, _probe_messages())
        with_tools = _render(processor, _probe_messages()[:1], tools=[PROBE_SCHEMA], add_generation_prompt=True)
        with_result = _render(processor, _probe_messages() + [{"role": "tool", "name": "probe_tool", "content": [
            {"type": "text", "text": PROBE_RESULT}]}], add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - a template that fails on tool messages cannot take tools
        raise ConfigError(f"--tools: the chat template of {model_name} fails on a tool-calling conversation "
                          f"({type(err).__name__}: {err})") from None
    head = _render(processor, _probe_messages()[:1], add_generation_prompt=True)
    turn = strip_stop_texts(text[len(head):] if text.startswith(head) else text, stop_texts)
    parser = next((f for f in FORMATS if f.parse(turn)[0].get("tool_calls") == [PROBE_CALL]), None)
    if parser is None:
        why = ("renders no tool calls" if "probe_tool" not in text else
               f"writes tool calls in a form no parser here reads: {turn[:160]!r}")
        raise ConfigError(f"--tools: the chat template of {model_name} {why} (formats read: "
                          f"{', '.join(f.name for f in FORMATS)}); give the model a template with a tool format "
                          "(--chat_template_path)")
    if "probe_tool" not in with_tools or "A probe." not in with_tools:
        raise ConfigError(f"--tools: the chat template of {model_name} does not show the tools' schemas to the model")
    if PROBE_RESULT not in with_result:
        raise ConfigError(f"--tools: the chat template of {model_name} drops tool results (role 'tool')")
    return ToolFormat(parser, tuple(stop_texts))
