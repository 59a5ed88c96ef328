"""Reward registry and the text / CRYSTAL / synthetic-T2I rewards.

CRYSTAL rewards are checked against crystal-metrics itself on a generated corpus that covers the cases the
package treats differently (JSON and <think> formats, MCQ letters, numbers, yes/no, missing steps, broken
JSON); the others against hand-computed values."""

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
from crystal_metrics import rewards as cm

from rewards import get_reward, list_rewards, register
from rewards.common import completion_text, process_rank
from rewards.text import soft_overlong_penalty

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- a corpus that exercises crystal-metrics' branches ----------------------------------------------------

SUBJECTS = ["red circle", "blue square", "green triangle", "yellow star", "purple hexagon"]


def _steps(rng, k):
    return [f"The {rng.choice(SUBJECTS)} is in row {rng.randint(1, 3)} of the image" for _ in range(k)]


def _answers(rng):
    kind = rng.choice(["number", "mcq", "yesno", "text"])
    if kind == "number":
        gt = str(rng.randint(0, 12))
        pred = rng.choice([gt, f"{gt}.0", f"{gt} objects", str(int(gt) + 1), "about " + gt, "none"])
        return gt, pred, ""
    if kind == "mcq":
        options = rng.sample(["red", "blue", "green", "yellow"], 4)
        gt = rng.choice("ABCD")
        pick = rng.choice("ABCD")
        pred = rng.choice([pick, f"({pick})", f"{pick}) {options['ABCD'.index(pick)]}",
                           options["ABCD".index(pick)], f"The answer is {pick}"])
        question = "Which color?\n\n" + "\n".join(f"{letter}) {o}" for letter, o in zip("ABCD", options))
        return gt, pred, question
    if kind == "yesno":
        gt = rng.choice(["Yes", "No"])
        return gt, rng.choice(["yes", "no", "True", "Yes, it is"]), "Is there a circle?"
    gt = rng.choice(["the circle is left of the square", "a purple hexagon"])
    return gt, rng.choice([gt, gt.upper(), "something else entirely here", gt[:8]]), "Describe it."


def _completion(rng, steps, pred):
    form = rng.choice(["json", "json_fenced", "json_prose", "think_steps", "think_numbered", "think_bullets",
                       "think_lines", "broken_json", "no_steps_json", "plain"])
    if form == "json":
        return json.dumps({"reasoning_steps": steps, "answer": pred})
    if form == "json_fenced":
        return "```json\n" + json.dumps({"reasoning_steps": steps, "answer": pred}, indent=2) + "\n```"
    if form == "json_prose":
        return "Here is my analysis: " + json.dumps({"reasoning_steps": steps, "answer": pred}) + " Done."
    if form == "think_steps":
        think = " ".join(f"Step {i + 1}: {s}." for i, s in enumerate(steps))
        return f"<think>{think}</think><answer>{pred}</answer>"
    if form == "think_numbered":
        think = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(steps))
        return f"<think>\n{think}\n</think>\n<answer>{pred}</answer>"
    if form == "think_bullets":
        return "<think>" + "".join(f"- {s}\n" for s in steps) + f"</think><answer>{pred}</answer>"
    if form == "think_lines":
        return "<think>" + "\n".join(steps) + "</think>"  # no answer tag
    if form == "broken_json":
        return '{"reasoning_steps": ["' + '", "'.join(steps) + f'",], "answer": \'{pred}\'' + "}"
    if form == "no_steps_json":
        return json.dumps({"reasoning_steps": [], "answer": pred})
    return f"The answer is {pred}"


