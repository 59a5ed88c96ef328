"""Dataset loading and up-front validation of the VQA, sharegpt (SFT) and RL-row formats (docs/data.md).
The text-to-image prompt sets (GenEval, TIIF) are `utils.t2i_data`.

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

Over 400 lines on purpose: the three loaders share one source-and-row bookkeeping (`_Source`) and the
cell checkers, and splitting them would scatter the error-naming rules that make every message the same.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field

import datasets
import PIL.Image
import pyarrow as pa
import pyarrow.compute as pc

from utils.errors import InputError
from utils.video import FRAME_EXTENSIONS, VIDEO_MARKER, VideoError, probe

STANDARD_VQA_COLUMNS = ("id", "image", "question", "answer", "reference_steps", "choices", "difficulty", "source")
DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
SPLIT_WORDS = ("train", "test", "validation", "val", "dev", "eval")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLE_NAMES = {"human": "user", "gpt": "assistant", "system": "system",
                       "user": "user", "assistant": "assistant"}
IMAGE_MARKER = "<image>"


class DataValidationError(InputError):
    """Bad input data; the message names the file, the row and the column at fault."""


# --------------------------------------------------------------------------------------------------
# Where rows come from (for error messages and relative image paths)


@dataclass
class _Source:
    label: str  # what error messages call the data: a file, a folder or a hub name
    base_dir: str | None  # relative image paths resolve against this (None: cannot resolve)
    files: list[tuple[str, int]] = field(default_factory=list)  # (file, rows) in concatenation order

    def _locate(self, row: int) -> tuple[str, int, str | None]:
        start = 0
        for path, count in self.files:
            if row < start + count:
                return path, row - start, os.path.dirname(os.path.abspath(path))
            start += count
        return self.label, row, self.base_dir

    def where(self, row: int) -> str:
        path, local_row, _ = self._locate(row)
        return f"{path} row {local_row}"

    def base_for(self, row: int) -> str | None:
        return self._locate(row)[2]

    def fail(self, row: int, column: str, message: str):
        raise DataValidationError(f"{self.where(row)}, column '{column}': {message}")


def _looks_like_path(name: str) -> bool:
    return (name.startswith((".", "/", "~")) or os.path.splitext(name)[1].lower() in DATA_EXTENSIONS
            or name.count("/") >= 2 or os.sep != "/" and os.sep in name)


def _read_file(path: str) -> datasets.Dataset:
    ext = os.path.splitext(path)[1].lower()
    if ext not in DATA_EXTENSIONS:
        raise DataValidationError(f"{path}: unsupported file type '{ext}'; expected one of {sorted(DATA_EXTENSIONS)}")
    if os.path.getsize(path) == 0:
        raise DataValidationError(f"{path}: the file is empty")
    try:
        return datasets.load_dataset(DATA_EXTENSIONS[ext], data_files=path, split="train")
    except Exception as error:  # datasets wraps parse errors in several exception types
        raise DataValidationError(f"{path}: could not be read as {ext[1:]}: {type(error).__name__}: {error}") from error


def _pick_split(data, split: str, label: str) -> datasets.Dataset:
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataValidationError(f"{label}: no split '{split}'; it has {sorted(data)} (set --split)")
        return data[split]
    return data


def _is_saved_dataset(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, name))
               for name in ("dataset_dict.json", "state.json", "dataset_info.json"))


def _data_files(folder: str, split: str) -> list[str]:
    files = sorted(path for path in glob.glob(os.path.join(folder, "**", "*"), recursive=True)
                   if os.path.splitext(path)[1].lower() in DATA_EXTENSIONS and os.path.isfile(path))
    if not files:
        raise DataValidationError(f"{folder}: neither a save_to_disk dataset nor a folder with "
                                  f"{'/'.join(sorted(DATA_EXTENSIONS))} files")

    def split_of(path):
        words = re.split(r"[\W_]+", os.path.splitext(os.path.relpath(path, folder))[0].lower())
        return next((word for word in words if word in SPLIT_WORDS), None)

    # Files named after splits (train.jsonl, data/test-0000.parquet) are picked by split; otherwise all.
    if any(split_of(path) for path in files):
        chosen = [path for path in files if split_of(path) == split]
        if not chosen:
            found = sorted({split_of(path) for path in files if split_of(path)})
            raise DataValidationError(f"{folder}: no files for split '{split}'; found splits {found} (set --split)")
        return chosen
    return files


def _open(name_or_path, split: str = "train") -> tuple[datasets.Dataset, _Source]:
    if isinstance(name_or_path, (datasets.Dataset, datasets.DatasetDict)):
        return _pick_split(name_or_path, split, "<in-memory dataset>"), _Source("<in-memory dataset>", os.getcwd())
    name = os.fspath(name_or_path)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            return _pick_split(datasets.load_from_disk(path), split, path), _Source(path, os.path.abspath(path))
        files = _data_files(path, split)
        parts = [_read_file(file) for file in files]
        try:
            table = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
        except Exception as error:
            raise DataValidationError(f"{path}: its files do not share one schema ({error}); "
                                      f"files: {files}") from error
        return table, _Source(path, os.path.abspath(path), [(f, len(p)) for f, p in zip(files, parts)])
    if os.path.isfile(path):
        table = _read_file(path)
        return table, _Source(path, os.path.dirname(os.path.abspath(path)), [(path, len(table))])
    if _looks_like_path(name):
        raise DataValidationError(f"{name}: no such file or folder")
    try:
        table = datasets.load_dataset(name, split=split)
    except Exception as error:
        raise DataValidationError(
            f"{name}: not a local file or folder, and loading it from the Hugging Face Hub failed "
            f"({type(error).__name__}: {(str(error).splitlines() or [''])[0]}). Check the name and split, the "
            f"network and HF_DATASETS_OFFLINE (a gated data set also needs its terms accepted on the hub and "
            f"`hf auth login`), or pass a save_to_disk folder or a .json/.jsonl/.parquet file."
        ) from error
    return table, _Source(name, None)


def load_table(name_or_path, *, split: str = "train") -> datasets.Dataset:
    """A `datasets.Dataset` from a save_to_disk folder (Dataset or DatasetDict -> `split`), a
    .json/.jsonl/.parquet file, a folder of such files (files named after splits are picked by
    `split`), or a hub name (`datasets.load_dataset(name, split=split)`). Failures name the input."""
    return _open(name_or_path, split)[0]


# --------------------------------------------------------------------------------------------------
# Column checks shared by the loaders


def _require_columns(table: datasets.Dataset, source: _Source, columns: dict[str, str]) -> None:
    """columns: {column name: the flag that maps it}."""
    if len(table) == 0:
        raise DataValidationError(f"{source.label}: no rows")
    for column, flag in columns.items():
        if column not in table.column_names:
            raise DataValidationError(
                f"{source.where(0)}, column '{column}': not found; the columns are {table.column_names}. "
                f"Map yours with {flag}")


def _image_feature_kind(feature) -> str:
    """'image' (Image feature), 'images' (list of Image), or 'other' (paths, dicts, ...)."""
    if isinstance(feature, datasets.Image):
        return "image"
    inner = getattr(feature, "feature", None)
    if (isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence))
            and isinstance(inner, datasets.Image)):
        return "images"
    return "other"


def _missing_stored(array) -> list[bool]:
    """Per element of an Arrow struct<bytes, path> array: True when it holds no image."""
    missing = pc.or_kleene(pc.is_null(array), pc.and_kleene(pc.is_null(pc.struct_field(array, "bytes")),
                                                          pc.is_null(pc.struct_field(array, "path"))))
    return missing.fill_null(True).to_pylist()


def _check_path(source: _Source, row: int, column: str, value, check) -> str:
    """An absolute path for an image path cell, after checking it exists (and opens)."""
    path = _resolve(source, row, column, value, "image")
    if check and not os.path.isfile(path):
        source.fail(row, column, f"image file not found: '{path}'")
    if check is True:
        try:
            with PIL.Image.open(path) as image:
                image.verify()
        except Exception as error:
            source.fail(row, column, f"unreadable image '{path}': {type(error).__name__}: {error}")
    return path


def _image_cells(table, source, column, check, *, many: bool) -> tuple[list | None, list[int]]:
    """Validate an image column; returns (cells, counts).

    cells: the new per-row values when the column has to be rewritten (paths become absolute paths;
    with many=True a single image is wrapped in a list, with many=False a one-image list is
    unwrapped), or None when the stored column can be kept as it is. counts: images per row.
    Stored images (Image features) are checked for presence in Arrow and never decoded."""
    n_rows = len(table)
    kind = _image_feature_kind(table.features[column])
    if kind != "other":
        array = table.select_columns([column]).with_format("arrow")[column]
        array = array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array
        if kind == "image":
            missing_rows = [row for row, missing in enumerate(_missing_stored(array)) if missing]
            counts = [1] * n_rows
        else:
            parents = pc.list_parent_indices(array).to_pylist()
            missing_rows = [parents[i] for i, missing in enumerate(_missing_stored(pc.list_flatten(array))) if missing]
            counts = pc.list_value_length(array).fill_null(0).to_pylist()
        if missing_rows:
            source.fail(missing_rows[0], column, "missing image")
        if not many and kind == "images":
            for row, count in enumerate(counts):
                if count != 1:
                    source.fail(row, column, f"expected one image, got a list of {count}")
        if (kind == "image") == many:  # reshape needed: materialise the (undecoded) cells
            stored = table.cast_column(column, datasets.Image(decode=False) if kind == "image"
                                       else datasets.List(datasets.Image(decode=False)))[column]
            return ([[cell] for cell in stored] if many else [cells[0] for cells in stored]), [1] * n_rows
        return None, counts

    cells_out, counts = [], []
    for row, value in enumerate(table[column]):
        if isinstance(value, list):
            cells = value
            if not many and len(value) != 1:
                source.fail(row, column, f"expected one image, got a list of {len(value)}")
        else:
            cells = [] if value is None and many else [value]
        resolved = []
        for cell in cells:
            if isinstance(cell, dict) and cell.get("bytes") is not None:
                resolved.append(cell)
            elif isinstance(cell, dict) and cell.get("path") is not None:
                resolved.append(_check_path(source, row, column, cell["path"], check))
            elif cell is None or isinstance(cell, dict):
                source.fail(row, column, "missing image")
            else:
                resolved.append(_check_path(source, row, column, cell, check))
        cells_out.append(resolved if many else resolved[0])
        counts.append(len(resolved))
    return cells_out, counts


def _resolve(source: _Source, row: int, column: str, value, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        source.fail(row, column, f"expected {'an' if what[0] in 'aeiou' else 'a'} {what} path, got {value!r}")
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        base = source.base_for(row)
        if base is None:
            source.fail(row, column, f"relative {what} path '{value}' cannot be resolved for a hub dataset")
        path = os.path.join(base, path)
    return path


def _is_frame_list(value) -> bool:
    """A list of frame image paths (one video) rather than a list of videos."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(v, str) and v.lower().endswith(FRAME_EXTENSIONS) for v in value))


