"""Local copies of the benchmarks OpenVLThinker reports, written in each release's own schema with hand-written rows
(the tricky cases of each scorer): MathVista's testmini.json, MathVerse's testmini.json and MATH-Vision's
testmini.jsonl, images beside them. tests/test_benchmarks.py scores them, tests/test_iterate_pick.py runs them as a
cycle's evaluation stages."""

import json

import PIL.Image


def image(folder, name):
    (folder / "images").mkdir(exist_ok=True)
    PIL.Image.new("RGB", (8, 8), "white").save(folder / "images" / name)
    return f"images/{name}"


def mathvista_record(pid, question, choices, answer, question_type, answer_type, precision=None, unit=None):
    hint = ("Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end."
            if question_type == "multi_choice" else "Hint: Please answer the question requiring an answer.")
    query = f"{hint}\nQuestion: {question}" + ("\nChoices:\n" + "\n".join(
        f"({chr(65 + i)}) {c}" for i, c in enumerate(choices)) if choices else "")
    return {"pid": pid, "question": question, "image": f"images/{pid}.jpg", "choices": choices, "unit": unit,
            "precision": precision, "answer": answer, "question_type": question_type, "answer_type": answer_type,
            "query": query, "metadata": {"split": "testmini", "language": "english", "img_width": 8,
                                         "img_height": 8, "source": "hand-written", "category": "math-targeted-vqa",
                                         "task": "geometry problem solving", "context": "geometry diagram",
                                         "grade": "high school", "skills": ["geometry reasoning"]}}


def write_mathvista(folder):
    """MathVista's testmini.json (a dict keyed by pid), images beside it; returns its path."""
    records = [mathvista_record("1", "Which is the length of AB?", ["2", "4", "6"], "4", "multi_choice", "text"),
               mathvista_record("2", "How long is the side? (Unit: cm)", None, "5", "free_form", "integer",
                                unit="cm"),
               mathvista_record("3", "What is the ratio? (round to 1 decimal)", None, "1.2", "free_form", "float",
                                precision=1.0),
               mathvista_record("4", "What is the share?", None, "0.75", "free_form", "float", precision=2),
               mathvista_record("5", "List the roots.", None, "[1, 2]", "free_form", "list")]
    for r in records:
        image(folder, f"{r['pid']}.jpg")
    path = folder / "testmini.json"
    path.write_text(json.dumps({r["pid"]: r for r in records}))
    return str(path)


def write_mathverse(folder):
    """MathVerse's testmini.json (a list), images beside it; returns its path."""
    base = {"problem_index": "685", "image": image(folder, "image_685.png"),
            "metadata": {"split": "testmini", "source": "hand-written", "subject": "Plane Geometry",
                         "subfield": "Length"}}
    question = ("Is this relation a function?\nChoices:\nA:This is a function\nB:This is not a function")
    records = [
        {**base, "sample_index": "1", "problem_version": "Text Dominant", "question": question, "answer": "B",
         "question_type": "multi-choice", "query_wo": "Please directly answer.\nQuestion: " + question,
         "query_cot": "Please first conduct reasoning, and then answer the question.\nQuestion: " + question},
        {**base, "sample_index": "2", "problem_version": "Vision Only", "question": "", "answer": "14",
         "question_type": "free-form", "query_wo": "According to the question shown in the image, answer.",
         "query_cot": "According to the question shown in the image, please first conduct reasoning."},
        {**base, "sample_index": "3", "problem_version": "Text Lite", "question": "Find the ratio.",
         "answer": "\\frac{1}{2}", "question_type": "free-form", "query_wo": "Find it.", "query_cot": "Find it."}]
    path = folder / "testmini.json"
    path.write_text(json.dumps(records))
    return str(path)


def write_mathvision(folder):
    """MATH-Vision's testmini.jsonl, images beside it; returns its path."""
    records = [
        {"id": "6", "question": "Which picture shows the kittens?\n<image1>", "options": ["A", "B", "C", "D", "E"],
         "answer": "D", "solution": None, "level": 3, "subject": "logic", "image": image(folder, "6.jpg")},
        {"id": "91", "question": "How long is the room? <image1>",
         "options": ["$6 \\mathrm{~m}$", "$8 \\mathrm{~m}$", "$10 \\mathrm{~m}$", "$11 \\mathrm{~m}$",
                     "$12 \\mathrm{~m}$"], "answer": "E", "solution": None, "level": 1,
         "subject": "combinatorial geometry", "image": image(folder, "91.jpg")},
        {"id": "5", "question": "Which number do you have to write in the last daisy?\n<image1>", "options": [],
         "answer": "61", "solution": None, "level": 2, "subject": "arithmetic", "image": image(folder, "5.jpg")},
        {"id": "7", "question": "What fraction is shaded?\n<image1>", "options": [], "answer": "\\frac{3}{4}",
         "solution": None, "level": 2, "subject": "arithmetic", "image": image(folder, "7.jpg")}]
    path = folder / "testmini.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)
