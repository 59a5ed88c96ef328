"""distill.py: the chain filters (table-driven), the append-only output, and whole runs against real
OpenAI-compatible servers on 127.0.0.1 (`transformers serve` serving tiny local models; a hand-written server
only for the failure cases: 5xx, timeouts, malformed replies), including a SIGKILL mid-run and the restart."""

import json
import os
import time

import pytest

from distill import DistillConfig, read_records, validate
from distill import main as distill_main
from tests.launch_helpers import finish, launch_python, sigkill_when
from utils.eval.chains import cut_reflection, filter_chains, final_answer, parse_chain, select_chain, sft_target

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
    from utils.eval.chains import Grader

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


# --- whole runs against real servers ---------------------------------------------------------------------

def _expected(server, rows, cfg):
    """What distill.py must make of each question: the served reasoner's chains for the prompt it is sent
    (greedy, so the same text every time), through the filters."""
    from rewards.judge import JudgeClient
    from utils.eval.chains import Grader

    client = JudgeClient(server.base_url, server.model_name, temperature=0.0, max_tokens=cfg.max_new_tokens)
    grade, out = Grader(), {}
    for r in rows:
        from tiny.cycle import scene_caption

        prompt = cfg.reasoner_prompt.format(caption=scene_caption(r), question=r["question"])
        chains = [client.chat(prompt, reasoning=True) for _ in range(cfg.num_chains)]
        out[r["id"]] = filter_chains(chains, question=r["question"], gold=r["answer"], grade=grade)
    return out


def _cfg(questions, out, **overrides):
    values = dict(dataset=questions, caption_column="caption", captioner=None, num_chains=2, temperature=0.0,
                  max_new_tokens=64, max_concurrency=2, output_dir=str(out), retry_backoff=0.01, request_timeout=60)
    values.update(overrides)
    return DistillConfig(**values)


@pytest.mark.slow
@pytest.mark.full  # the fast tier serves the reasoner in the cycle-resume test (test_iterate.py)
def test_distill_with_a_served_reasoner_writes_what_the_filters_keep(distill_world, reasoner_server, tmp_path):
    from utils.core.data import load_sharegpt

    questions, rows, reasoner = distill_world
    # distill.py starts its own `transformers serve` of the reasoner (--reasoner_serve), as the tiny cycle does
    cfg = _cfg(questions, tmp_path / "out", reasoner_serve=True, reasoner_model=reasoner)
    summary = distill_main(cfg)
    expected = _expected(reasoner_server, rows, cfg)
    kept = {r["id"]: r for r in read_records(str(tmp_path / "out" / "sft.jsonl"))}
    drops = {d["id"]: d for d in read_records(str(tmp_path / "out" / "drops.jsonl"))}
    assert set(kept) | set(drops) == {r["id"] for r in rows} and not set(kept) & set(drops)
    for qid, outcome in expected.items():
        if outcome.target is not None:
            assert kept[qid]["messages"][-1]["content"] == outcome.target
            assert kept[qid]["reflection_cut"] == outcome.cut
        else:
            assert drops[qid]["reason"] == outcome.reason
    # the memorised reasoner gets most chains right, and some carry a reflection that was cut
    assert summary["kept"] >= len(rows) // 2 and summary["reflections_cut"] >= 1
    assert summary["questions"] == len(rows) and sum(summary["drop_reasons"].values()) == summary["dropped"]
    # train_sft.py reads the file: system turn, one <image> marker per image, images on disk
    table = load_sharegpt(str(tmp_path / "out" / "sft.jsonl"))
    first = table[0]
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant"]
    assert first["messages"][1]["content"].startswith("<image>How many") and len(first["images"]) == 1
    assert os.path.isfile(tmp_path / "out" / kept[first["id"]]["images"][0]) or os.path.isabs(
        kept[first["id"]]["images"][0])
    assert (tmp_path / "out" / "reasoner_server.log").exists()


