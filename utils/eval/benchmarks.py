"""The benchmarks OpenVLThinker reports, read from a local copy in their published formats and scored by their
official rules (evaluate.py --benchmark; docs/evaluation.md has the details and where each rule comes from).

- mathvista   MathVista testmini: rows with pid, question, image / decoded_image, choices, unit, precision,
              answer, question_type (multi_choice, free_form), answer_type (text, integer, float, list), query,
              metadata. Prompt: `query`. Score: the official extraction (the response itself when it is a choice or
              parses as the answer type; `The answer is "X".`; else the LLM extractor, or without one our rule
              extraction), then the official normalisation (an option letter, also "(A)", becomes its choice text;
              other text the most similar choice by edit distance; integers int(float(x)); floats rounded to
              `precision`) and exact equality with `answer`.
- mathverse   MathVerse testmini: rows with sample_index, problem_index, problem_version, question, image, answer,
              question_type (multi-choice, free-form), metadata, query_wo, query_cot. Prompt: `query_cot`. Score:
              the answer extracted (the LLM extractor, or our rules), then for multi-choice the option letter (or
              the text of an option listed in the question) against the gold letter, for free-form exact match or
              math-verify equivalence (the official judge is an LLM; math-verify stands in for it).
- mathvision   MATH-Vision: rows with id, question, options, image / decoded_image, answer, solution, level,
              subject. Prompt: the question and its options. Score: the official rule extraction (an option letter
              from "(A)"; `\\boxed{}`; "the answer is ..."), then equality with the gold letter or the gold option's
              text, case-insensitive, or numeric / math-verify equivalence (the official check rounds to 2 places).

A file is read as JSON (a list, or MathVista's dict keyed by pid), JSONL, or anything `utils.core.data.load_table` reads
(the hub releases' parquet or a save_to_disk folder); relative image paths are resolved from the data file's folder.

Used by evaluate.py alone (--benchmark).
"""

from __future__ import annotations

import json
import os
import re
from fractions import Fraction

from rewards.judge import JudgeClient
from rewards.text import _math_equal
from utils.core.data_sources import load_table
from utils.core.errors import InputError
from utils.eval.chains import boxed_answers

BENCHMARKS = ("mathvista", "mathverse", "mathvision")
REQUIRED = {
    "mathvista": ("pid", "query", "choices", "answer", "question_type", "answer_type"),
    "mathverse": ("sample_index", "answer", "question_type", "problem_version"),
    "mathvision": ("id", "question", "options", "answer"),
}
GROUP_BY = {"mathvista": ("question_type", "answer_type"), "mathverse": ("problem_version", "question_type"),
            "mathvision": ("level", "subject")}

EXTRACT_PROMPT = (
    "Below is a question and a model's response to it. Extract the model's final answer. Reply with the answer "
    "only: the option letter for a multiple-choice question, otherwise the final value or expression without "
    "units or explanation. Reply null when the response gives no answer.\n\n"
    "Question: {question}\n\nModel response: {response}\n\nExtracted answer:")


# --------------------------------------------------------------------------------------------------
# Reading a local copy


def _records(path, split):
    """The raw records of a benchmark file or folder, and the folder relative image paths start from."""
    if os.path.isfile(path) and path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return (list(data.values()) if isinstance(data, dict) else list(data)), os.path.dirname(os.path.abspath(path))
    if os.path.isfile(path) and path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()], os.path.dirname(os.path.abspath(path))

    table = load_table(path, split=split)
    base = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    return [table[i] for i in range(len(table))], base


def _image(record, base, where):
    import PIL.Image

    for key in ("decoded_image", "image"):
        value = record.get(key)
        if isinstance(value, PIL.Image.Image):
            return value.convert("RGB")
    value = record.get("image")
    if isinstance(value, dict) and value.get("bytes"):
        import io

        return PIL.Image.open(io.BytesIO(value["bytes"])).convert("RGB")
    if isinstance(value, str) and value:
        file = value if os.path.isabs(value) else os.path.join(base, value)
        if not os.path.isfile(file):
            raise InputError(f"{where}: image file not found: {file}")
        return PIL.Image.open(file).convert("RGB")
    raise InputError(f"{where}: no image (neither a decoded_image nor an image path)")


def inline_choices(question):
    """{letter: text} of options written in a MathVerse question ("Choices:\\nA:..." or "A. ..." lines)."""
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"(?m)^\s*\(?([A-H])\)?\s*[:.)]\s*(.+?)\s*$",
                                                                question.split("Choices:", 1)[-1])}