def make_corpus(n=240, seed=0):
    rng = random.Random(seed)
    rows = {"completions": [], "answer": [], "reference_steps": [], "question": []}
    for _ in range(n):
        reference = _steps(rng, rng.randint(2, 5))
        if rng.random() < 0.15:
            reference = []  # a row with missing reference steps
        predicted = rng.choice([reference[: rng.randint(1, 5)] if reference else [], _steps(rng, rng.randint(1, 4)),
                                [s.replace("row", "line") for s in reference]]) or _steps(rng, 2)
        gt, pred, question = _answers(rng)
        rows["completions"].append(_completion(rng, predicted, pred))
        rows["answer"].append(gt)
        rows["reference_steps"].append(reference)
        rows["question"].append(question)
    return rows


@pytest.fixture(scope="module")
def corpus():
    rows = make_corpus()
    # the corpus must reach the branches it claims to, or equality below proves little
    cpr = cm.causal_process_reward(rows["completions"], ground_truths=rows["answer"],
                                   reference_steps=rows["reference_steps"])
    assert len({round(v, 6) for v in cpr}) > 8
    assert 0.2 < sum(v >= 0.6 for v in cpr) / len(cpr) < 0.8  # both correct and wrong answers
    assert 0.2 < sum(cm.format_reward(rows["completions"])) / len(cpr) < 0.8
    return rows


def _as_chat(completions):
    return [[{"role": "assistant", "content": c}] for c in completions]


@pytest.mark.parametrize("chat", [False, True])
def test_crystal_rewards_equal_crystal_metrics(corpus, chat):
    c, answer, steps, question = corpus["completions"], corpus["answer"], corpus["reference_steps"], corpus["question"]
    given = _as_chat(c) if chat else c
    columns = dict(answer=answer, reference_steps=steps, question=question, image=[None] * len(c))
    assert get_reward("format")(given, **columns) == cm.format_reward(c)
    assert get_reward("accuracy")(given, **columns) == cm.accuracy_reward(c, solution=answer, problem=question)
    assert get_reward("cpr")(given, **columns) == cm.causal_process_reward(c, ground_truths=answer,
                                                                            reference_steps=steps)
    assert get_reward("cpr", answer_weight=0.65, step_weight=0.35)(given, **columns) == cm.causal_process_reward(
        c, ground_truths=answer, reference_steps=steps, answer_weight=0.65, step_weight=0.35)
    assert get_reward("reasoning")(given, **columns) == cm.word_overlap_reasoning_reward(c, reference_steps=steps)
    assert get_reward("reasoning", threshold=0.3)(given, **columns) == cm.word_overlap_reasoning_reward(
        c, reference_steps=steps, threshold=0.3)


def test_cpr_formula_and_weights_are_applied():
    steps = ["There are three red circles", "Three circles means the answer is 3"]
    right = json.dumps({"reasoning_steps": steps, "answer": "3"})
    wrong = json.dumps({"reasoning_steps": steps, "answer": "5"})
    cols = dict(answer=["3", "3", None], reference_steps=[steps, steps, steps])
    assert get_reward("cpr")([right, wrong, right], **cols) == pytest.approx([0.6 + 0.4, 0.4 * 0.3, None])
    got = get_reward("cpr", answer_weight=0.65, step_weight=0.35)([right, wrong, right], **cols)
    assert got == pytest.approx([1.0, 0.35 * 0.3, None])
    half = json.dumps({"reasoning_steps": steps[:1] + ["unrelated words entirely"], "answer": "3"})
    f1 = 0.5  # one of two predicted steps matches one of two references
    assert get_reward("cpr")([half], answer=["3"], reference_steps=[steps])[0] == pytest.approx(0.6 + 0.4 * f1)


def test_cpr_combination_is_crystal_metrics_own(corpus):
    """cpr_score with crystal-metrics' word-overlap F1 and answer check reproduces its causal_process_reward, so the
    embedding matcher changes only the step term."""
    from rewards.crystal import cpr_score

    c, answer, steps = corpus["completions"], corpus["answer"], corpus["reference_steps"]
    ours = []
    for text, gt, ref in zip(c, answer, steps):
        pred_steps, pred = cm.parse_reasoning_steps(text)
        ref = [s.strip() for s in ref if s and s.strip()]
        f1 = cm._step_alignment_f1(pred_steps, ref, threshold=0.3) if pred_steps and ref else 0.0
        ours.append(cpr_score(cm.check_answer_match(pred, gt), f1, 0.6, 0.4))
    assert ours == pytest.approx(cm.causal_process_reward(c, ground_truths=answer, reference_steps=steps), abs=1e-12)


