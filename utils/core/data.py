"""Dataset loading and up-front validation of the VQA, sharegpt (SFT) and RL-row formats (docs/data.md).
The text-to-image prompt sets (GenEval, TIIF) are `utils.t2i.data`.

Every loader takes a hub name, a `save_to_disk` folder, a .json/.jsonl/.parquet file or a folder of
such files, maps the user's column names to ours (the train scripts expose them as `--question_column`
and friends), and checks every row before any compute starts. A bad row raises `DataValidationError`
whose message names the file, the row and the column, e.g.

    data/train.jsonl row 17, column 'reference_steps': empty list

Validation cost: it reads the text columns once. Images stored in the dataset (an `Image` feature)
are only checked for presence, never decoded. Image paths are checked to exist and, with
`check_images=True` (the default), opened with PIL's `verify()`, which reads the file header and
checksum but does not decode pixels (2000 rows of 84 px PNGs: about 1 s in all on 2 cores).
Pass `check_images="exists"` for huge path-based sets, or False to skip.

Relative image paths resolve against the folder of the data file that holds the row (for a
`save_to_disk` folder: that folder); a hub dataset with relative paths cannot be resolved.

Where rows come from (files, folders, the hub; error locations) is `utils.core.data_sources`; the column and cell
checks the loaders share are `utils.core.data_checks`.
"""

from __future__ import annotations

import json
import re

import datasets

from utils.core.data_checks import (
    VIDEOS_FEATURE,
    image_cells,
    image_feature_kind,
    replace_columns,
    require_columns,
    steps_cell,
    text_cell,
    video_column_cells,
)
from utils.core.data_sources import Source, open_source
from utils.core.video import VIDEO_MARKER

STANDARD_VQA_COLUMNS = ("id", "image", "question", "answer", "reference_steps", "choices", "difficulty", "source")
ROLES = ("system", "user", "assistant", "tool")
# LLaMA-Factory's role names; its `function_call` turn is an assistant turn that calls tools
SHAREGPT_ROLE_NAMES = {"human": "user", "gpt": "assistant", "system": "system", "observation": "tool",
                       "user": "user", "assistant": "assistant", "tool": "tool"}
IMAGE_MARKER = "<image>"


_LETTERED = re.compile(r"^\s*\(?([A-Za-z])\s*[).:]\s*(.*)$", re.S)


def normalise_choices(choices) -> list[str] | None:
    """Choices as a list of option texts: accepts a list, a dict {"A": text}, a JSON string of
    either, or already-lettered strings ("A) text", "(B) text", "C. text", "D: text")."""
    if choices is None:
        return None
    if isinstance(choices, str):
        text = choices.strip()
        if not text:
            return None
        try:
            choices = json.loads(text)
        except json.JSONDecodeError:
            choices = [line for line in text.splitlines() if line.strip()]
    if isinstance(choices, dict):
        choices = [choices[key] for key in sorted(choices) if choices[key] is not None]
    if not isinstance(choices, (list, tuple)):
        raise ValueError(f"choices must be a list, a dict or a JSON string, got {choices!r}")
    texts = [str(choice) for choice in choices if choice is not None]
    lettered = [_LETTERED.match(text) for text in texts]
    expected = [chr(ord("A") + i) for i in range(len(texts))]
    if texts and all(lettered) and [m.group(1).upper() for m in lettered] == expected:
        texts = [m.group(2).strip() for m in lettered]
    return texts or None


def render_question(question: str, choices=None) -> str:
    """'{question}\\n\\nA) ...\\nB) ...' (docs/data.md); the question alone without choices."""
    options = normalise_choices(choices)
    if not options:
        return question
    lines = [f"{chr(ord('A') + i)}) {text}" for i, text in enumerate(options)]
    return question.rstrip() + "\n\n" + "\n".join(lines)



# --------------------------------------------------------------------------------------------------
# Loaders