def load_benchmark(name, path, *, split="testmini", max_samples=None):
    """Rows for evaluate.py (id, question = the benchmark's prompt, image, answer, choices) with the fields the
    scorer needs; bad records fail naming the file, the row and the field."""
    if name not in BENCHMARKS:
        raise InputError(f"--benchmark {name!r}: choose from {', '.join(BENCHMARKS)}")
    records, base = _records(path, split)
    records = records[:max_samples] if max_samples else records
    rows = []
    for index, record in enumerate(records):
        where = f"{path}, row {index}"
        missing = [k for k in REQUIRED[name] if k not in record]
        if missing:
            raise InputError(f"{where}: not a {name} record, it lacks {', '.join(missing)} (columns: "
                             f"{sorted(record)})")
        row = {"benchmark": name, "answer": str(record["answer"]), "choices": None}
        if name == "mathvista":
            choices = list(record["choices"] or [])
            row.update(id=str(record["pid"]), question=record["query"], bench_choices=choices,
                       question_type=record["question_type"], answer_type=record["answer_type"],
                       precision=record.get("precision"), unit=record.get("unit"))
        elif name == "mathverse":
            question = record.get("query_cot") or record.get("question_for_eval") or record.get("question") or ""
            row.update(id=str(record["sample_index"]), question=question, problem_version=record["problem_version"],
                       question_type=record["question_type"],
                       bench_choices=inline_choices(record.get("question") or question))
        else:
            options = list(record["options"] or [])
            row.update(id=str(record["id"]), question=record["question"], choices=options or None,
                       bench_choices=options, level=record.get("level"), subject=record.get("subject"))
        row["image"] = _image(record, base, where)
        rows.append(row)
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        raise InputError(f"{path}: {name} ids are not unique")
    return rows


# --------------------------------------------------------------------------------------------------
# Extraction and normalisation


class LLMAnswerExtractor:
    """The answer extractor over an OpenAI-compatible endpoint (MathVista's and MathVerse's pipelines extract with
    an LLM): question + response in, the final answer out ("" for none)."""

    def __init__(self, base_url, model, *, api_key=None, timeout=120.0, max_retries=3, deadline=None,
                 allow_insecure_api_key=False):
        self.client = JudgeClient(base_url, model, api_key=api_key, timeout=timeout, temperature=0.0, max_tokens=64,
                                  max_retries=max_retries, deadline=deadline,
                                  allow_insecure_api_key=allow_insecure_api_key)

    def __call__(self, question, response):
        text = self.client.chat(EXTRACT_PROMPT.format(question=question, response=response)).strip()
        text = re.sub(r"^(extracted answer:)\s*", "", text, flags=re.IGNORECASE).strip()
        return "" if text.lower() in ("null", "none") else text


_LETTER = re.compile(r"^(?:\(([A-Za-z])\)|([A-Za-z])(?:[.:)]|$))")  # "(B) ...", "B", "B. ...", "B: ...", not "A cat"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")


def option_letter(text, count):
    """The option letter a short answer names ("B", "(b)", "(B) 4", "B. 5 cm", "B: text"), if one of `count`."""
    match = _LETTER.match(text.strip())
    letter = (match.group(1) or match.group(2)).upper() if match else None
    return letter if letter and ord(letter) - ord("A") < count else None


def last_number(text, unit=None):
    """The last number in `text` (thousands separators and the unit dropped; "3/4" as a fraction), or None."""
    if unit:
        text = text.replace(unit, " ")
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    value = found[-1].replace(" ", "")
    try:
        return float(Fraction(value)) if "/" in value else float(value)
    except (ValueError, ZeroDivisionError):
        return None


def _edit_distance(a, b):
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def mathvista_extract(response, row, extractor=None):
    """MathVista's extraction order; our rules stand in for its LLM when no extractor is given."""
    response = response.strip()
    if not response:
        return ""
    if row["question_type"] == "multi_choice" and response in row["bench_choices"]:
        return response
    for kind, cast in (("integer", int), ("float", float)):
        if row["answer_type"] == kind:
            try:
                return str(cast(response))
            except ValueError:
                pass
    quoted = re.search(r'The answer is "(.*)"\.', response)
    if quoted:
        return quoted.group(1)
    if extractor is not None:
        return extractor(row["question"], response)
    if row["question_type"] == "multi_choice":
        letter = option_letter(response, len(row["bench_choices"]))
        return f"({letter})" if letter else response
    if row["answer_type"] in ("integer", "float"):
        number = last_number(response, row.get("unit"))
        return response if number is None else repr(number)
    return response


