"""Tools a policy may call during a rollout (`--tools`), as TRL's GRPOTrainer takes them: plain Python functions
whose JSON schema comes from their signature and Google-style docstring (`transformers.utils.get_json_schema`, what
chat templates render), run with a timeout, with every failure turned into a message for the model (docs/tools.md).

    --tools crop_image zoom_image my_pkg.tools:calculator

A name without `:` is a built-in tool (`BUILTIN_TOOLS`: the image tools of `utils.core.image_tools`). A tool may take
context keywords that are not in its schema and that the rollout fills in (`CONTEXT_KEYWORDS`): `images`, the
conversation's images so far (the prompt's, then those tools returned, in order), and `max_pixels`, the processor's
pixel budget per image. A tool returns text (a string, or any value, shown as JSON or str), a PIL image, or a list of
them (TRL's content blocks `{"type": "image", "image": ...}` / `{"type": "text", "text": ...}` too).

What the model sees when a call fails, instead of a crash: an unknown tool name, arguments that are not a JSON object
or do not fit the signature, an exception inside the tool, a tool that runs past `--tool_timeout` (its thread is left
to finish on its own; its result is dropped) all come back as the tool message `{"error": "..."}`. Exact resume
(utils/core/checkpoint.py) replays a rollout by running its calls again, so a tool must be a deterministic function of
its arguments and context (the built-in ones are); a call that ends close to its timeout may time out in one run and
not in another.
"""

from __future__ import annotations

import importlib
import inspect
import json
import threading
from dataclasses import dataclass, field

from utils.core.config import ConfigError

CONTEXT_KEYWORDS = ("images", "max_pixels")
BUILTIN_TOOLS = {name: f"utils.core.image_tools:{name}" for name in ("crop_image", "zoom_image", "rotate_image")}


def import_tool(spec):
    """A tool function from a built-in name or `module:function` (a callable passes through)."""
    if callable(spec):
        return spec
    path = BUILTIN_TOOLS.get(spec, spec)
    if ":" not in path:
        raise ConfigError(f"--tools {spec!r}: not a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor module:function")
    module_name, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"--tools {spec!r}: cannot import it ({type(err).__name__}: {err})") from None
    if not callable(fn):
        raise ConfigError(f"--tools {spec!r} is not a function")
    return fn


def tool_schema(fn):
    """The function's JSON schema as chat templates render it (TRL's and transformers' `get_json_schema`), with the
    context keywords left out; a signature or docstring it cannot describe is a ConfigError naming the tool."""
    from transformers.utils import get_json_schema

    signature = inspect.signature(fn)
    shown = [p for name, p in signature.parameters.items() if name not in CONTEXT_KEYWORDS]

    def shim(*args, **kwargs):  # only its name, docstring, signature and annotations are read
        raise NotImplementedError

    shim.__name__, shim.__doc__ = fn.__name__, fn.__doc__
    shim.__signature__ = signature.replace(parameters=shown)
    shim.__annotations__ = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if k not in CONTEXT_KEYWORDS}
    try:
        return get_json_schema(shim)
    except Exception as err:  # transformers raises its own exception types for each missing piece
        raise ConfigError(f"--tools {fn.__name__}: no JSON schema from its signature and docstring ({err}); give every "
                          "argument a type hint and a line under 'Args:' in a Google-style docstring") from None


@dataclass
class ToolResult:
    """One call's outcome: the tool message content (parts), the images in it, and what went wrong (None: ok)."""

    name: str
    content: list = field(default_factory=list)
    images: list = field(default_factory=list)
    error: str | None = None
    timed_out: bool = False


def _as_parts(value):
    """A tool's return value as message parts and the images among them."""
    from PIL import Image

    items = value if isinstance(value, (list, tuple)) else [value]
    parts, images = [], []
    for item in items:
        if isinstance(item, dict) and item.get("type") == "image" and isinstance(item.get("image"), Image.Image):
            item = item["image"]
        elif isinstance(item, dict) and item.get("type") == "text" and isinstance(item.get("text"), str):
            item = item["text"]
        if isinstance(item, Image.Image):
            images.append(item.convert("RGB") if item.mode != "RGB" else item)
            parts.append({"type": "image"})
        elif isinstance(item, str):
            parts.append({"type": "text", "text": item})
        else:
            try:
                text = json.dumps(item, ensure_ascii=False)
            except (TypeError, ValueError):
                text = str(item)
            parts.append({"type": "text", "text": text})
    return parts, images


class ToolBox:
    """The run's tools by name, with their schemas (for the chat template) and a timed call."""

    def __init__(self, specs, *, timeout=10.0, max_pixels=None):
        self.functions = {}
        for spec in specs:
            fn = import_tool(spec)
            if fn.__name__ in self.functions:
                raise ConfigError(f"--tools names two tools called {fn.__name__!r}")
            self.functions[fn.__name__] = fn
        self.schemas = [tool_schema(fn) for fn in self.functions.values()]
        self.timeout, self.max_pixels = timeout, max_pixels

    def __bool__(self):
        return bool(self.functions)

    def call(self, name, arguments, *, images=()):
        """Run one call; every failure is a `ToolResult` whose content is `{"error": ...}` for the model."""

        def failed(message, timed_out=False):
            return ToolResult(name, [{"type": "text", "text": json.dumps({"error": message})}], [], message, timed_out)

        fn = self.functions.get(name)
        if fn is None:
            return failed(f"unknown tool {name!r}; the tools are {', '.join(self.functions)}")
        if not isinstance(arguments, dict):
            return failed(f"the arguments of {name} must be a JSON object, got {arguments!r:.100}")
        signature = inspect.signature(fn)
        context = {"images": list(images), "max_pixels": self.max_pixels}
        kwargs = dict(arguments, **{k: v for k, v in context.items() if k in signature.parameters})
        hidden = [k for k in arguments if k in CONTEXT_KEYWORDS]
        try:
            if hidden:
                raise TypeError(f"{hidden[0]!r} is not an argument of {name}")
            signature.bind(**kwargs)
        except TypeError as err:
            return failed(f"bad arguments for {name}: {err}")
        outcome = {}

        def run():
            try:
                outcome["value"] = fn(**kwargs)
            except Exception as err:  # noqa: BLE001 - the model reads what went wrong
                outcome["error"] = f"{type(err).__name__}: {err}"

        thread = threading.Thread(target=run, name=f"tool-{name}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            return failed(f"{name} timed out after {self.timeout:g} s", timed_out=True)
        if "error" in outcome:
            return failed(outcome["error"])
        parts, images = _as_parts(outcome.get("value"))
        return ToolResult(name, parts or [{"type": "text", "text": ""}], images)


def pixel_budget(processor):
    """The processor's most pixels per image (Qwen-style `size["longest_edge"]`, else height x width), None when it
    has no fixed budget."""
    image_processor = getattr(processor, "image_processor", None)
    size = dict(getattr(image_processor, "size", None) or {})
    if size.get("longest_edge") and size.get("shortest_edge") is not None and getattr(
            image_processor, "merge_size", None):
        return int(size["longest_edge"])
    if size.get("height") and size.get("width"):
        return int(size["height"]) * int(size["width"])
    return None