def load_vqa(name_or_path, *, split: str = "train", image_column: str = "image", question_column: str = "question",
             answer_column: str = "answer", steps_column: str = "reference_steps", choices_column: str | None = None,
             id_column: str | None = None, difficulty_column: str = "difficulty", source_column: str = "source",
             require_steps: bool = True, check_images=True, video_column: str | None = "video") -> datasets.Dataset:
    """CRYSTAL-style VQA rows with the standard columns id (id_column, else 'id', else the row index),
    image (Image feature), question, answer, reference_steps (list[str]; [] when the column is absent
    and not required), choices (list[str] or None), difficulty, source (None when absent), followed
    by any other columns of the input.

    choices_column=None reads 'choices' and 'options' when present, row by row: a row's non-empty 'choices', else
    its 'options' (the CRYSTAL data set has both columns, and its scripts read them so). Steps given as a JSON string
    or as one step per line are accepted. Images may be stored images or paths (see module doc).

    Videos: `video_column` (when present) holds per row a video, a list of videos or nothing; a video is a file,
    a folder of frames or a list of frame paths (utils.core.video). They become column 'videos'
    (`utils.core.video.videos_of`),
    each probed like an image path (check_images)."""
    table, source = open_source(name_or_path, split)
    required = {question_column: "--question_column", answer_column: "--answer_column"}
    if image_column == "image" and "image" not in table.column_names and video_column in table.column_names:
        image_column = None  # a video-only set needs no --image_column none
    if image_column is not None:  # None: a text-only data set (for text LLMs)
        required[image_column] = "--image_column"
    if require_steps:
        required[steps_column] = "--steps_column"
    if choices_column is not None:
        required[choices_column] = "--choices_column"
    if id_column is not None:
        required[id_column] = "--id_column"
    require_columns(table, source, required)
    choice_columns = ([choices_column] if choices_column is not None
                      else [c for c in ("choices", "options") if c in table.column_names])

    images, many = None, False
    if image_column is not None:
        # A column of image lists gives several images per sample (kept as a list per row).
        kind = image_feature_kind(table.features[image_column])
        many = kind == "images" or (kind == "other" and any(isinstance(v, list) for v in table[image_column]))
        images, _ = image_cells(table, source, image_column, check_images, many=many)
    videos = video_column_cells(table, source, video_column, "video", check_images, "--video_column")
    columns = table.column_names
    questions = [text_cell(source, i, question_column, v) for i, v in enumerate(table[question_column])]
    answers = [text_cell(source, i, answer_column, v) for i, v in enumerate(table[answer_column])]
    steps = ([steps_cell(source, i, steps_column, v, require_steps) for i, v in enumerate(table[steps_column])]
             if steps_column in columns else [[] for _ in range(len(table))])
    choices = [None] * len(table)
    for column in choice_columns:  # the first column with options for a row wins
        for i, value in enumerate(table[column]):
            try:
                value = normalise_choices(value)
            except ValueError as error:
                source.fail(i, column, str(error))
            if choices[i] is None and value:
                choices[i] = value
    id_column = id_column or ("id" if "id" in columns else None)
    ids = ([text_cell(source, i, id_column, v) for i, v in enumerate(table[id_column])] if id_column
           else [str(i) for i in range(len(table))])

    def optional_text(column):
        if column not in columns:
            return [None] * len(table)
        return [None if v is None else str(v) for v in table[column]]

    new = {"id": ids, "question": questions, "answer": answers, "reference_steps": steps, "choices": choices,
           "difficulty": optional_text(difficulty_column), "source": optional_text(source_column)}
    features = {"id": datasets.Value("string"), "question": datasets.Value("string"),
                "answer": datasets.Value("string"), "reference_steps": datasets.List(datasets.Value("string")),
                "choices": datasets.List(datasets.Value("string")), "difficulty": datasets.Value("string"),
                "source": datasets.Value("string")}
    drop = [c for c in (question_column, answer_column, steps_column, *choice_columns, id_column,
                        difficulty_column, source_column) if c]
    if videos is not None:
        new["videos"], features["videos"] = videos, VIDEOS_FEATURE
        drop.append(video_column)
    if images is not None:  # paths, or a one-image list: rewrite as one Image column
        new = {"image": images, **new}
        features["image"] = datasets.List(datasets.Image()) if many else datasets.Image()
        drop.append(image_column)
    elif image_column is None:
        table = table.remove_columns([c for c in ("image",) if c in table.column_names])
    elif image_column != "image":  # a stored Image column is kept as is (no decoding, no copy)
        table = table.remove_columns([c for c in ("image",) if c in table.column_names])
        table = table.rename_column(image_column, "image")
    table = replace_columns(table, new, features, drop)
    extras = [c for c in table.column_names if c not in STANDARD_VQA_COLUMNS]
    standard = [c for c in STANDARD_VQA_COLUMNS if c != "image" or image_column is not None]
    return table.select_columns(standard + extras)


def _json_value(source, row, column, turn, value, what):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            source.fail(row, column, f"message {turn}: {what} is not JSON ({error})")
    return value


