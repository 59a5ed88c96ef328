"""evaluate.py --benchmark: MathVista (testmini), MathVerse (testmini) and MATH-Vision read from local copies in
their published formats (hand-written rows in each release's schema) and scored by their official rules, with the
tricky cases: units, "(A)" vs "A", option texts, fractions, precision, an LLM answer extractor."""

import json

import PIL.Image
import pytest

import evaluate
import rewards.judge
from evaluate import EvalConfig
from tests.benchmark_helpers import write_mathverse, write_mathvision, write_mathvista
from utils.core.errors import InputError
from utils.core.http import Reply
from utils.eval.benchmarks import LLMAnswerExtractor, benchmark_correct, load_benchmark


@pytest.fixture
def mathvista(tmp_path):
    """MathVista's testmini.json (a dict keyed by pid), images beside it."""
    return write_mathvista(tmp_path)


@pytest.mark.parametrize("pid, response, correct", [
    ("1", "B", True), ("1", "(B)", True), ("1", "(B) 4", True), ("1", "4", True), ("1", "b", True),
    ("1", "The answer is \"4\".", True), ("1", "A", False), ("1", "(C) 6", False), ("1", "A length of 6", False),
    ("2", "5", True), ("2", "5 cm", True), ("2", "5.0", True), ("2", "The side is 5 cm long.", True),
    ("2", "6 cm", False), ("2", "", False),
    ("3", "1.2", True), ("3", "1.23", True), ("3", "6/5", True), ("3", "1.3", False),
    ("4", "3/4", True), ("4", "0.75", True), ("4", "0.7", False),
    ("5", "[1, 2]", True), ("5", "[2, 1]", False),
])
def test_mathvista_official_rules(mathvista, pid, response, correct):
    rows = {r["id"]: r for r in load_benchmark("mathvista", mathvista)}
    assert benchmark_correct(rows[pid], response)[0] is correct


def test_mathvista_rows_prompt_with_query_and_read_the_hub_release(mathvista, tmp_path):
    import datasets

    rows = load_benchmark("mathvista", mathvista)
    assert rows[0]["question"].endswith("Choices:\n(A) 2\n(B) 4\n(C) 6") and rows[0]["choices"] is None
    assert rows[0]["image"].size == (8, 8) and rows[1]["unit"] == "cm"
    # the hub release (parquet / save_to_disk): image is a path string, decoded_image the picture
    records = list(json.loads(open(mathvista).read()).values())
    for r in records:
        r["decoded_image"] = PIL.Image.new("RGB", (4, 4), "black")
        r["choices"] = r["choices"] or None
    table = datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "metadata"} for r in records])
    datasets.DatasetDict({"testmini": table}).save_to_disk(str(tmp_path / "hub"))
    hub = load_benchmark("mathvista", str(tmp_path / "hub"), split="testmini")
    assert [r["id"] for r in hub] == ["1", "2", "3", "4", "5"] and hub[0]["image"].size == (4, 4)
    assert benchmark_correct(hub[2], "6/5")[0]  # precision came back as a float (1.0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"pid": "9", "question": "q"}]))
    with pytest.raises(InputError, match=r"bad.json, row 0: not a mathvista record, it lacks query, choices"):
        load_benchmark("mathvista", str(bad))


def test_mathverse_official_schema_and_rules(tmp_path):
    path = write_mathverse(tmp_path)
    rows = {r["id"]: r for r in load_benchmark("mathverse", str(path))}
    assert rows["1"]["question"].startswith("Please first conduct reasoning") and rows["2"]["image"].size == (8, 8)
    cases = [("1", "B", True), ("1", "(B)", True), ("1", "B: This is not a function", True),
             ("1", "This is not a function", True), ("1", "A", False), ("2", "14", True), ("2", "14 cm", True),
             ("2", "L is about \\boxed{14}", True), ("2", "13", False), ("3", "0.5", True), ("3", "1/2", True),
             ("3", "2", False)]
    assert [benchmark_correct(rows[i], response)[0] for i, response, _ in cases] == [c for _, _, c in cases]


def test_mathvision_official_schema_and_rules(tmp_path):
    path = write_mathvision(tmp_path)
    rows = {r["id"]: r for r in load_benchmark("mathvision", str(path))}
    assert rows["91"]["choices"][4] == "$12 \\mathrm{~m}$" and rows["5"]["choices"] is None
    cases = [("6", "D", True), ("6", "(D)", True), ("6", "The answer is D.", True), ("6", "C", False),
             ("91", "E", True), ("91", "$12 \\mathrm{~m}$", True), ("91", "12 m", True), ("91", "(D)", False),
             ("5", "61", True), ("5", "61.0", True), ("5", "\\boxed{61}", True), ("5", "16", False),
             ("7", "0.75", True), ("7", "3/4", True), ("7", "\\frac{1}{4}", False)]
    assert [benchmark_correct(rows[i], response)[0] for i, response, _ in cases] == [c for _, _, c in cases]


def test_llm_answer_extractor_feeds_mathvistas_normalisation(mathvista, monkeypatch):
    sent = []

    def post(url, **request):  # the judge client's one HTTP call
        sent.append(request["json"]["messages"][-1]["content"][-1]["text"])
        text = "Extracted answer: (B)" if "AB" in sent[-1] else "null"
        return Reply(200, json.dumps({"choices": [{"message": {"content": text}}]}).encode())

    extractor = LLMAnswerExtractor("http://127.0.0.1:9/v1", "extractor")
    monkeypatch.setattr(rewards.judge, "post", post)
    rows = {r["id"]: r for r in load_benchmark("mathvista", mathvista)}
    long = "Both sides measure the same, so the segment has the middle length of the three."
    assert benchmark_correct(rows["1"], long) == (False, "2")  # the rules alone: the most similar choice
    assert benchmark_correct(rows["1"], long, extractor) == (True, "4")
    assert "Model response: " + long in sent[0] and "length of AB" in sent[0]
    assert benchmark_correct(rows["2"], "I cannot tell.", extractor) == (False, None)  # "null": no answer
    assert benchmark_correct(rows["2"], "5", extractor) == (True, "5")  # parses as the answer type: no request
    assert len(sent) == 2


def test_evaluate_scores_a_benchmark_by_its_rules(mathvista, tmp_path, monkeypatch):
    replies = {"1": "(B)", "2": "5 cm", "3": "1.3", "4": "3/4", "5": "[1, 2]"}
    monkeypatch.setattr(evaluate, "generate", lambda cfg, model, rows: [
        f"<think>I look.</think><answer>{replies[r['id']]}</answer>" for r in rows])
    metrics = evaluate.main(EvalConfig(model="m", benchmark="mathvista", dataset=mathvista, metrics=["accuracy"],
                                       output_dir=str(tmp_path / "out")))
    assert metrics["benchmark"] == "mathvista" and metrics["accuracy"] == 0.8
    assert metrics["accuracy/question_type=multi_choice"] == 1.0 and metrics["accuracy/answer_type=float"] == 0.5
    records = [json.loads(line) for line in (tmp_path / "out" / "generations.jsonl").read_text().splitlines()]
    assert [r["prediction"] for r in records] == ["4", "5", "1.3", "0.75", "[1, 2]"]
    with pytest.raises(ValueError, match="drop 'crystal'"):
        evaluate.validate(EvalConfig(model="m", benchmark="mathvista", metrics=["crystal"]))
    with pytest.raises(ValueError, match="--benchmark 'mmmu'"):
        evaluate.validate(EvalConfig(model="m", benchmark="mmmu", metrics=["accuracy"]))