@pytest.mark.slow
@pytest.mark.full  # the fast tier serves the reasoner in the cycle-resume test (test_iterate.py)
def test_captions_from_a_served_vlm_and_from_a_local_one(distill_world, reasoner_server, tmp_path):
    from rewards.judge import JudgeClient
    from tests.distill_helpers import train_memorized_captioner
    from utils.core.serving import LocalServer

    questions, rows, _ = distill_world
    # a tiny VLM trained briefly on the first four scenes' descriptions, so its captions are real text
    vlm = train_memorized_captioner(rows[:4], str(tmp_path / "captioner"))
    common = dict(max_samples=4, reasoner_base_url=reasoner_server.base_url,
                  reasoner_model=reasoner_server.model_name, caption_column=None, caption_max_new_tokens=48)

    def captions(out):
        return {r["id"]: r["caption"] for r in read_records(str(out / "sft.jsonl")) + read_records(
            str(out / "drops.jsonl"))}

    with LocalServer(vlm, device="cpu") as server:
        distill_main(_cfg(questions, tmp_path / "remote", captioner_base_url=server.base_url,
                          captioner_model=server.model_name, **common))
        direct = JudgeClient(server.base_url, server.model_name, temperature=0.0, max_tokens=48)
        served = {r["id"]: direct.chat(DistillConfig.caption_prompt, r["image"]).strip() for r in rows[:4]}
    assert captions(tmp_path / "remote") == served
    assert all(len(c.split()) >= 5 and c.startswith("a ") for c in served.values()), served

    from utils.core.models import load_model_and_processor
    from utils.eval.heldout import generate_answers

    distill_main(_cfg(questions, tmp_path / "local", captioner=vlm, **common))
    model, processor = load_model_and_processor(vlm)
    texts = generate_answers(model, processor, [dict(r, question=DistillConfig.caption_prompt) for r in rows[:4]],
                             prompt_template="plain", max_new_tokens=48)
    local = {r["id"]: t.strip() for r, t in zip(rows[:4], texts)}
    assert captions(tmp_path / "local") == local and local == served


GOOD = "<think>I see them all. There are {a}.</think><answer>{a}</answer>"