def test_cpr_embedding_matcher_pays_on_evaluates_match_f1(corpus):
    """step_matcher='embedding' pays CPR on the Match F1 that evaluate.py --metrics crystal reports."""
    import torch

    from rewards.crystal import cpr_score
    from utils.eval.grading import crystal_scores, resolve_embedding_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        picked = [i for i, ref in enumerate(corpus["reference_steps"]) if ref][:24]
        rows = [dict(id=str(i), question=corpus["question"][i], answer=corpus["answer"][i],
                     reference_steps=corpus["reference_steps"][i]) for i in picked]
        texts = [corpus["completions"][i] for i in picked]
        fn = get_reward("cpr", step_matcher="embedding")
        got = fn(_as_chat(texts), answer=[r["answer"] for r in rows],
                 reference_steps=[r["reference_steps"] for r in rows])
        # evaluate.py's matcher on the same steps (every completion kept, so the F1 is per completion)
        predictions, references = {}, {}
        for r, text in zip(rows, texts):
            pred_steps, pred = cm.parse_reasoning_steps(text)
            predictions[r["id"]] = {"question": r["question"], "answer": pred or "-",
                                    "reasoning_steps": [str(x).strip() for x in pred_steps if str(x).strip()]}
            references[r["id"]] = {"reference_steps": r["reference_steps"], "answer": r["answer"]}
        model, threshold = resolve_embedding_model("all-MiniLM-L6-v2")
        _, per_sample = crystal_scores(predictions, references, embedding_model=model, threshold=threshold, alpha=0.0)
        want = [cpr_score(cm.check_answer_match(cm.parse_reasoning_steps(t)[1], r["answer"]),
                          per_sample[r["id"]]["match_f1"], 0.6, 0.4) for r, t in zip(rows, texts)]
        assert got == pytest.approx(want, abs=1e-6)
        # a paraphrase: word overlap finds no match, the embedding matcher does
        ref = [["There are two red circles in the picture"]]
        para = json.dumps({"reasoning_steps": ["A pair of crimson rings appears in the image"], "answer": "2"})
        assert get_reward("cpr")([para], answer=["2"], reference_steps=ref) == [0.6]
        assert fn([para], answer=["2"], reference_steps=ref) == [pytest.approx(1.0)]
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="step_matcher must be one of"):
        get_reward("cpr", step_matcher="cosine")
    with pytest.raises(ValueError, match="need step_matcher='embedding'"):
        get_reward("cpr", embedding_model="all-distilroberta-v1")


def test_crystal_rewards_name_missing_columns():
    with pytest.raises(ValueError, match="needs the dataset column 'answer'.*reference_steps"):
        get_reward("cpr")(["x"], reference_steps=[["a"]])
    with pytest.raises(ValueError, match="'reference_steps'"):
        get_reward("reasoning")(["x"], answer=["a"])
    with pytest.raises(ValueError, match="column 'answer' has 2 entries for 1"):
        get_reward("accuracy")(["x"], answer=["a", "b"])
    with pytest.raises(ValueError, match="row 0 is a string"):
        get_reward("cpr")(["x"], answer=["a"], reference_steps=["one step"])


# --- SPR with the packaged offline MiniLM -----------------------------------------------------------------

@pytest.fixture(scope="module")
def spr():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small encode calls run faster on one thread than fighting over a busy CPU
    yield get_reward("spr")  # loads the model once for this module
    torch.set_num_threads(threads)


