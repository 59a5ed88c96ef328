"""Loaders read every format (save_to_disk folder, json, jsonl, parquet, folder of files) and bad input
fails up front with an error naming the file, the row and the column."""

import json
import os

import datasets
import pytest
from PIL import Image

from tiny.shapes import make_shapes_vqa, shapes_vqa_rows
from tiny.t2i import make_t2i_prompts, write_jsonl
from utils.core.data import load_rl_rows, load_sharegpt, load_vqa, render_question
from utils.core.data_sources import load_table
from utils.core.errors import DataValidationError
from utils.t2i.data import load_geneval, load_tiif


def write_jsonl_rows(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture
def vqa_dir(tmp_path):
    """A folder with images/ and train.jsonl in user column names (img, prompt, label, steps, options)."""
    os.makedirs(tmp_path / "images")
    rows = []
    for i, row in enumerate(shapes_vqa_rows(4, seed=0)):
        row["image"].save(tmp_path / "images" / f"{i}.png")
        rows.append({"img": f"images/{i}.png", "prompt": row["question"], "label": row["answer"],
                     "steps": row["reference_steps"], "options": ["yes", "no"] if i == 1 else None,
                     "uid": f"u{i}", "extra": i})
    write_jsonl_rows(str(tmp_path / "train.jsonl"), rows)
    return tmp_path, rows


MAPPING = dict(image_column="img", question_column="prompt", answer_column="label", steps_column="steps",
               id_column="uid")


# ---------------------------------------------------------------------------- load_table: every format


def test_load_table_reads_json_jsonl_parquet_and_save_to_disk(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(3)]
    jsonl = write_jsonl_rows(str(tmp_path / "a.jsonl"), rows)
    (tmp_path / "a.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows[:1]), test=datasets.Dataset.from_list(rows[1:])) \
        .save_to_disk(str(tmp_path / "saved_dict"))
    for path in (jsonl, tmp_path / "a.json", tmp_path / "a.parquet", tmp_path / "saved"):
        assert load_table(str(path)).to_list() == rows, path
    assert load_table(str(tmp_path / "saved_dict"), split="test")["question"] == ["q1", "q2"]
    with pytest.raises(DataValidationError, match="no split 'validation'.*'test', 'train'"):
        load_table(str(tmp_path / "saved_dict"), split="validation")


def test_load_table_reads_a_folder_of_files_by_split(tmp_path):
    write_jsonl_rows(str(tmp_path / "d" / "train-0.jsonl"), [{"x": 1}, {"x": 2}])
    write_jsonl_rows(str(tmp_path / "d" / "train-1.jsonl"), [{"x": 3}])
    write_jsonl_rows(str(tmp_path / "d" / "test.jsonl"), [{"x": 9}])
    assert load_table(str(tmp_path / "d"))["x"] == [1, 2, 3]
    assert load_table(str(tmp_path / "d"), split="test")["x"] == [9]
    with pytest.raises(DataValidationError, match="no files for split 'dev'"):
        load_table(str(tmp_path / "d"), split="dev")


def test_unknown_hub_name_and_missing_path_give_clear_errors(tmp_path):
    with pytest.raises(DataValidationError) as error:
        load_table("no-such-user/no-such-dataset-xyz")
    assert "no-such-user/no-such-dataset-xyz" in str(error.value) and "Hub" in str(error.value)
    with pytest.raises(DataValidationError, match="no such file or folder"):
        load_table(str(tmp_path / "missing.jsonl"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataValidationError, match="unsupported file type '.txt'"):
        load_table(str(tmp_path / "notes.txt"))


# ---------------------------------------------------------------------------- load_vqa


def test_load_vqa_maps_columns_and_resolves_relative_image_paths(vqa_dir):
    folder, rows = vqa_dir
    ds = load_vqa(str(folder / "train.jsonl"), **MAPPING)
    assert ds.column_names[:8] == ["id", "image", "question", "answer", "reference_steps", "choices", "difficulty",
                                   "source"]
    assert ds["id"] == ["u0", "u1", "u2", "u3"]
    assert ds["question"] == [r["prompt"] for r in rows] and ds["answer"] == [r["label"] for r in rows]
    assert ds["reference_steps"] == [r["steps"] for r in rows]
    assert ds["choices"] == [None, ["yes", "no"], None, None]  # 'options' is picked up automatically
    assert ds["extra"] == [0, 1, 2, 3]  # other columns are kept for reward functions
    image = ds[2]["image"]
    assert isinstance(image, Image.Image) and image.size == (84, 84)
    assert list(image.convert("RGB").getdata()) == list(
        Image.open(folder / "images" / "2.png").convert("RGB").getdata())


def test_load_vqa_reads_save_to_disk_and_parquet_with_stored_images(tmp_path):
    shapes = make_shapes_vqa(6, seed=1)
    shapes.save_to_disk(str(tmp_path / "saved"))
    shapes.to_parquet(str(tmp_path / "shapes.parquet"))
    for path in (tmp_path / "saved", tmp_path / "shapes.parquet"):
        ds = load_vqa(str(path))
        assert ds["id"] == shapes["id"] and ds["reference_steps"] == shapes["reference_steps"]
        assert ds["difficulty"] == shapes["difficulty"] and ds["kind"] == shapes["kind"]
        assert ds[0]["image"].tobytes() == shapes[0]["image"].tobytes()


def test_load_vqa_accepts_steps_as_json_text_and_optional_steps(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    path = write_jsonl_rows(str(tmp_path / "v.jsonl"), [
        {"image": "x.png", "question": "q", "answer": 3, "reference_steps": json.dumps(["a", "b"])}])
    ds = load_vqa(path)
    assert ds["reference_steps"] == [["a", "b"]] and ds["answer"] == ["3"]
    path = write_jsonl_rows(str(tmp_path / "nosteps.jsonl"), [{"image": "x.png", "question": "q", "answer": "a"}])
    assert load_vqa(path, require_steps=False)["reference_steps"] == [[]]


def assert_names(error, *parts):
    message = str(error.value)
    for part in parts:
        assert str(part) in message, (part, message)


def test_missing_column_names_file_column_and_flag(vqa_dir):
    folder, _ = vqa_dir
    path = str(folder / "train.jsonl")
    with pytest.raises(DataValidationError) as error:
        load_vqa(path, **{**MAPPING, "question_column": "query"})
    assert_names(error, path, "row 0", "'query'", "--question_column")


def test_missing_value_in_one_row_names_that_row(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    good = {"image": "x.png", "question": "q", "answer": "a", "reference_steps": ["s"]}
    path = write_jsonl_rows(str(tmp_path / "v.jsonl"), [good, good, {**good, "question": None}])
    with pytest.raises(DataValidationError) as error:
        load_vqa(path)
    assert_names(error, path, "row 2", "'question'")


def test_image_not_found_and_unreadable_image_are_named(vqa_dir):
    folder, rows = vqa_dir
    path = str(folder / "train.jsonl")
    (folder / "images" / "bad.png").write_bytes(b"not a png at all")
    for bad, why in (("images/nowhere.png", "not found"), ("images/bad.png", "unreadable image")):
        broken = [dict(r) for r in rows]
        broken[3]["img"] = bad
        write_jsonl_rows(path, broken)
        with pytest.raises(DataValidationError) as error:
            load_vqa(path, **MAPPING)
        assert_names(error, path, "row 3", "'img'", why, bad)
    # "exists" skips opening the file (bad.png exists), False skips both checks
    assert len(load_vqa(path, **MAPPING, check_images="exists")) == 4
    assert len(load_vqa(path, **MAPPING, check_images=False)) == 4


def test_missing_stored_image_is_named():
    ds = datasets.Dataset.from_dict(
        {"image": [Image.new("RGB", (4, 4)), None], "question": ["q", "q"], "answer": ["a", "a"],
         "reference_steps": [["s"], ["s"]]},
        features=datasets.Features({"image": datasets.Image(), "question": datasets.Value("string"),
                                    "answer": datasets.Value("string"),
                                    "reference_steps": datasets.List(datasets.Value("string"))}))
    with pytest.raises(DataValidationError) as error:
        load_vqa(ds)
    assert_names(error, "row 1", "'image'", "missing image")


def test_empty_reference_steps_are_named(vqa_dir):
    folder, rows = vqa_dir
    path = str(folder / "train.jsonl")
    rows[1]["steps"] = []
    write_jsonl_rows(path, rows)
    with pytest.raises(DataValidationError) as error:
        load_vqa(path, **MAPPING)
    assert_names(error, path, "row 1", "'steps'", "empty list")
    assert len(load_vqa(path, **MAPPING, require_steps=False)) == 4


def test_errors_in_a_folder_of_files_name_the_file_and_its_own_row(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    good = {"image": "x.png", "question": "q", "answer": "a", "reference_steps": ["s"]}
    write_jsonl_rows(str(tmp_path / "train-0.jsonl"), [good, good, good])
    second = write_jsonl_rows(str(tmp_path / "train-1.jsonl"), [good, {**good, "reference_steps": []}])
    with pytest.raises(DataValidationError) as error:
        load_vqa(str(tmp_path))
    assert_names(error, second, "row 1", "'reference_steps'")


# ---------------------------------------------------------------------------- render_question


def test_crystal_schema_reads_choices_else_options_row_by_row(tmp_path):
    """The CRYSTAL data set (waybarrios/CRYSTAL) has image, question, answer, reference_steps, choices, options and
    source; its scripts take a row's choices when it has any, else its options."""
    from datasets import Dataset, Features, List, Value
    from datasets import Image as ImageFeature

    images = [Image.new("RGB", (28, 28), c) for c in ("red", "blue", "green")]
    table = Dataset.from_dict({
        "image": images, "question": ["Which?", "Which one?", "How many?"], "answer": ["A", "B", "3"],
        "reference_steps": [["look"], ["compare"], ["count"]],
        "choices": [["cat", "dog"], [], []], "options": [[], ["left", "right"], []],
        "source": ["mmvp", "sqa", "plotqa"],
    }, features=Features({"image": ImageFeature(), "question": Value("string"), "answer": Value("string"),
                          "reference_steps": List(Value("string")), "choices": List(Value("string")),
                          "options": List(Value("string")), "source": Value("string")}))
    table.save_to_disk(str(tmp_path / "crystal"))
    ds = load_vqa(str(tmp_path / "crystal"), split="train")
    assert ds["choices"] == [["cat", "dog"], ["left", "right"], None]
    assert ds["source"] == ["mmvp", "sqa", "plotqa"] and "options" not in ds.column_names


def test_render_question_letters_options():
    expected = "Which?\n\nA) red\nB) blue"
    assert render_question("Which?", ["red", "blue"]) == expected
    assert render_question("Which?", {"B": "blue", "A": "red"}) == expected
    assert render_question("Which?", ["A) red", "B) blue"]) == expected
    assert render_question("Which?", ["(A) red", "(B) blue"]) == expected
    assert render_question("Which?", json.dumps(["red", "blue"])) == expected
    assert render_question("Which?", None) == "Which?" == render_question("Which?", [])
    # A list whose texts merely start with a letter is not mistaken for lettered options.
    assert render_question("Q", ["B. Smith", "A. Jones"]) == "Q\n\nA) B. Smith\nB) A. Jones"


# ---------------------------------------------------------------------------- sharegpt and RL rows


@pytest.fixture
def image_file(tmp_path):
    Image.new("RGB", (10, 10), "red").save(tmp_path / "a.png")
    return "a.png"


def test_load_sharegpt_reads_messages_and_images(tmp_path, image_file):
    path = write_jsonl_rows(str(tmp_path / "sft.jsonl"), [
        {"messages": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "red"}],
         "images": [image_file]},
        {"conversations": None, "messages": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
         "images": []},
    ])
    ds = load_sharegpt(path)
    assert ds[0]["messages"] == [{"role": "user", "content": "<image>What colour?"},
                                 {"role": "assistant", "content": "red"}]
    assert ds[1]["messages"][0] == {"role": "user", "content": "Hi"}
    assert ds[0]["images"][0].size == (10, 10) and ds[1]["images"] == []


def test_sharegpt_marker_count_mismatch_and_bad_role_are_named(tmp_path, image_file):
    ok = {"messages": [{"role": "user", "content": "<image>Q"}, {"role": "assistant", "content": "A"}],
          "images": [image_file]}
    two_markers = {"messages": [{"role": "user", "content": "<image><image>Q"}, {"role": "assistant", "content": "A"}],
                   "images": [image_file]}
    path = write_jsonl_rows(str(tmp_path / "sft.jsonl"), [ok, two_markers])
    with pytest.raises(DataValidationError) as error:
        load_sharegpt(path)
    assert_names(error, path, "row 1", "'messages'", "2 '<image>' marker(s) but 1 image(s)", "'images'")
    bad_role = {"messages": [{"role": "robot", "content": "Q"}, {"role": "assistant", "content": "A"}], "images": []}
    path = write_jsonl_rows(str(tmp_path / "sft2.jsonl"), [bad_role])
    with pytest.raises(DataValidationError) as error:
        load_sharegpt(path)
    assert_names(error, path, "row 0", "'messages'", "'robot'")


def test_load_rl_rows_wraps_single_images_and_checks_markers(tmp_path, image_file):
    path = write_jsonl_rows(str(tmp_path / "rl.jsonl"), [
        {"image_path": image_file, "question": "<image>How many?", "solution": 2},
        {"image_path": image_file, "question": "What colour?", "solution": "red"}])
    ds = load_rl_rows(path, images_column="image_path", problem_column="question", answer_column="solution")
    assert ds.column_names[:3] == ["images", "problem", "answer"]
    assert ds["answer"] == ["2", "red"] and len(ds[0]["images"]) == 1
    path = write_jsonl_rows(str(tmp_path / "rl2.jsonl"), [
        {"images": [image_file], "problem": "<image><image>Compare", "answer": "a"}])
    with pytest.raises(DataValidationError) as error:
        load_rl_rows(path)
    assert_names(error, path, "row 0", "'problem'", "'images'")


# ---------------------------------------------------------------------------- GenEval and TIIF


def test_load_geneval_reads_generated_prompts_and_rejects_bad_rows(tmp_path):
    rows = make_t2i_prompts(12, seed=0)
    path = write_jsonl(rows, str(tmp_path / "geneval.jsonl"))
    assert load_geneval(path) == rows
    bad = json.loads(json.dumps(rows))
    bad[4]["include"][1]["position"] = ["behind", 0]
    write_jsonl(bad, path)
    with pytest.raises(DataValidationError) as error:
        load_geneval(path)
    assert_names(error, path, "row 4", "'include'", "position")
    bad = json.loads(json.dumps(rows))
    del bad[2]["prompt"]
    write_jsonl(bad, path)
    with pytest.raises(DataValidationError) as error:
        load_geneval(path)
    assert_names(error, path, "row 2", "'prompt'")


def test_load_geneval_from_parquet_drops_arrow_padding(tmp_path):
    # (Arrow cannot store GenEval's mixed ["left of", 0] position lists, so no position rows here.)
    rows = make_t2i_prompts(6, seed=0, tags=("single_object", "counting", "colors", "color_attr"))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "g.parquet"))
    assert load_geneval(str(tmp_path / "g.parquet")) == rows  # no 'color': None added to items


def test_load_tiif_checks_question_and_answer_lists(tmp_path):
    row = {"type": "color", "short_description": "a red cube", "long_description": "A cube, red.",
           "yn_question_list": ["Is there a cube?", "Is it red?"], "yn_answer_list": ["yes", "yes"], "source": "x"}
    path = write_jsonl_rows(str(tmp_path / "tiif.jsonl"), [row, {**row, "yn_answer_list": ["yes"]}])
    with pytest.raises(DataValidationError) as error:
        load_tiif(path)
    assert_names(error, path, "row 1", "'yn_answer_list'", "1 answers for 2 questions")
    write_jsonl_rows(path, [row])
    (loaded,) = load_tiif(path)
    assert loaded["prompt"] == "a red cube" and loaded["yn_answer_list"] == ["yes", "yes"]