@pytest.mark.slow
def test_retries_timeouts_and_malformed_replies(distill_world, tmp_path):
    from tests.test_reward_servers import Loopback, _chat_reply
    from tiny.cycle import scene_caption

    questions, rows, _ = distill_world
    by_caption = {scene_caption(r): r for r in rows}

    def row_of(body):
        """The question a reasoner request is about, from the caption line of its prompt."""
        prompt = json.loads(body)["messages"][0]["content"][-1]["text"]
        return by_caption[prompt.split("\n")[0].removeprefix("Image description: ")]

    failing = {rows[1]["id"]: "timeout", rows[2]["id"]: "malformed", rows[3]["id"]: "http400",
               rows[4]["id"]: "flaky"}
    seen = {}

    def respond(attempt, path, body):
        r = row_of(body)
        kind = failing.get(r["id"])
        seen[r["id"]] = seen.get(r["id"], 0) + 1
        if kind == "timeout":
            time.sleep(0.6)
        if kind == "malformed":
            return 200, b'{"choices": [{"message": {"content": {"not": "text"}}}]}'
        if kind == "http400":
            return 400, b"bad request"
        if kind == "flaky" and seen[r["id"]] <= 2:
            return 503, b"warming up"
        return _chat_reply(GOOD.format(a=r["answer"]))

    server = Loopback(respond)
    try:
        cfg = _cfg(questions, tmp_path / "out", max_samples=6, reasoner_base_url=server.url + "/v1",
                   reasoner_model="m", request_timeout=0.3, max_retries=2, num_chains=1)
        with pytest.raises(SystemExit) as stopped:
            distill_main(cfg)
        assert stopped.value.code == 1
        kept = {r["id"] for r in read_records(str(tmp_path / "out" / "sft.jsonl"))}
        # the flaky question was retried past its two 503s; the three failures are written nowhere
        assert kept == {rows[0]["id"], rows[4]["id"], rows[5]["id"]}
        assert read_records(str(tmp_path / "out" / "drops.jsonl")) == []
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert summary["failed_this_run"] == 3 and summary["kept"] == 3
        assert seen[rows[1]["id"]] == 3 and seen[rows[3]["id"]] == 1  # timeouts retried, client errors not
        assert seen[rows[2]["id"]] == 1  # a malformed reply is an error, not a retry
        # the server is fixed: a rerun asks only for the three questions that failed
        failing.clear()
        before = dict(seen)
        summary = distill_main(cfg)
        assert summary["kept"] == 6 and summary["failed_this_run"] == 0
        assert {q for q in seen if seen[q] > before.get(q, 0)} == {rows[1]["id"], rows[2]["id"], rows[3]["id"]}
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.full
def test_sigkill_mid_run_then_restart_finishes_every_question_once(distill_world, reasoner_server, tmp_path):
    import yaml

    questions, rows, _ = distill_world
    # the first 8 of the 16 questions (image paths made absolute): three runs of them, one request at a time
    rows = rows[:8]
    with open(questions) as f:
        records = [json.loads(line) for line in f][:len(rows)]
    questions = str(tmp_path / "questions.jsonl")
    with open(questions, "w") as f:
        for r in records:
            f.write(json.dumps(dict(r, image=os.path.join(os.path.dirname(distill_world[0]), r["image"]))) + "\n")
    cfg = dict(dataset=questions, caption_column="caption", captioner=None, num_chains=2, temperature=0.0,
               max_new_tokens=64, max_concurrency=1, reasoner_base_url=reasoner_server.base_url,
               reasoner_model=reasoner_server.model_name)

    def launch(out):
        recipe = tmp_path / f"{out}.yaml"
        recipe.write_text(yaml.safe_dump({**cfg, "output_dir": str(tmp_path / out)}))
        return launch_python("distill.py", ["--config", str(recipe)])

    def lines(out):
        return sum(len(read_records(str(tmp_path / out / f))) for f in ("sft.jsonl", "drops.jsonl"))

    finish(launch("full"), timeout=600)
    victim = launch("killed")
    sigkill_when(victim, lambda: lines("killed") >= 3, timeout=300)
    done = lines("killed")
    assert 3 <= done < len(rows), "the kill came after the run had finished"
    out = finish(launch("killed"), timeout=600)
    assert f"{done} finished earlier, {len(rows) - done} to do" in out
    ids = [r["id"] for f in ("sft.jsonl", "drops.jsonl") for r in read_records(str(tmp_path / "killed" / f))]
    assert sorted(ids) == sorted(r["id"] for r in rows)  # every question once, none twice

    def rows_of(out):
        return {r["id"]: r["messages"][-1]["content"] for r in read_records(str(tmp_path / out / "sft.jsonl"))}

    assert rows_of("killed") == rows_of("full")


@pytest.mark.slow
@pytest.mark.full  # the fast tier serves the reasoner in the cycle-resume test (test_iterate.py)
def test_max_kept_stops_at_exactly_that_many_rows(distill_world, reasoner_server, tmp_path):
    questions, rows, _ = distill_world
    # four questions in flight at a time: those finishing after the third kept row are not written
    summary = distill_main(_cfg(questions, tmp_path / "out", reasoner_base_url=reasoner_server.base_url,
                                reasoner_model=reasoner_server.model_name, num_chains=1, max_concurrency=4,
                                max_kept=3))
    kept = read_records(str(tmp_path / "out" / "sft.jsonl"))
    assert summary["kept"] == len(kept) == 3 and summary["questions"] < len(rows)


def test_ids_whose_image_files_would_collide_are_refused_naming_both_rows(tmp_path):
    """'q 1' and 'q_1' both sanitise to the file name 'q_1': the second row would silently get the first row's
    image. Refused before any request, naming both rows."""
    from tiny.shapes import make_shapes_vqa

    rows = make_shapes_vqa(3, seed=0)
    rows = rows.remove_columns("id").add_column("id", ["q 1", "q-2", "q_1"])
    rows.save_to_disk(str(tmp_path / "data"))
    cfg = DistillConfig(dataset=str(tmp_path / "data"), caption_column=None, captioner_base_url="http://127.0.0.1:9/v1",
                        captioner_model="m", reasoner_base_url="http://127.0.0.1:9/v1", output_dir=str(tmp_path / "o"))
    with pytest.raises(ValueError, match=r"rows 0 and 2 have ids 'q 1' and 'q_1', whose image files would both be "
                                         r"named 'q_1'"):
        distill_main(cfg)
    assert not (tmp_path / "o" / "sft.jsonl").exists()
