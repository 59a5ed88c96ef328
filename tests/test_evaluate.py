import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from datasets import Dataset, DatasetDict

import evaluate
from evaluate import EvalConfig, markdown_report, score
from tiny.models import make_tiny_vlm
from tiny.shapes import make_shapes_vqa
from utils.eval.grading import crystal_files, group_means, parse_completion, resolve_embedding_model
from utils.eval.keywords import compare_keywords, keyword_frequencies, load_texts

torch.set_num_threads(1)
CLI = os.path.join(os.path.dirname(sys.executable), "crystal-metrics")


# ---------------------------------------------------------------- parsing


def test_parse_completion_reads_json_and_tags_and_refuses_free_text():
    json_text = '{"reasoning_steps": ["I see 2 circles", "So 2"], "answer": "2"}'
    assert parse_completion(json_text) == (["I see 2 circles", "So 2"], "2")
    assert parse_completion("<think>Step 1: red. Step 2: so red.</think><answer>red</answer>") == (
        ["red.", "so red."], "red")
    # free text has no answer under a structured template, but is the answer under `plain`
    assert parse_completion("maybe 2", prompt_template="crystal_json") == ([], "")
    assert parse_completion(" 2 ", prompt_template="plain") == ([], "2")
    # truncated JSON holding the right number is not an answer
    assert parse_completion('{"reasoning_steps": ["There are 2 circles"') == ([], "")


def test_crystal_files_key_by_id_and_leave_unanswered_out():
    rows = [dict(id="q1", question="How many?", answer="2", reference_steps=["two"], choices=None),
            dict(id="q2", question="Colour?", answer="red", reference_steps=["red"], choices=["red", "blue"])]
    predictions, references = crystal_files(rows, ['{"reasoning_steps": ["two"], "answer": "2"}', "garbage"],
                                            prompt_template="crystal_json")
    assert predictions == {"q1": {"question": "How many?", "reasoning_steps": ["two"], "answer": "2"}}
    assert references == {"q1": {"reference_steps": ["two"], "answer": "2"},
                          "q2": {"reference_steps": ["red"], "answer": "red"}}
    with pytest.raises(ValueError, match="id 'q1' appears twice"):
        crystal_files([rows[0], rows[0]], ["", ""], prompt_template="crystal_json")


# ---------------------------------------------------------------- keywords, groups, report


def test_keyword_frequencies_count_whole_words_and_phrases():
    texts = ["Wait, let me check the image. Wait again.", "Alternatively, on the other hand, see the imagery."]
    freq = keyword_frequencies(texts)
    assert freq["reflection"]["words"]["wait"] == 2 and freq["reflection"]["words"]["check"] == 1
    assert freq["reflection"]["per_response"] == 1.5 and freq["reflection"]["response_rate"] == 0.5
    assert freq["visual"]["words"]["image"] == 1  # "imagery" is not "image"
    assert freq["alternate"]["words"]["on the other hand"] == 1
    delta = compare_keywords(freq, keyword_frequencies(["nothing here"]))
    assert delta["reflection"] == {"current": 1.5, "other": 0.0, "delta": 1.5}


def test_group_means_and_markdown_report():
    rows = [{"difficulty": "easy"}, {"difficulty": "easy"}, {"difficulty": "hard"}, {"difficulty": None}]
    assert group_means(rows, [1, 0, 1, 1], ["difficulty", "absent"], "accuracy") == {
        "accuracy/difficulty=easy": 0.5, "accuracy/difficulty=hard": 1.0}
    report = markdown_report({"samples": 4, "accuracy": 0.75, "accuracy/difficulty=easy": 0.5,
                              "keywords": keyword_frequencies(["wait"])})
    assert "| accuracy | 0.7500 |" in report and "| accuracy | difficulty=easy | 0.5000 |" in report
    assert "| reflection | 1.000 | 1.000 |" in report


def test_flags_are_checked():
    with pytest.raises(ValueError, match="exactly one of"):
        evaluate.validate(EvalConfig())
    with pytest.raises(ValueError, match="--served_model_name"):
        evaluate.validate(EvalConfig(base_url="http://localhost:8000/v1"))
    with pytest.raises(ValueError, match="--metrics"):
        evaluate.validate(EvalConfig(model="m", metrics=["bleu"]))


# ---------------------------------------------------------------- crystal-metrics equality