def test_spr_equals_crystal_metrics_with_the_same_model(spr, corpus):
    from rewards.crystal import load_embedder

    # crystal-metrics embeds only schema-valid completions with references: take 12 of those and 4 others
    valid = [i for i, ok in enumerate(cm.format_reward(corpus["completions"])) if ok and corpus["reference_steps"][i]]
    picked = valid[:12] + [i for i in range(len(corpus["completions"])) if i not in valid][:4]
    c = [corpus["completions"][i] for i in picked]
    steps = [corpus["reference_steps"][i] for i in picked]
    model = load_embedder(None).model  # the SentenceTransformer itself, called once per completion
    assert spr(_as_chat(c), reference_steps=steps) == pytest.approx(
        cm.semantic_reasoning_reward(c, reference_steps=steps, model=model), abs=1e-9)


def test_spr_scores_paraphrase_above_unrelated(spr):
    ref = [["There are two red circles in the picture"]]
    para = json.dumps({"reasoning_steps": ["The image shows a pair of red circles"], "answer": "2"})
    other = json.dumps({"reasoning_steps": ["Bananas are a good source of potassium"], "answer": "2"})
    assert spr([para, other], reference_steps=ref * 2) == [1.0, 0.0]
    # word overlap alone does not match the paraphrase: SPR really uses the embeddings
    assert get_reward("reasoning")([para], reference_steps=ref) == [0.0]


def test_spr_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        get_reward("spr", model=str(tmp_path / "no-such-model"))
    with pytest.raises(OSError, match="could not load the SPR embedding model 'no-such-org/no-such-model'"):
        get_reward("spr", model="no-such-org/no-such-model")


# --- think_format, math_accuracy, overlong_penalty ---------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("<think>I count 3.</think><answer>3</answer>", 1.0),
    ("  <think>\nmulti\nline\n</think>\n\n<answer> 3 </answer>\n", 1.0),
    ("<think>a</think><answer>3</answer></answer>", 0.0),          # repeated closing tail
    ("<think>a</think><answer>3</answer> extra", 0.0),            # trailing text
    ("preamble <think>a</think><answer>3</answer>", 0.0),
    ("<answer>3</answer><think>a</think>", 0.0),                  # wrong order
    ("<think>a<think>b</think></think><answer>3</answer>", 0.0),  # nested
    ("<think>a</think><answer>3</answer><answer>4</answer>", 0.0),
    ("<think>a</think>", 0.0),
    ("3", 0.0),
])
def test_think_format(text, expected):
    assert get_reward("think_format")([text, [{"role": "assistant", "content": text}]]) == [expected, expected]


@pytest.mark.parametrize("pred,gold,expected", [
    ("3", "3", 1.0), ("3.0", "3", 1.0), ("0.5", "1/2", 1.0), ("\\frac{1}{2}", "0.5", 1.0),
    ("1+x", "x+1", 1.0), ("2\\sqrt{2}", "\\sqrt{8}", 1.0), ("\\boxed{12}", "12", 1.0), ("x = 4", "4", 1.0),
    ("4", "3", 0.0), ("The answer is 3", "3", 1.0), ("B", "B", 1.0), ("(B)", "B", 1.0), ("B) blue", "B", 1.0),
    ("C", "B", 0.0), ("Red.", "red", 1.0), ("der", "red", 0.0), ("blue", "red", 0.0), ("", "3", 0.0),
    ("1,000", "1000", 1.0), ("-2.00", "-2", 1.0), ("1.000", "1,000", 0.0), (".5", "1/2", 1.0), ("12", "13", 0.0),
    ("50\\%", "50", 1.0), ("\\frac{7}{3}", "7", 0.0), ("0.3333333", "1/3", 1.0),
])
def test_math_accuracy_cases(pred, gold, expected):
    text = f"<think>working</think><answer>{pred}</answer>"
    assert get_reward("math_accuracy")([text], answer=[gold]) == [expected]


