"""Held-out evaluation: generate answers for a VQA set (locally, or from an OpenAI-compatible server) and grade
them. Shared by evaluate.py and the train scripts' before/after checks, which all three run in one shape
(`evaluate_before`, `evaluate_after` around the script's own `evaluate(tag)`); the grading itself is
`utils.eval.grading`.

Generation is greedy with temperature <= 0; with temperature > 0 each row is sampled with its own
counter-based seed (utils.core.seeds), so results never depend on batch size or process count.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import torch

from utils.core import names
from utils.core.conversations import prompt_images, prompt_messages, prompt_question
from utils.core.data_sources import eval_source
from utils.core.encoding import encode_prompts
from utils.core.rollout import generate_completions, stop_token_ids
from utils.core.seeds import completion_seeds
from utils.core.video import budget_for, load_clips, videos_of
from utils.eval.grading import AnswerGrader, group_means, parse_completion, reasoning_states_answer


def row_messages(row, *, prompt_template, system_prompt=None, prompt_column="prompt"):
    """A row's prompt as the train scripts build it: TRL's prompt column, or the VQA columns through the template
    (utils.core.conversations.prompt_messages)."""
    return prompt_messages(row, prompt_column=prompt_column, prompt_template=prompt_template,
                           system_prompt=system_prompt)


@torch.no_grad()
def generate_answers(model, processor, rows, *, prompt_template, system_prompt=None, batch_size=32,
                     max_new_tokens=256, temperature=0.0, seed=0, max_prompt_length=None, accelerator=None,
                     video_budget=None, prompt_column="prompt", tools=None):
    """Completions (text) for `rows` (dicts with question, image, choices, id, videos, or TRL's prompt), in row
    order. Videos are sampled under `video_budget` (utils.core.video; none: the model's video processor defaults),
    as in training. With `tools` (a `utils.core.tool_rollout.ToolRollout`) each row runs the tool loop, and its
    text is its assistant turns' (the final answer after the tool calls).

    With an `accelerator`, each process generates rows rank::world and the texts are gathered, so every
    process returns all of them (the model must be the plain HF model, see utils.core.zero3.unwrap_for_generation).
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
        messages = [row_messages(r, prompt_template=prompt_template, system_prompt=system_prompt,
                                 prompt_column=prompt_column) for r in batch_rows]
        images = [prompt_images(r, prompt_column) for r in batch_rows]
        videos = [videos_of(r) for r in batch_rows]
        clips = load_clips(videos, video_budget or budget_for(processor)) if any(videos) else None
        schemas = tools.toolbox.schemas if tools is not None else None
        batch = encode_prompts(processor, messages, images, sample_ids=ids, max_prompt_length=max_prompt_length,
                               videos=clips, tools=schemas).to(device)
        seeds = completion_seeds(seed, 0, indices)

        def generate(inputs, row_seeds, max_new, *_):
            ids_, mask_ = generate_completions(model, inputs, row_seeds=row_seeds, max_new_tokens=max_new,
                                               temperature=temperature, eos_token_id=eos_ids,
                                               pad_token_id=tokenizer.pad_token_id)
            return ids_, mask_, None

        completion, mask, _ = generate(batch, seeds, max_new_tokens if tools is None else tools.max_completion_length)
        if tools is None:
            texts += tokenizer.batch_decode(completion.masked_fill(mask == 0, tokenizer.pad_token_id),
                                            skip_special_tokens=True)
            continue
        from rewards.common import completion_text

        trajectories = tools.run(messages, images, ids, seeds, (completion, mask, None), generate,
                                 pad_token_id=tokenizer.pad_token_id, device=device, tools=schemas)
        texts += [completion_text(c) for c in trajectories.completions]
    model.train(was_training)
    if world == 1:
        return texts
    gathered = gather_object([(i, t) for i, t in zip(mine, texts)])
    return [t for _, t in sorted(gathered)]


def generate_answers_remote(base_url, model_name, rows, *, prompt_template, system_prompt=None, max_new_tokens=256,
                            temperature=0.0, seed=0, api_key=None, timeout=300.0, max_concurrency=8,
                            prompt_column="prompt", max_retries=3, backoff=1.0, deadline=None,
                            allow_insecure_api_key=False):
    """Completions from an OpenAI-compatible server (vLLM, SGLang ...): images go as base64 data URLs and
    each row gets seed + its index, so a server that honours `seed` returns the same texts every run. Each request
    is retried and bounded as a judge's (`rewards.judge.JudgeClient`: `timeout`, `max_retries`, `backoff`,
    `deadline`; the API key only over https or to 127.0.0.1 unless `allow_insecure_api_key`)."""
    from rewards.judge import JudgeClient, JudgeError, image_data_url

    client = JudgeClient(base_url, model_name, api_key=api_key, timeout=timeout, max_retries=max_retries,
                         backoff=backoff, deadline=deadline, max_tokens=max_new_tokens,
                         temperature=max(temperature, 0.0), allow_insecure_api_key=allow_insecure_api_key)

    def messages(index, row):
        if videos_of(row):
            raise ValueError(f"row {row.get('id', index)!r} has videos: evaluate video rows with a local --model "
                             "(the frames a server samples are its own)")
        out, images = [], iter(prompt_images(row, prompt_column))
        prompt = row_messages(row, prompt_template=prompt_template, system_prompt=system_prompt,
                              prompt_column=prompt_column)
        if isinstance(prompt, str):  # a plain-text prompt: the server's chat endpoint takes it as one user turn
            prompt = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        for message in prompt:
            content = [{"type": "image_url", "image_url": {"url": image_data_url(next(images))}}
                       if item["type"] == "image" else {"type": "text", "text": item["text"]}
                       for item in message["content"]]
            out.append({"role": message["role"], "content": content})
        return out

    def ask(item):
        index, row = item
        try:
            return client.complete(messages(index, row), seed=seed + index)
        except JudgeError as error:
            raise RuntimeError(f"--base_url: row {row.get('id', index)!r}: {error}") from None

    with ThreadPoolExecutor(max_workers=max_concurrency) as pool:
        return list(pool.map(ask, enumerate(rows)))


def heldout_accuracy(model, processor, dataset, *, prompt_template, batch_size=32, max_new_tokens=128,
                     system_prompt=None, max_samples=None, accelerator=None, group_by=("difficulty",),
                     video_budget=None, prompt_column="prompt", tools=None):
    """Greedy held-out accuracy of a VQA set: {"accuracy", "format", "samples", "accuracy/<group>=<value>" ...}.

    `format` is the fraction of completions with a parsed answer. Used by train_sft.py / train_grpo.py
    during and after training, and by evaluate.py's `--metrics accuracy`.
    """
    rows = [dataset[i] for i in range(min(len(dataset), max_samples or len(dataset)))]
    texts = generate_answers(model, processor, rows, prompt_template=prompt_template, system_prompt=system_prompt,
                             batch_size=batch_size, max_new_tokens=max_new_tokens, accelerator=accelerator,
                             video_budget=video_budget, prompt_column=prompt_column, tools=tools)
    grade = AnswerGrader()
    correct, answered, agrees = [], [], []
    for row, text in zip(rows, texts):
        steps, answer = parse_completion(text, prompt_template=prompt_template)
        answered.append(bool(answer))
        correct.append(grade(prompt_question(row, prompt_column=prompt_column), answer, row["answer"]))
        agrees.append(reasoning_states_answer(steps, answer))
    out = {"accuracy": sum(correct) / max(len(rows), 1), "format": sum(answered) / max(len(rows), 1),
           "samples": len(rows),
           # of the answered completions, the share whose last reasoning step states the given answer
           "reasoning_agrees": sum(agrees) / max(sum(answered), 1)}
    out.update(group_means(rows, correct, group_by, "accuracy"))
    return out


def load_eval_set(cfg, accelerator):
    """The held-out VQA set of a train script's `--eval_dataset_name`, or of --dataset_name's --dataset_test_split
    (utils.core.data_sources.eval_source; None when neither is set), columns mapped with the same flags as the
    training data."""
    with accelerator.main_process_first():
        path, split = eval_source(cfg, names.resolve_dataset)
    if path is None:
        return None
    return load_graded_set(path, split=split, prompt_column=getattr(cfg, "prompt_column", None),
                           image_column=cfg.image_column, question_column=cfg.question_column,
                           answer_column=cfg.answer_column, steps_column=cfg.steps_column,
                           choices_column=cfg.choices_column, video_column=getattr(cfg, "video_column", "video"))


def load_val_set(cfg, accelerator):
    """The validation rows of train_grpo.py's --val_split (scored at each checkpoint, --load_best_model_at_end):
    that split of --eval_dataset_name, or else of --dataset_name (read as --dataset_test_split would be), columns
    mapped as the held-out rows'; None without --val_split."""
    if not cfg.val_split:
        return None
    view = copy.copy(cfg)  # the held-out loader, pointed at the validation split
    view.eval_split = view.dataset_test_split = cfg.val_split
    view.eval_samples = cfg.val_samples
    return load_eval_set(view, accelerator)


def load_graded_set(path, *, split, prompt_column, answer_column="answer", **columns):
    """A held-out set whose answers are graded: TRL's prompt column or the VQA columns
    (utils.core.conversations.load_prompt_set), the answer as column 'answer' either way."""
    from utils.core.conversations import load_prompt_set
    from utils.core.data_checks import require_columns
    from utils.core.data_sources import Source

    data = load_prompt_set(path, split=split, prompt_column=prompt_column, answer_column=answer_column,
                           require_steps=columns.pop("require_steps", False), **columns)
    if prompt_column and prompt_column in data.column_names:
        require_columns(data, Source(str(path), None), {answer_column: "--answer_column"})
        if answer_column != "answer":
            data = data.remove_columns([c for c in ("answer",) if c in data.column_names])
            data = data.rename_column(answer_column, "answer")
    return data


def evaluate_policy(policy, processor, eval_set, cfg, accelerator, *, prompt_template, tools=None, max_samples=None):
    """Greedy held-out accuracy of a train script's (wrapped, possibly sharded) policy, on all processes: the first
    `max_samples` rows (none: --eval_samples)."""
    from utils.core.video import budget_from_config
    from utils.core.zero3 import unwrap_for_generation

    budget = budget_from_config(processor, cfg) if "videos" in eval_set.column_names else None
    with unwrap_for_generation(policy, accelerator) as unwrapped:
        return heldout_accuracy(unwrapped.model, processor, eval_set, prompt_template=prompt_template,
                                system_prompt=cfg.system_prompt, batch_size=cfg.eval_batch_size,
                                max_new_tokens=cfg.eval_max_new_tokens,
                                max_samples=max_samples if max_samples is not None else cfg.eval_samples,
                                accelerator=accelerator, video_budget=budget,
                                prompt_column=getattr(cfg, "prompt_column", None), tools=tools)


def evaluate_before(accelerator, evaluate, state, cfg, step, *, describe):
    """The starting model's held-out results: `evaluate("before")` at step 0 with --eval_before (printing
    `describe(results)`), a resumed run's from its checkpoint state ("heldout_before"), None without an evaluation
    (`evaluate` None)."""
    if evaluate is None or not cfg.eval_before or step != 0:
        return state.get("heldout_before")
    before = evaluate("before")
    accelerator.print(describe(before))
    return before


def evaluate_after(accelerator, evaluate, summary, before, *, summarize, describe):
    """The trained model's held-out results, `evaluate("after")`: their entries added to the run's `summary`
    (`summarize(after, before)`) and the lines of `describe(after, before)` printed. None without an evaluation."""
    if evaluate is None:
        return None
    after = evaluate("after")
    summary.update(summarize(after, before))
    for line in describe(after, before):
        accelerator.print(line)
    return after