ROWS = [
    dict(id="a", question="How many circles are there?", answer="3", difficulty="easy", choices=None,
         reference_steps=["There are circles in the top left, the middle center and the bottom right",
                          "There are 3 circles"]),
    dict(id="b", question="What color is the square?", answer="red", difficulty="hard", choices=None,
         reference_steps=["There is one square in the image", "The square is in the top right",
                          "The square is red"]),
    dict(id="c", question="Is the red circle left or right of the blue square?", answer="left", difficulty="hard",
         choices=None, reference_steps=["The red circle is in the top left", "The blue square is in the bottom right",
                                        "So the red circle is left of the blue square"]),
    dict(id="d", question="Are there more red shapes than blue shapes?", answer="yes", difficulty="easy",
         choices=None, reference_steps=["There are 2 red shapes", "There is 1 blue shape", "2 is more than 1, so yes"]),
    dict(id="e", question="Which colour?", answer="blue", difficulty="easy", choices=["red", "blue"],
         reference_steps=["The shape is blue"]),
]
TEXTS = [
    '{"reasoning_steps": ["There are 3 circles", "They are in the top left and the middle"], "answer": "3"}',
    '{"reasoning_steps": ["The square is blue"], "answer": "blue"}',
    "<think>Step 1: The blue square is in the bottom right. Step 2: The red circle is in the top left.</think>"
    "<answer>left</answer>",
    "I am not sure",  # unanswered
    '{"reasoning_steps": ["It is blue"], "answer": "B"}',
]