def mathvista_normalize(extraction, row):
    """MathVista's normalisation of an extracted answer to the answer type (None: unusable)."""
    choices = row["bench_choices"]
    if row["question_type"] == "multi_choice":
        extraction = str(extraction).strip()
        letters = re.findall(r"\(([a-zA-Z])\)", extraction)
        if letters:
            extraction = letters[0].upper()
        options = [chr(ord("A") + i) for i in range(len(choices))]
        if extraction in options:
            return choices[options.index(extraction)]
        distances = [_edit_distance(extraction, c) for c in choices]
        return choices[distances.index(min(distances))]
    try:
        if row["answer_type"] == "integer":
            return str(int(float(extraction)))
        if row["answer_type"] == "float":
            return str(round(float(extraction), int(row["precision"] or 0)))
    except (TypeError, ValueError):
        return None
    return str(extraction)


def _final(response):
    """The final answer of a free response: its last \\boxed{}, or what follows "the answer is"."""
    boxed = boxed_answers(response)
    if boxed:
        return boxed[-1]
    for flag in ("the final answer is", "the correct answer is", "the answer is", "the answer should be"):
        at = response.lower().rfind(flag)
        if at >= 0:
            return response[at + len(flag):].strip().split("\n")[0].rstrip(".").strip(" :")
    return response.strip()


# a unit after a number: \mathrm{~m}, degrees, or a common unit word (a single letter stays: "3x" is no unit)
_UNITS = ("mm", "cm", "m", "km", "in", "inch", "inches", "ft", "feet", "yd", "mi", "miles", "meters", "metres",
          "units", "unit", "degrees", "degree", "g", "kg", "mg", "lb", "lbs", "s", "sec", "seconds", "min", "minutes",
          "h", "hours", "days", "years", "l", "ml", "cents", "dollars", "%")
_UNIT_AFTER_NUMBER = re.compile(r"(?<=\d)\s*(?:\\mathrm\{~?\s*[a-zA-Z]+\}(?:\^\{?[23]\}?)?|\^\{?\\circ\}?|°|(?:"
                                + "|".join(re.escape(u) for u in _UNITS) + r")(?:\^\{?[23]\}?)?)$", re.IGNORECASE)


def _equal(gold, pred):
    """Exact (case-insensitive, $ and spaces dropped), numeric to 2 places, or math-verify equivalence."""
    def clean(text):  # "$12 \\mathrm{~m}$", "14 cm", "50°" -> "12", "14", "50" when a number carries a unit
        text = str(text).replace("$", "").strip().rstrip(".")
        text = _UNIT_AFTER_NUMBER.sub("", text)
        return text.replace(" ", "").lower()

    gold, pred = clean(gold), clean(pred)
    if not gold or not pred:
        return False
    if gold == pred:
        return True
    g, p = last_number(gold), last_number(pred)
    if g is not None and p is not None and re.fullmatch(r"-?[\d.]+(?:/[\d.]+)?", gold) and \
            re.fullmatch(r"-?[\d.]+(?:/[\d.]+)?", pred):
        return round(g, 2) == round(p, 2)
    return _math_equal(gold, pred, 5)


def benchmark_correct(row, response, extractor=None):
    """(correct, the normalised prediction) of one response to one benchmark row."""
    name = row["benchmark"]
    if name == "mathvista":
        prediction = mathvista_normalize(mathvista_extract(response, row, extractor), row) if response.strip() else None
        return prediction is not None and prediction == row["answer"], prediction
    if name == "mathverse":
        answer = extractor(row["question"], response) if extractor is not None and response.strip() else \
            _final(response)
        if row["question_type"] == "multi-choice":
            choices = row["bench_choices"]
            letter = option_letter(answer, max(len(choices), 5)) or next(
                (k for k, v in choices.items() if v.strip().lower() == answer.strip().lower()), None)
            return letter is not None and letter == row["answer"].strip(), letter
        return _equal(row["answer"], answer), answer
    answer = _final(response)
    options = row["bench_choices"]
    if options:
        letter = option_letter(answer, len(options))
        gold_text = options[ord(row["answer"]) - ord("A")] if len(row["answer"]) == 1 else ""
        return (letter == row["answer"]) if letter else (_equal(row["answer"], answer) or _equal(gold_text, answer)), \
            letter or answer
    return _equal(row["answer"], answer), answer
