"""Loading and up-front validation of the text-to-image prompt sets: GenEval metadata, TIIF rows, plain prompts.
A bad row raises `DataValidationError` naming the file, the row and the column, before any compute."""

from __future__ import annotations

import json
import os

import datasets

from utils.core.data_checks import text_cell
from utils.core.data_sources import Source, open_source
from utils.core.errors import DataValidationError

GENEVAL_POSITIONS = ("left of", "right of", "above", "below")

# These return lists of dicts, not Datasets: GenEval rows are nested and
# uneven (optional color/position keys), and Arrow would add those keys as None to every item,
# which the GenEval reward server would then read. Plain dicts go to the server unchanged.


def _json_rows(name_or_path, split: str) -> tuple[list[dict], Source]:
    path = os.path.expanduser(os.fspath(name_or_path)) if not isinstance(name_or_path, datasets.Dataset) else None
    if path and os.path.isfile(path) and os.path.splitext(path)[1].lower() in (".json", ".jsonl"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        source = Source(path, os.path.dirname(os.path.abspath(path)))
        if text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as error:
                raise DataValidationError(f"{path}: not valid JSON: {error}") from error
        else:
            rows = []
            for line_no, line in enumerate(text.splitlines()):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DataValidationError(
                        f"{path} row {len(rows)} (line {line_no + 1}): not valid JSON: {error}") from error
        if not rows:
            raise DataValidationError(f"{path}: no rows")
        source.files = [(path, len(rows))]
        for row, value in enumerate(rows):
            if not isinstance(value, dict):
                raise DataValidationError(f"{source.where(row)}: expected a JSON object, got {value!r}")
        return rows, source
    table, source = open_source(name_or_path, split)
    return [_drop_nones(row) for row in table.to_list()], source


def _drop_nones(value):
    if isinstance(value, dict):
        return {k: _drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nones(v) for v in value]
    return value


def _geneval_item(source, row, column, index, item, n_include) -> None:
    where = f"item {index}"
    if not isinstance(item, dict):
        source.fail(row, column, f"{where} is not an object: {item!r}")
    if not isinstance(item.get("class"), str) or not item["class"].strip():
        source.fail(row, column, f"{where} needs a 'class' string, got {item.get('class')!r}")
    count = item.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        source.fail(row, column, f"{where} needs an integer 'count' >= 1, got {count!r}")
    if "color" in item and not isinstance(item["color"], str):
        source.fail(row, column, f"{where} 'color' must be a string, got {item['color']!r}")
    if "position" in item:
        position = item["position"]
        ok = (column == "include" and isinstance(position, (list, tuple)) and len(position) == 2
              and position[0] in GENEVAL_POSITIONS and isinstance(position[1], int)
              and 0 <= position[1] < n_include and position[1] != index)
        if not ok:
            source.fail(row, column, f"{where} 'position' must be [one of {GENEVAL_POSITIONS}, index of another "
                                     f"include item], got {position!r}")


def load_geneval(path, *, split: str = "train") -> list[dict]:
    """GenEval metadata rows {tag, include, exclude?, prompt} as a list of dicts (see above for why)."""
    rows, source = _json_rows(path, split)
    for row, item in enumerate(rows):
        for column in ("tag", "prompt"):
            text_cell(source, row, column, item.get(column))
        include = item.get("include")
        if not isinstance(include, list) or not include:
            source.fail(row, "include", f"expected a non-empty list, got {include!r}")
        exclude = item.get("exclude", [])
        if not isinstance(exclude, list):
            source.fail(row, "exclude", f"expected a list, got {exclude!r}")
        for column, items in (("include", include), ("exclude", exclude)):
            for index, entry in enumerate(items):
                _geneval_item(source, row, column, index, entry, len(include))
    return rows


def _yes_no(value) -> bool:
    return isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in ("yes", "no"))


def load_tiif(path, *, split: str = "train") -> list[dict]:
    """TIIF rows {type, short_description, long_description?, yn_question_list, yn_answer_list, source?}
    as a list of dicts; each row also gets `prompt` = short_description (unless it has one)."""
    rows, source = _json_rows(path, split)
    for row, item in enumerate(rows):
        text_cell(source, row, "type", item.get("type"))
        text_cell(source, row, "short_description", item.get("short_description"))
        questions, answers = item.get("yn_question_list"), item.get("yn_answer_list")
        if not isinstance(questions, list) or not questions or not all(isinstance(q, str) for q in questions):
            source.fail(row, "yn_question_list", f"expected a non-empty list of strings, got {questions!r}")
        if not isinstance(answers, list):
            source.fail(row, "yn_answer_list", f"expected a list, got {answers!r}")
        if len(answers) != len(questions):
            source.fail(row, "yn_answer_list", f"{len(answers)} answers for {len(questions)} questions in "
                                               f"'yn_question_list'")
        bad = [a for a in answers if not _yes_no(a)]
        if bad:
            source.fail(row, "yn_answer_list", f"answers must be yes/no, got {bad!r}")
        item.setdefault("prompt", item["short_description"])
    return rows


def load_prompt_lines(path, *, split: str = "train") -> list[dict]:
    """Plain prompts, as Flow-GRPO's PickScore and OCR sets: a .txt file with one prompt a line (blank lines skipped),
    or rows with a `prompt` column (jsonl, json, parquet, a hub data set; their other columns kept). Rows {prompt}."""
    local = os.path.expanduser(os.fspath(path)) if not isinstance(path, datasets.Dataset) else None
    if local and os.path.isfile(local) and local.lower().endswith(".txt"):
        with open(local, encoding="utf-8") as f:
            rows = [{"prompt": line.strip()} for line in f if line.strip()]
        if not rows:
            raise DataValidationError(f"{local}: no prompts")
        return rows
    rows, source = _json_rows(path, split)
    for row, item in enumerate(rows):
        text_cell(source, row, "prompt", item.get("prompt"))
    return rows


def load_prompts(cfg, path) -> list[dict]:
    """Prompt rows of --dataset_name's schema (TIIF's, plain prompts', else GenEval's); a bad row is an error naming
    the file, the row and the column."""
    if cfg.dataset_name == "prompts":
        return load_prompt_lines(path)
    return load_tiif(path) if cfg.dataset_name == "tiif" else load_geneval(path)