def _video_cells(table, source, column, check, *, many: bool) -> tuple[list, list[int]]:
    """Validate a video column; returns (cells, counts). A cell holds one video or (many=True) a list of videos;
    a video is a file path, a folder of frames or a list of frame paths. Each video becomes a list of absolute
    paths ([file] or [folder] or the frames); with check=True each is probed (a file decodes a frame, a folder
    holds frames, every frame exists), with "exists" only paths are checked."""
    cells, counts = [], []
    for row, value in enumerate(table[column]):
        if value is None or value == []:
            videos = []
        elif isinstance(value, str) or _is_frame_list(value):
            videos = [value]
        elif many and isinstance(value, list):
            videos = value
        else:
            source.fail(row, column, f"expected a video path, a frame folder or a list of frame paths, got {value!r}")
        resolved = []
        for video in videos:
            paths = [_resolve(source, row, column, v, "video") for v in (video if isinstance(video, list) else [video])]
            try:
                if check is True:
                    probe(paths if isinstance(video, list) else paths[0])
                elif check:
                    for path in paths:
                        if not os.path.exists(path):
                            raise VideoError(f"video file not found: '{path}'")
            except VideoError as error:
                source.fail(row, column, str(error))
            resolved.append(paths)
        cells.append(resolved)
        counts.append(len(resolved))
    return cells, counts