def test_math_accuracy_needs_answer_block_and_reads_last_one():
    fn = get_reward("math_accuracy")
    texts = ["<think>3</think> 3", "<answer>2</answer> wait <answer>3</answer>", "<answer>3</answer>", "x"]
    assert fn(texts, answer=["3", "3", "<answer>3</answer>", None]) == [0.0, 1.0, 1.0, None]
    with pytest.raises(ValueError, match="'answer'"):
        fn(texts)


def test_overlong_penalty_dapo_shape_equals_trl():
    from trl.rewards import get_soft_overlong_punishment  # requirements-dev.txt (CI installs it)

    assert [soft_overlong_penalty(n, 100, 20) for n in (0, 80, 90, 99, 100, 150)] == pytest.approx(
        [0, 0, -0.5, -0.95, -1, -1])
    fn = get_reward("overlong_penalty", max_completion_length=100, buffer_length=20)
    ids = [[1] * n for n in (0, 79, 80, 81, 90, 99, 100, 101, 120)]
    trl = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert fn(["x"] * len(ids), completion_ids=ids) == pytest.approx(trl(completion_ids=ids))
    chars = get_reward("overlong_penalty", max_completion_length=10, buffer_length=4, unit="chars")
    assert chars(["123456", "12345678", [{"role": "assistant", "content": "x" * 30}]]) == pytest.approx(
        [0.0, -0.5, -1.0])
    with pytest.raises(ValueError, match="completion_ids"):
        fn(["abc"])
    with pytest.raises(ValueError, match="max_completion_length"):
        get_reward("overlong_penalty")
    with pytest.raises(ValueError, match="buffer_length"):
        get_reward("overlong_penalty", max_completion_length=10, buffer_length=20)


def test_overlong_penalty_counts_tokens_with_a_tokenizer():
    class WordTokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": text.split()}

    fn = get_reward("overlong_penalty", max_completion_length=4, buffer_length=2, tokenizer=WordTokenizer())
    assert fn(["a b", "a b c", "a b c d e"]) == pytest.approx([0.0, -0.5, -1.0])


# --- shapes_t2i ---------------------------------------------------------------------------------------------

def test_shapes_t2i_wraps_the_local_scorer():
    from PIL import Image

    from tiny.detector import score_t2i
    from tiny.t2i import make_t2i_prompts, render_t2i

    rows = make_t2i_prompts(12, seed=3)
    images = [render_t2i(r, image_size=64, seed=i) for i, r in enumerate(rows)]
    blank = Image.new("RGB", (64, 64), "white")
    images[1], images[2] = blank, None
    cols = {k: [r[k] for r in rows] for k in ("tag", "include", "exclude", "prompt")}
    got = get_reward("shapes_t2i")(["<think>x</think>"] * 12, images=images, **cols)
    assert got[2] is None and got[1] < 1.0
    assert [g for i, g in enumerate(got) if i not in (1, 2)] == [1.0] * 10  # rendered to satisfy their rows
    assert got[1] == score_t2i(blank, rows[1])["score"]
    strict = get_reward("shapes_t2i", key="strict")(["x"] * 2, images=[images[0], blank], metadata=rows[:2])
    assert strict == [1.0, score_t2i(blank, rows[1])["strict"]]
    with pytest.raises(ValueError, match="images="):
        get_reward("shapes_t2i")(["x"], **{k: v[:1] for k, v in cols.items()})