@pytest.mark.slow
@pytest.mark.full
def test_reported_crystal_numbers_equal_the_crystal_metrics_cli(tmp_path):
    cfg = EvalConfig(model="unused", metrics=["crystal", "math", "keywords"])
    metrics = score(cfg, ROWS, TEXTS, str(tmp_path))
    crystal = metrics["crystal"]
    model_path, threshold = resolve_embedding_model(cfg.embedding_model)
    assert crystal["embedding_model"] == model_path and crystal["similarity_threshold"] == threshold == 0.35
    # non-trivial numbers, so the comparison below means something
    assert 0.0 < crystal["match_f1"] < 1.0 and crystal["ordered_match_f1"] < crystal["match_f1"]
    assert crystal["accuracy"] == pytest.approx(3 / 5)  # a, c, e (option letter B = blue); d unanswered
    assert metrics["accuracy"] == crystal["accuracy"] and metrics["format"] == pytest.approx(4 / 5)
    assert metrics["accuracy/difficulty=hard"] == 0.5
    assert metrics["math_accuracy"] == pytest.approx(1 / 5)  # only c has an <answer> block

    csv = tmp_path / "cli.csv"
    result = subprocess.run([CLI, "evaluate", str(tmp_path / "predictions.json"), str(tmp_path / "references.json"),
                             "--alpha", "0.3", "--model", model_path, "--threshold", str(threshold),
                             "--output", str(csv)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    cli = json.loads((tmp_path / "cli_summary.json").read_text())
    assert set(cli) == {"samples", "match_f1", "precision", "recall", "ordered_match_f1", "accuracy"}
    for key, value in cli.items():
        assert crystal[key] == pytest.approx(value, abs=1e-12), key
    for name in ("generations.jsonl", "metrics.json", "metrics.md"):
        assert os.path.isfile(tmp_path / name)
    assert len(load_texts(str(tmp_path))) == 5


# ---------------------------------------------------------------- end to end with a model


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    data = root / "shapes"
    DatasetDict({"test": make_shapes_vqa(8, seed=1)}).save_to_disk(str(data))
    return root, str(data)


@pytest.mark.slow
def test_evaluate_end_to_end_is_deterministic_and_independent_of_batch_size(tiny_data, tmp_path):
    root, data = tiny_data
    model = make_tiny_vlm(root / "model", seed=0)
    common = dict(model=model, dataset=data, max_new_tokens=12, temperature=1.0, seed=3,
                  metrics=["accuracy", "keywords"])
    first = evaluate.main(EvalConfig(**common, batch_size=8, output_dir=str(tmp_path / "a")))
    second = evaluate.main(EvalConfig(**common, batch_size=3, output_dir=str(tmp_path / "b"),
                                      compare=str(tmp_path / "a")))
    texts_a, texts_b = load_texts(str(tmp_path / "a")), load_texts(str(tmp_path / "b"))
    assert len(texts_a) == 8 and texts_a == texts_b and len(set(texts_a)) > 1
    assert first["samples"] == 8 and "keywords" in first
    assert all(v["delta"] == 0.0 for v in second["keywords_compare"].values())
    other_seed = evaluate.main(EvalConfig(**{**common, "seed": 4}, output_dir=str(tmp_path / "c")))
    assert load_texts(str(tmp_path / "c")) != texts_a and other_seed["samples"] == 8


@pytest.mark.slow
def test_select_best_picks_the_checkpoint_with_the_highest_accuracy(tiny_data, tmp_path):
    root, data = tiny_data
    run = tmp_path / "run"
    # Two checkpoints with different weights. The questions' answers are what checkpoint-1 says (seeded
    # sampling with a plain prompt: reproducible), so checkpoint-1 scores 1.0 and checkpoint-2 (another init) less.
    make_tiny_vlm(run / "checkpoint-1", seed=1)
    make_tiny_vlm(run / "checkpoint-2", seed=2)
    (run / "checkpoint-3-broken").mkdir()  # not a checkpoint-N model folder: ignored
    sampling = dict(prompt_template="plain", max_new_tokens=6, temperature=1.0, seed=0, metrics=["accuracy"])
    evaluate.main(EvalConfig(model=str(run / "checkpoint-1"), dataset=data, output_dir=str(tmp_path / "probe"),
                             **sampling))
    with open(tmp_path / "probe" / "generations.jsonl") as f:
        said = [json.loads(line)["predicted_answer"] for line in f]
    keep = [i for i, answer in enumerate(said) if answer]
    assert len(keep) >= 4
    questions = Dataset.load_from_disk(os.path.join(data, "test")).select(keep)
    rigged = questions.remove_columns("answer").add_column("answer", [said[i] for i in keep])
    DatasetDict({"test": rigged}).save_to_disk(str(tmp_path / "rigged"))

    result = evaluate.main(EvalConfig(select_best=str(run), dataset=str(tmp_path / "rigged"), **sampling))
    assert result["best_checkpoint"] == str(run / "checkpoint-1") and result["value"] == 1.0
    assert result["scores"][str(run / "checkpoint-2")] < 1.0
    written = json.loads((run / "eval" / "best_checkpoint.json").read_text())
    assert written == result
    assert os.path.isfile(run / "eval" / "checkpoint-2" / "metrics.json")
    shutil.rmtree(run)


def test_reasoning_states_answer():
    from utils.eval.grading import reasoning_states_answer

    assert reasoning_states_answer(["I see circles", "There are 3 circles"], "3")
    assert not reasoning_states_answer(["There are 4 circles"], "3")  # right or wrong answer, reasons disagree
    assert not reasoning_states_answer(["There are 13 circles"], "3")  # whole words only
    assert not reasoning_states_answer([], "3") and not reasoning_states_answer(["There are 3"], "")
    assert reasoning_states_answer(["So the shape is Red"], "red")


def test_base_url_generates_through_an_openai_compatible_server(tmp_path):
    """evaluate.py --base_url: images go as data URLs, each row gets seed + index, answers are scored."""
    import json as _json

    from evaluate import EvalConfig
    from evaluate import main as evaluate_main
    from tests.test_reward_servers import Loopback, _chat_reply
    from tiny.shapes import make_shapes_vqa

    data = tmp_path / "shapes"
    rows = make_shapes_vqa(4, seed=2, kinds=("count",))
    rows.save_to_disk(str(data))
    answers = {r["question"]: r["answer"] for r in rows}
    seen = []

    def respond(attempt, path, body):
        request = _json.loads(body)
        content = request["messages"][-1]["content"]
        assert path == "/v1/chat/completions" and request["model"] == "served"
        assert any(p["type"] == "image_url" and p["image_url"]["url"].startswith("data:image/") for p in content)
        question = next(p["text"] for p in content if p["type"] == "text")
        seen.append(request["seed"])
        answer = answers[question] if request["seed"] % 2 == 0 else "9"  # odd rows answer wrongly
        return _chat_reply(_json.dumps({"reasoning_steps": ["I count them"], "answer": answer}))

    server = Loopback(respond)
    try:
        evaluate_main(EvalConfig(base_url=server.url + "/v1", served_model_name="served", dataset=str(data),
                                 split="train", metrics=["accuracy"], seed=10, output_dir=str(tmp_path / "out")))
    finally:
        server.close()
    assert sorted(seen) == [10, 11, 12, 13]
    metrics = _json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["accuracy"] == 0.5