def _tool_calls(source: Source, row: int, column: str, turn: int, value) -> list[dict]:
    """TRL's `tool_calls` ([{"type": "function", "function": {"name", "arguments"}}]) from TRL's list or
    LLaMA-Factory's function_call value ({"name", "arguments"} or a list of them, as JSON text or objects)."""
    calls = _json_value(source, row, column, turn, value, "the tool call")
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            source.fail(row, column, f"message {turn}: a tool call needs a name and arguments, got {call!r:.200}")
        arguments = _json_value(source, row, column, turn, function.get("arguments") or {}, "the arguments")
        if not isinstance(arguments, dict):
            source.fail(row, column, f"message {turn}: tool-call arguments must be an object, got {arguments!r:.200}")
        out.append({"type": "function", "function": {"name": function["name"], "arguments": arguments}})
    if not out:
        source.fail(row, column, f"message {turn}: an empty tool call")
    return out


def _messages(source: Source, row: int, column: str, value) -> list[dict]:
    """A sharegpt row's turns as {role, content} (and `tool_calls`, JSON text, on an assistant turn that calls
    tools). LLaMA-Factory's `function_call` turn becomes an assistant turn with tool calls and its `observation` a
    `tool` message; TRL's messages may carry `tool_calls` and `tool` turns as they are."""
    if not isinstance(value, list) or not value:
        source.fail(row, column, f"expected a non-empty list of messages, got {value!r}")
    messages = []
    for turn, message in enumerate(value):
        if not isinstance(message, dict):
            source.fail(row, column, f"message {turn} is not a dict: {message!r}")
        # Arrow gives every message all keys seen in the file, so a missing key reads as None.
        role = message.get("role") if message.get("role") is not None else message.get("from")
        content = message.get("content") if message.get("content") is not None else message.get("value")
        role = SHAREGPT_ROLE_NAMES.get(role, role)
        calls = None
        if role == "function_call":
            role, calls, content = "assistant", _tool_calls(source, row, column, turn, content), ""
        elif message.get("tool_calls"):
            calls = _tool_calls(source, row, column, turn, message["tool_calls"])
            content = content or ""
            if role != "assistant":
                source.fail(row, column, f"message {turn} ({role}) has tool_calls; only assistant turns call tools")
        if role not in ROLES:
            source.fail(row, column, f"message {turn} has role {role!r}; expected one of {ROLES} (or human, gpt, "
                                     "function_call, observation)")
        if not isinstance(content, str):
            source.fail(row, column, f"message {turn} content must be text, got {content!r}")
        if role == "tool" and (not messages or messages[-1]["role"] not in ("assistant", "tool")):
            source.fail(row, column, f"message {turn} is a tool result that follows no tool call")
        messages.append({"role": role, "content": content, **({"tool_calls": json.dumps(calls)} if calls else {})})
    roles = {m["role"] for m in messages}
    if "user" not in roles or "assistant" not in roles:
        source.fail(row, column, f"needs at least one user and one assistant message, has roles {sorted(roles)}")
    return messages


def _tools_cell(source: Source, row: int, column: str, value) -> str | None:
    """A row's tool schemas as JSON text of [{"type": "function", "function": {...}}] (LLaMA-Factory writes the
    bare function objects; either form, as JSON text or objects)."""
    if value is None or value == "" or value == []:
        return None
    tools = value
    if isinstance(value, str):
        try:
            tools = json.loads(value)
        except json.JSONDecodeError as error:
            source.fail(row, column, f"not a JSON list of tool schemas ({error})")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        source.fail(row, column, f"expected a list of tool schemas, got {value!r:.200}")
    out = []
    for tool in tools:
        function = tool.get("function", tool)
        if not isinstance(function.get("name"), str):
            source.fail(row, column, f"a tool schema without a name: {tool!r:.200}")
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return json.dumps(out)


def _check_markers(source, row, text_column, images_column, texts: list[str], n_images: int,
                   marker: str = IMAGE_MARKER) -> None:
    markers = sum(text.count(marker) for text in texts)
    if markers != n_images:
        what = "video" if marker == VIDEO_MARKER else "image"
        source.fail(row, text_column, f"{markers} '{marker}' marker(s) but {n_images} {what}(s) "
                                      f"in column '{images_column}'")



