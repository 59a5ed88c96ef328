"""Column and cell checks shared by the data loaders (`utils.core.data`, `utils.t2i.data`): required columns, image and
video cells (stored images checked in Arrow without decoding, paths resolved against the row's file and opened or
probed), text and step cells, and the rewrite of a table with its checked columns. Each failure raises
`DataValidationError` through `Source.fail`, so every message names the file, the row and the column.
"""

from __future__ import annotations

import json
import os

import datasets
import PIL.Image
import pyarrow as pa
import pyarrow.compute as pc

from utils.core.data_sources import Source
from utils.core.errors import DataValidationError
from utils.core.video import FRAME_EXTENSIONS, VideoError, probe


def require_columns(table: datasets.Dataset, source: Source, columns: dict[str, str]) -> None:
    """columns: {column name: the flag that maps it}."""
    if len(table) == 0:
        raise DataValidationError(f"{source.label}: no rows")
    for column, flag in columns.items():
        if column not in table.column_names:
            raise DataValidationError(
                f"{source.where(0)}, column '{column}': not found; the columns are {table.column_names}. "
                f"Map yours with {flag}")


def image_feature_kind(feature) -> str:
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


def _check_path(source: Source, row: int, column: str, value, check) -> str:
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


def image_cells(table, source, column, check, *, many: bool) -> tuple[list | None, list[int]]:
    """Validate an image column; returns (cells, counts).

    cells: the new per-row values when the column has to be rewritten (paths become absolute paths;
    with many=True a single image is wrapped in a list, with many=False a one-image list is
    unwrapped), or None when the stored column can be kept as it is. counts: images per row.
    Stored images (Image features) are checked for presence in Arrow and never decoded."""
    n_rows = len(table)
    kind = image_feature_kind(table.features[column])
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


def _resolve(source: Source, row: int, column: str, value, what: str) -> str:
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


def text_cell(source: Source, row: int, column: str, value, *, allow_empty: bool = False) -> str:
    if value is None or (isinstance(value, (list, dict))):
        source.fail(row, column, f"expected text, got {value!r}")
    text = str(value)
    if not allow_empty and not text.strip():
        source.fail(row, column, "empty text")
    return text


def steps_cell(source: Source, row: int, column: str, value, required: bool) -> list[str]:
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



def replace_columns(table: datasets.Dataset, new: dict[str, list], features: dict,
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


def video_column_cells(table, source, column, default, check, flag) -> list | None:
    """Validated video cells of `column` (None when it is the default name and absent: rows without video)."""
    if column is None or (column == default and column not in table.column_names):
        return None
    require_columns(table, source, {column: flag})
    return _video_cells(table, source, column, check, many=True)[0]
