"""distill.py: the chain filters (table-driven), the append-only output, and whole runs against real
OpenAI-compatible servers on 127.0.0.1 (`transformers serve` serving tiny local models; a hand-written server
only for the failure cases: 5xx, timeouts, malformed replies), including a SIGKILL mid-run and the restart."""

import os

import pytest

from distill import DistillConfig, read_records, validate
from utils.chains import cut_reflection, filter_chains, final_answer, parse_chain, select_chain, sft_target

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the filters, one table each -------------------------------------------------------------------------

@pytest.mark.parametrize("text, reasoning, answer", [
    ("<think>I see 2 circles.</think><answer>2</answer>", "I see 2 circles.", "2"),
    # R1 templates put <think> in the prompt: the chain starts inside the thinking
    ("I count them. 3 in all.\n</think>\n\nSo the answer is \\boxed{3}.", "I count them. 3 in all.", "3"),
    # a boxed draft inside the thinking loses to the final word after it
    ("<think>maybe \\boxed{4}? no.</think> The answer is \\boxed{\\frac{1}{2}}", "maybe \\boxed{4}? no.",
     "\\frac{1}{2}"),
    ("<think>only thinking</think>", "only thinking", None),
    ("no tags at all, 5", "no tags at all, 5", None),
    ("Steps first. <answer>yes</answer>", "Steps first.", "yes"),
    ("<think>a</think><answer>1</answer><answer>2</answer>", "a", "2"),  # the last answer block counts
    ("<think>a</think><answer>  </answer>", "a", None),  # an empty answer is no answer
])
def test_parse_chain(text, reasoning, answer):
    assert parse_chain(text) == (reasoning, answer)


@pytest.mark.parametrize("text, kept, cut", [
    ("There are 2 circles. Wait, let me count again. There are 3.", "There are 2 circles.", True),
    ("2 circles. But wait, maybe 3.", "2 circles.", True),  # "But wait" comes before its "wait"
    ("Two. But the question asks for shapes. So 3.", "Two.", True),
    ("I will await the result: 2.", "I will await the result: 2.", False),  # whole words only
    ("Waiting is not a marker. 2.", "Waiting is not a marker. 2.", False),
    ("wait, lower case is not cut. 2.", "wait, lower case is not cut. 2.", False),  # case-sensitive
    ("Wait at the start leaves nothing.", "", True),
    ("A. But the question. Wait.", "A.", True),  # the earliest marker wins
])
def test_cut_reflection(text, kept, cut):
    assert cut_reflection(text) == (kept, cut)


@pytest.mark.parametrize("lengths, rule, index", [
    ([5, 3, 9], "shortest", 1),
    ([5, 3, 9], "longest", 2),
    ([5, 3, 9], "next_longest", 0),
    ([4, 4, 2], "shortest", 2),
    ([4, 4, 2], "longest", 0),  # ties: the first
    ([4, 4, 2], "next_longest", 1),
    ([7], "next_longest", 0),  # one chain: it is kept
])
def test_select_chain(lengths, rule, index):
    assert select_chain(lengths, rule) == index


def test_select_chain_rejects_unknown_rules_and_empty_lists():
    with pytest.raises(ValueError, match="--select 'median'"):
        select_chain([1, 2], "median")
    with pytest.raises(ValueError, match="no chains"):
        select_chain([], "shortest")


@pytest.fixture(scope="module")
def grade():
    from utils.chains import Grader

    return Grader()


@pytest.mark.parametrize("question, predicted, gold, correct", [
    ("How many circles?", "2", "2", True),
    ("What is x?", "1/2", "0.5", True),  # math-verify
    ("What is x?", "\\frac{1}{2}", "0.5", True),
    ("What is x?", "0.55", "0.5", True),  # CRYSTAL's relative numeric tolerance
    ("What is x?", "0.6", "0.5", False),
    ("How many?", "2.0", "2", True),
    ("Is it red?", "Yes", "yes", True),  # CRYSTAL's yes/no rule
    ("Which one?\n\nA) red\nB) blue", "B) blue", "B", True),  # options
    ("Which one?\n\nA) red\nB) blue", "A", "B", False),
    ("Colour?", "green", "<answer>green</answer>", True),  # gold written as an answer block
    ("How many?", "3", "2", False),
])
def test_grading(grade, question, predicted, gold, correct):
    assert grade(question, predicted, gold) is correct