VIDEOS_FEATURE = datasets.List(datasets.List(datasets.Value("string")))


def _text(source: _Source, row: int, column: str, value, *, allow_empty: bool = False) -> str:
    if value is None or (isinstance(value, (list, dict))):
        source.fail(row, column, f"expected text, got {value!r}")
    text = str(value)
    if not allow_empty and not text.strip():
        source.fail(row, column, "empty text")
    return text


def _steps(source: _Source, row: int, column: str, value, required: bool) -> list[str]:
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("["):
            try:
                value = json.loads(stripped)
            except json.JSONDecodeError:
                source.fail(row, column, "a string that starts with '[' but is not a JSON list")
        else:  # one step per line
            value = [line for line in stripped.splitlines() if line.strip()]
    if value is None:
        value = []
    if not isinstance(value, list) or not all(isinstance(step, str) for step in value):
        source.fail(row, column, f"expected a list of strings, got {value!r}")
    steps = [step for step in value if step.strip()]
    if required and not steps:
        source.fail(row, column, "empty list" if not value else "only empty strings")
    return steps


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


def _replace_columns(table: datasets.Dataset, new: dict[str, list], features: dict,
                     drop: list[str]) -> datasets.Dataset:
    """The new columns (with their features) first, then the columns of `table` that are neither in
    `drop` nor named like a new column (extra columns keep their values, stored images stay as is)."""
    new_table = datasets.Dataset.from_dict(new, features=datasets.Features({name: features[name] for name in new}))
    rest = table.remove_columns([c for c in table.column_names if c in drop or c in new])
    if not rest.column_names:
        return new_table
    if getattr(rest, "_indices", None) is not None:  # a shuffled/selected view: align rows first
        rest = rest.flatten_indices()
    return datasets.concatenate_datasets([new_table, rest], axis=1)


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
    a folder of frames or a list of frame paths (utils.video). They become column 'videos' (`utils.video.videos_of`),
    each probed like an image path (check_images)."""
    table, source = _open(name_or_path, split)
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
    _require_columns(table, source, required)
    choice_columns = ([choices_column] if choices_column is not None
                      else [c for c in ("choices", "options") if c in table.column_names])

    images, many = None, False
    if image_column is not None:
        # A column of image lists gives several images per sample (kept as a list per row).
        kind = _image_feature_kind(table.features[image_column])
        many = kind == "images" or (kind == "other" and any(isinstance(v, list) for v in table[image_column]))
        images, _ = _image_cells(table, source, image_column, check_images, many=many)
    videos = _videos_column(table, source, video_column, "video", check_images, "--video_column")
    columns = table.column_names
    questions = [_text(source, i, question_column, v) for i, v in enumerate(table[question_column])]
    answers = [_text(source, i, answer_column, v) for i, v in enumerate(table[answer_column])]
    steps = ([_steps(source, i, steps_column, v, require_steps) for i, v in enumerate(table[steps_column])]
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
    ids = ([_text(source, i, id_column, v) for i, v in enumerate(table[id_column])] if id_column
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
    table = _replace_columns(table, new, features, drop)
    extras = [c for c in table.column_names if c not in STANDARD_VQA_COLUMNS]
    standard = [c for c in STANDARD_VQA_COLUMNS if c != "image" or image_column is not None]
    return table.select_columns(standard + extras)


def _messages(source: _Source, row: int, column: str, value) -> list[dict]:
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
        if role not in ROLES:
            source.fail(row, column, f"message {turn} has role {role!r}; expected one of {ROLES}")
        if not isinstance(content, str):
            source.fail(row, column, f"message {turn} content must be text, got {content!r}")
        messages.append({"role": role, "content": content})
    roles = {m["role"] for m in messages}
    if "user" not in roles or "assistant" not in roles:
        source.fail(row, column, f"needs at least one user and one assistant message, has roles {sorted(roles)}")
    return messages


def _check_markers(source, row, text_column, images_column, texts: list[str], n_images: int,
                   marker: str = IMAGE_MARKER) -> None:
    markers = sum(text.count(marker) for text in texts)
    if markers != n_images:
        what = "video" if marker == VIDEO_MARKER else "image"
        source.fail(row, text_column, f"{markers} '{marker}' marker(s) but {n_images} {what}(s) "
                                      f"in column '{images_column}'")


def _videos_column(table, source, column, default, check, flag) -> list | None:
    """Validated video cells of `column` (None when it is the default name and absent: rows without video)."""
    if column is None or (column == default and column not in table.column_names):
        return None
    _require_columns(table, source, {column: flag})
    return _video_cells(table, source, column, check, many=True)[0]


def load_sharegpt(name_or_path, *, split: str = "train", messages_column: str = "messages",
                  images_column: str = "images", check_images=True, videos_column: str = "videos") -> datasets.Dataset:
    """LLaMA-Factory/OpenVLThinker sharegpt SFT rows -> columns messages (list of {role, content};
    'from'/'value' and human/gpt are accepted and renamed), images (list of Image; [] without an images
    column), then any other columns. The number of '<image>' markers over a row's messages must equal
    its number of images; likewise '<video>' markers and the videos of `videos_column` (LLaMA-Factory's
    convention; a video is a file, a frame folder or a list of frame paths), which become column 'videos'."""
    table, source = _open(name_or_path, split)
    _require_columns(table, source, {messages_column: "--messages_column"})
    videos = _videos_column(table, source, videos_column, "videos", check_images, "--videos_column")
    if images_column in table.column_names:
        images, counts = _image_cells(table, source, images_column, check_images, many=True)
    else:  # text-only rows
        images, counts = [[] for _ in range(len(table))], [0] * len(table)
    messages = []
    for row, value in enumerate(table[messages_column]):
        turns = _messages(source, row, messages_column, value)
        _check_markers(source, row, messages_column, images_column, [m["content"] for m in turns], counts[row])
        _check_markers(source, row, messages_column, videos_column, [m["content"] for m in turns],
                       len(videos[row]) if videos is not None else 0, VIDEO_MARKER)
        messages.append(turns)
    message_feature = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})
    new = {"messages": messages}
    features = {"messages": message_feature, "images": datasets.List(datasets.Image())}
    drop = [messages_column]
    if videos is not None:
        new["videos"], features["videos"] = videos, VIDEOS_FEATURE
        drop.append(videos_column)
    if images is not None:
        new["images"] = images
        drop.append(images_column)
    elif images_column != "images":
        table = (table.remove_columns([c for c in ("images",) if c in table.column_names])
                 .rename_column(images_column, "images"))
    table = _replace_columns(table, new, features, drop)
    order = ["messages", "images"]
    return table.select_columns(order + [c for c in table.column_names if c not in order])


def load_rl_rows(name_or_path, *, split: str = "train", images_column: str = "images", problem_column: str = "problem",
                 answer_column: str = "answer", check_images=True, videos_column: str = "videos") -> datasets.Dataset:
    """OpenVLThinker RL rows -> columns images (list of Image; a single image or path is wrapped),
    problem, answer (text), then any other columns. When a problem contains '<image>' markers their
    number must equal its number of images; likewise '<video>' markers and `videos_column` (-> 'videos')."""
    table, source = _open(name_or_path, split)
    _require_columns(table, source, {images_column: "--images_column", problem_column: "--problem_column",
                                     answer_column: "--answer_column"})
    images, counts = _image_cells(table, source, images_column, check_images, many=True)
    videos = _videos_column(table, source, videos_column, "videos", check_images, "--videos_column")
    problems = []
    for row, value in enumerate(table[problem_column]):
        problem = _text(source, row, problem_column, value)
        if IMAGE_MARKER in problem:
            _check_markers(source, row, problem_column, images_column, [problem], counts[row])
        if VIDEO_MARKER in problem or videos is not None and "<image>" in problem:
            _check_markers(source, row, problem_column, videos_column, [problem],
                           len(videos[row]) if videos is not None else 0, VIDEO_MARKER)
        problems.append(problem)
    answers = [_text(source, row, answer_column, value) for row, value in enumerate(table[answer_column])]
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
    table = _replace_columns(table, new, features, drop)
    order = ["images", "problem", "answer"]
    return table.select_columns(order + [c for c in table.column_names if c not in order])


def images_of(row):
    """A row's images as a list (a single image, a list of images, or none)."""
    image = row.get("image")
    if image is None:
        return []
    return list(image) if isinstance(image, (list, tuple)) else [image]