def load_sharegpt(name_or_path, *, split: str = "train", messages_column: str = "messages",
                  images_column: str = "images", check_images=True, videos_column: str = "videos",
                  tools_column: str = "tools") -> datasets.Dataset:
    """LLaMA-Factory/OpenVLThinker sharegpt SFT rows -> columns messages (list of {role, content};
    'from'/'value' and human/gpt are accepted and renamed), images (list of Image; [] without an images
    column), then any other columns. The number of '<image>' markers over a row's messages must equal
    its number of images; likewise '<video>' markers and the videos of `videos_column` (LLaMA-Factory's
    convention; a video is a file, a frame folder or a list of frame paths), which become column 'videos'.

    Tool use: LLaMA-Factory's `function_call` / `observation` turns and TRL's assistant `tool_calls` / `tool`
    turns; their messages then also hold `tool_calls` (JSON text, None on other turns), and `tools_column` (the
    schemas, JSON text or a list) becomes column 'tools' (JSON text). An observation's `<image>` markers count
    with the others."""
    table, source = open_source(name_or_path, split)
    require_columns(table, source, {messages_column: "--messages_column"})
    videos = video_column_cells(table, source, videos_column, "videos", check_images, "--videos_column")
    if images_column in table.column_names:
        images, counts = image_cells(table, source, images_column, check_images, many=True)
    else:  # text-only rows
        images, counts = [[] for _ in range(len(table))], [0] * len(table)
    messages = []
    for row, value in enumerate(table[messages_column]):
        turns = _messages(source, row, messages_column, value)
        _check_markers(source, row, messages_column, images_column, [m["content"] for m in turns], counts[row])
        _check_markers(source, row, messages_column, videos_column, [m["content"] for m in turns],
                       len(videos[row]) if videos is not None else 0, VIDEO_MARKER)
        messages.append(turns)
    message = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    if any("tool_calls" in m for turns in messages for m in turns):
        message["tool_calls"] = datasets.Value("string")
        messages = [[{**m, "tool_calls": m.get("tool_calls")} for m in turns] for turns in messages]
    new = {"messages": messages}
    features = {"messages": datasets.List(message), "images": datasets.List(datasets.Image())}
    drop = [messages_column]
    if tools_column in table.column_names:
        new["tools"] = [_tools_cell(source, row, tools_column, v) for row, v in enumerate(table[tools_column])]
        features["tools"] = datasets.Value("string")
        drop.append(tools_column)
    if videos is not None:
        new["videos"], features["videos"] = videos, VIDEOS_FEATURE
        drop.append(videos_column)
    if images is not None:
        new["images"] = images
        drop.append(images_column)
    elif images_column != "images":
        table = (table.remove_columns([c for c in ("images",) if c in table.column_names])
                 .rename_column(images_column, "images"))
    table = replace_columns(table, new, features, drop)
    order = ["messages", "images"]
    return table.select_columns(order + [c for c in table.column_names if c not in order])


def load_rl_rows(name_or_path, *, split: str = "train", images_column: str = "images", problem_column: str = "problem",
                 answer_column: str = "answer", check_images=True, videos_column: str = "videos") -> datasets.Dataset:
    """OpenVLThinker RL rows -> columns images (list of Image; a single image or path is wrapped),
    problem, answer (text), then any other columns. When a problem contains '<image>' markers their
    number must equal its number of images; likewise '<video>' markers and `videos_column` (-> 'videos')."""
    table, source = open_source(name_or_path, split)
    require_columns(table, source, {images_column: "--images_column", problem_column: "--problem_column",
                                     answer_column: "--answer_column"})
    images, counts = image_cells(table, source, images_column, check_images, many=True)
    videos = video_column_cells(table, source, videos_column, "videos", check_images, "--videos_column")
    problems = []
    for row, value in enumerate(table[problem_column]):
        problem = text_cell(source, row, problem_column, value)
        if IMAGE_MARKER in problem:
            _check_markers(source, row, problem_column, images_column, [problem], counts[row])
        if VIDEO_MARKER in problem or videos is not None and "<image>" in problem:
            _check_markers(source, row, problem_column, videos_column, [problem],
                           len(videos[row]) if videos is not None else 0, VIDEO_MARKER)
        problems.append(problem)
    answers = [text_cell(source, row, answer_column, value) for row, value in enumerate(table[answer_column])]
    new = {"problem": problems, "answer": answers}
    features = {"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                "images": datasets.List(datasets.Image())}
    drop = [problem_column, answer_column]
    if videos is not None:
        new["videos"], features["videos"] = videos, VIDEOS_FEATURE
        drop.append(videos_column)
    if images is not None:
        new = {"images": images, **new}
        drop.append(images_column)
    elif images_column != "images":
        table = (table.remove_columns([c for c in ("images",) if c in table.column_names])
                 .rename_column(images_column, "images"))
    table = replace_columns(table, new, features, drop)
    order = ["images", "problem", "answer"]
    return table.select_columns(order + [c for c in table.column_names if c not in order])


def images_of(row):
    """A row's images as a list (a single image, a list of images, or none)."""
    image = row.get("image")
    if image is None:
        return []
    return list(image) if isinstance(image, (list, tuple)) else [image]