def test_shapes_t2i_behaviours_and_logging_keys():
    from PIL import Image

    from tiny.detector import score_t2i
    from tiny.t2i import render_t2i

    row = {"tag": "counting", "include": [{"class": "circle", "count": 2}],
           "exclude": [{"class": "circle", "count": 3}], "prompt": "a photo of two circles"}
    blank, good = Image.new("RGB", (32, 32), "white"), render_t2i(row, image_size=32, seed=0)
    more = render_t2i({**row, "include": [{"class": "circle", "count": 3}]}, image_size=32, seed=0)
    images = [blank, good, more]

    def reward(**options):
        return get_reward("shapes_t2i", **options)(["x"] * 3, images=images, metadata=[row] * 3)

    assert reward() == reward(behaviour="tiny") == [0.0, 1.0, pytest.approx(2 / 2.5)]
    assert reward(behaviour="geneval") == [0.5, 1.0, pytest.approx((1 + 2 / 3) / 2)]  # GenEval: exclude half-met
    assert reward(behaviour="geneval") == [score_t2i(im, row, behaviour="geneval")["score"] for im in images]
    assert reward(key="strict") == [0.0, 1.0, 0.0]
    assert reward(key="detected") == [0.0, 2.0, 3.0] and reward(key="requested") == [2.0] * 3
    assert reward(key="extra") == [0.0, 0.0, 1.0]
    # the price of an extra object: 2 / (2 + w * 1) for one circle too many; the default w is 0.5
    assert reward(extra_weight=2.0) == [0.0, 1.0, pytest.approx(2 / 4)]
    assert reward(extra_weight=0.0) == [0.0, 1.0, 1.0] and reward(extra_weight=0.5) == reward()
    with pytest.raises(ValueError, match="extra_weight prices extra objects under behaviour 'tiny' only"):
        get_reward("shapes_t2i", behaviour="geneval", extra_weight=1.0)
    with pytest.raises(ValueError, match="extra_weight must be a number >= 0, got -1"):
        get_reward("shapes_t2i", extra_weight=-1)
    with pytest.raises(ValueError, match="behaviour must be one of"):
        get_reward("shapes_t2i", behaviour="gen_eval")
    with pytest.raises(ValueError, match="key must be one of"):
        get_reward("shapes_t2i", key="partial")


# --- registry -----------------------------------------------------------------------------------------------

def test_registry_lists_the_contract_names():
    import tiny  # noqa: F401 (the tiny world registers shapes_t2i, as every script imports it)

    assert set(list_rewards()) >= {"format", "accuracy", "cpr", "spr", "reasoning", "think_format",
                                   "math_accuracy", "overlong_penalty", "geneval", "judge_geneval_plus",
                                   "judge_tiif", "shapes_t2i"}
    assert get_reward("cpr").__name__ == "cpr"  # TRL logs rewards by __name__