CORRECT_SHORT = "<think>I see two.</think><answer>2</answer>"
CORRECT_LONG = "<think>I look carefully at the picture. There are two circles.</think><answer>2</answer>"
REFLECTING = "<think>I see two. Wait, let me count again. Two.</think><answer>2</answer>"
WRONG = "<think>I see three.</think><answer>3</answer>"
NO_ANSWER = "<think>I see things.</think>"


@pytest.mark.parametrize("chains, options, reason, target", [
    ([WRONG, CORRECT_LONG, CORRECT_SHORT], {}, "kept", sft_target("I see two.", "2")),
    ([WRONG, CORRECT_LONG, CORRECT_SHORT], {"select": "longest"}, "kept",
     sft_target("I look carefully at the picture. There are two circles.", "2")),
    ([REFLECTING], {}, "kept", sft_target("I see two.", "2")),
    ([REFLECTING], {"cut_reflections": False}, "kept", sft_target("I see two. Wait, let me count again. Two.", "2")),
    ([WRONG, NO_ANSWER], {}, "wrong_answer", None),
    ([NO_ANSWER, NO_ANSWER], {}, "no_answer", None),
    ([CORRECT_LONG], {"max_words": 5}, "over_word_limit", None),
    ([CORRECT_SHORT], {"max_words": 3}, "kept", sft_target("I see two.", "2")),
    ([CORRECT_LONG], {"max_words": None}, "kept", sft_target("I look carefully at the picture. There are two "
                                                             "circles.", "2")),
    (["<think>Wait, two.</think><answer>2</answer>"], {}, "empty_after_cut", None),
    # the word limit applies after the cut: a long reflection does not count against the chain
    (["<think>Two. Wait, " + "recount " * 50 + "</think><answer>2</answer>"], {"max_words": 10}, "kept",
     sft_target("Two.", "2")),
    # selection happens on the chains as written, before the cut (the report's order)
    (["<think>Two circles, I am sure. Wait, " + "x " * 30 + "</think><answer>2</answer>", CORRECT_LONG],
     {"select": "shortest"}, "kept", sft_target("I look carefully at the picture. There are two circles.", "2")),
])
def test_filter_chains(grade, chains, options, reason, target):
    outcome = filter_chains(chains, question="How many circles?", gold="2", grade=grade, **options)
    assert (outcome.reason, outcome.target) == (reason, target)
    assert outcome.correct == [final_answer(c) == "2" for c in chains]


def test_read_records_drops_a_line_cut_short_by_a_kill(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "mess')
    assert [r["id"] for r in read_records(str(path))] == ["a", "b"]
    assert path.read_text() == '{"id": "a"}\n{"id": "b"}\n'  # the next append starts on a fresh line
    assert read_records(str(tmp_path / "missing.jsonl")) == []


@pytest.mark.parametrize("flags, message", [
    ({"num_chains": 0}, "--num_chains must be >= 1"),
    ({"reasoner_base_url": None, "reasoner_serve": False}, "exactly one of --reasoner_base_url"),
    ({"reasoner_serve": True}, "exactly one of --reasoner_base_url"),
    ({"captioner_base_url": "http://127.0.0.1:1/v1"}, "--captioner_base_url needs --captioner_model"),
    ({"caption_column": "c", "captioner_base_url": "http://x/v1", "captioner_model": "m"}, "one caption source"),
    ({"reasoner_prompt": "only {caption}"}, r"must contain \{question\}"),
    ({"chain_source": "model"}, "exactly one of --model or --model_base_url"),
    ({"chain_source": "model", "model_base_url": "http://x/v1"}, "--served_model_name"),
])
def test_bad_flags_fail_before_any_work(flags, message):
    cfg = DistillConfig(**{"reasoner_base_url": "http://127.0.0.1:1/v1", **flags})
    with pytest.raises(ValueError, match=message):
        validate(cfg)