def test_the_tiny_world_registers_its_reward_and_names_when_imported():
    code = ("import rewards; from utils.core import names; before = 'shapes_t2i' in rewards.list_rewards(); "
            "import tiny, tiny.cache; print(before, 'shapes_t2i' in rewards.list_rewards(), "
            "names.resolve_dataset('some/set'), names.resolve_model('tiny-x'), "
            "tiny.cache.resolve_dataset in names._RESOLVERS['dataset'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split() == ["False", "True", "some/set", "tiny-x", "True"]


def test_unknown_name_and_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match=r"unknown reward 'cprr'; valid names: .*cpr.*think_format"):
        get_reward("cprr")
    with pytest.raises(ValueError, match=r"reward 'cpr' has no option\(s\) \['answer_weigth'\].*answer_weight"):
        get_reward("cpr", answer_weigth=0.5)
    with pytest.raises(ImportError, match="cannot import module 'no_such_pkg.mod'"):
        get_reward("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        get_reward("rewards.text:nope")
    with pytest.raises(ValueError, match="not a function"):
        get_reward("rewards.text:ANSWER_RE")
    with pytest.raises(ValueError, match="must look like"):
        get_reward("rewards.text:")


def test_user_function_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_pkg").mkdir()
    (tmp_path / "my_rewards_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_rewards_pkg" / "mod.py").write_text(textwrap.dedent("""
        def length_bonus(completions, scale=1.0, **columns):
            return [scale * len(c if isinstance(c, str) else c[0]["content"]) for c in completions]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward("my_rewards_pkg.mod:length_bonus")
    assert fn(["ab", "abcd"], answer=["x", "y"]) == [2.0, 4.0]
    scaled = get_reward("my_rewards_pkg.mod:length_bonus", scale=0.5)
    assert scaled([[{"role": "assistant", "content": "abcd"}]]) == [2.0]
    assert scaled.__name__ == "length_bonus"
    sys.modules.pop("my_rewards_pkg.mod", None)
    sys.modules.pop("my_rewards_pkg", None)


def test_register_a_factory():
    @register("test_const_reward")
    def make(value=1.0):
        def const(completions, **columns):
            return [value] * len(completions)
        return const

    try:
        assert "test_const_reward" in list_rewards()
        assert get_reward("test_const_reward", value=0.25)(["a", "b"]) == [0.25, 0.25]
        with pytest.raises(ValueError, match="already registered"):
            register("test_const_reward", make)
        with pytest.raises(ValueError, match="already registered"):
            register("cpr", make)
    finally:
        from rewards import _REGISTERED
        _REGISTERED.pop("test_const_reward", None)


def test_completion_text_and_process_rank(monkeypatch):
    assert completion_text("x") == "x"
    parts = [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]
    assert completion_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": parts}]) == "ab"
    with pytest.raises(TypeError, match="string or a list of chat messages"):
        completion_text(3)
    monkeypatch.setenv("RANK", "5")
    if "accelerate.state" not in sys.modules or not sys.modules["accelerate.state"].PartialState._shared_state:
        assert process_rank() == 5


def test_rewards_pickle_and_take_trl_keywords(corpus, spr):
    """Trainers may ship rewards to worker processes, and TRL passes extra keywords besides the columns."""
    import pickle

    c = corpus["completions"][:40]
    columns = dict(answer=corpus["answer"][:40], reference_steps=corpus["reference_steps"][:40],
                   question=corpus["question"][:40])
    trl_extras = dict(prompts=["q"] * 40, completion_ids=[[1] * 5] * 40, trainer_state=object(),
                      log_extra=lambda *a: None, log_metric=lambda *a: None)
    for fn in [get_reward("format"), get_reward("accuracy"), get_reward("cpr", answer_weight=0.7, step_weight=0.3),
               get_reward("reasoning"), get_reward("think_format"), get_reward("math_accuracy"),
               get_reward("overlong_penalty", max_completion_length=8, buffer_length=4), spr,
               get_reward("geneval", reward_server_urls="http://127.0.0.1", reward_server_port="1", rank=0),
               get_reward("judge_tiif", base_url="http://127.0.0.1:1/v1", model="m")]:
        clone = pickle.loads(pickle.dumps(fn))
        assert clone.__name__ == fn.__name__
        if fn.__name__ not in ("geneval", "judge_tiif"):  # no server here
            assert clone(c, **columns, **trl_extras) == fn(c, **columns, **trl_extras)
    assert pickle.loads(pickle.dumps(get_reward("cpr", step_weight=0.3))).options["step_weight"] == 0.3


def test_trl_rewards_load_through_the_registry():
    fn = get_reward("trl.rewards:think_format_reward")
    chat = [[{"role": "assistant", "content": "<think>a</think>b"}], [{"role": "assistant", "content": "b"}]]
    assert fn(chat) == [1.0, 0.0]


def test_strict_format_rejects_text_around_the_json():
    fn = get_reward("strict_format")
    good = '{"reasoning_steps": ["There are 2 circles"], "answer": "2"}'
    assert fn([good, " " + good + "\n", good + "}}", "Answer: " + good, '{"answer": "2"}']) == [1.0, 1.0, 0.0, 0.0, 0.0]
    # crystal-metrics' lenient format accepts the trailing braces that strict_format rejects
    assert get_reward("format")([good + "}}"]) == [1.0]
