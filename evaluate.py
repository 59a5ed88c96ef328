"""Generate answers for a VQA set with a checkpoint (or an OpenAI-compatible server) and score them.

    python evaluate.py --model outputs/tiny-sft/checkpoint-200 --dataset synthetic:shapes --split test
    python evaluate.py --base_url http://localhost:8000/v1 --served_model_name my-model --dataset ...
    python evaluate.py --select_best outputs/crystal-phase1 --dataset ... --select_metric accuracy
    python evaluate.py --model ... --dataset ... --compare outputs/eval-base     # keyword shift vs another run

Metrics (`--metrics`, any of):
  crystal   Match F1, Ordered Match F1 (alpha 0.3), precision, recall and accuracy, exactly as the
            `crystal-metrics evaluate` CLI computes them on the predictions.json / references.json written here
  accuracy  answer accuracy only (crystal-metrics' rule-based calculator; no embedding model)
  math      math_accuracy of `<answer>` blocks (math-verify, OpenVLThinker's check)
  keywords  reasoning-keyword frequencies (visual / digest / plan / reflection / alternate words)
Each is also broken down by `--group_by` columns (difficulty by default).

Writes to --output_dir: generations.jsonl (raw completions), predictions.json + references.json (the
crystal-metrics format), metrics.json and metrics.md; prints the table. `--select_best DIR` scores every
`checkpoint-N` in DIR (into output_dir/checkpoint-N/) and writes best_checkpoint.json: the selection step
between CRYSTAL's two training phases; with `--select_guard_metric accuracy` CRYSTAL's final pick, the best Match
F1 among the checkpoints that keep the first one's accuracy.
"""

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from rewards import get_reward
from tiny.cache import TINY_DATASET, resolve_dataset
from utils.core.config import choice, config_to_dict, parse_config
from utils.core.conversations import prompt_question, set_chat_template
from utils.core.errors import exit_on_bad_input
from utils.core.flags import ImageVideoFlags
from utils.core.launch import set_cpu_threads, watch_stage_parent
from utils.core.models import load_model_and_processor
from utils.core.prompts import PROMPT_TEMPLATES
from utils.core.rollout import stop_token_ids
from utils.core.tool_formats import tool_format
from utils.core.tool_rollout import ToolRollout, context_limit
from utils.core.tools import ToolBox, pixel_budget
from utils.core.video import budget_from_config, check_config_video_flags, videos_of
from utils.eval.benchmarks import BENCHMARKS, LLMAnswerExtractor, benchmark_correct, load_benchmark
from utils.eval.benchmarks import GROUP_BY as BENCHMARK_GROUPS
from utils.eval.grading import (
    DEFAULT_ALPHA,
    DEFAULT_EMBEDDING_MODEL,
    AnswerGrader,
    crystal_files,
    crystal_scores,
    group_means,
    parse_completion,
    resolve_embedding_model,
)
from utils.eval.heldout import generate_answers, generate_answers_remote, load_graded_set
from utils.eval.keywords import compare_keywords, keyword_frequencies, load_texts

METRICS = ("crystal", "accuracy", "math", "keywords")
SELECT_METRICS = ("accuracy", "match_f1", "ordered_match_f1", "math_accuracy", "format")


@dataclass
class EvalConfig(ImageVideoFlags):
    """Generate answers for a VQA set with a checkpoint (--model) or an OpenAI-compatible server (--base_url), and
    score them: CRYSTAL's Match F1 and Ordered Match F1, answer accuracy, math accuracy, reasoning-keyword
    frequencies, each broken down by --group_by columns; --select_best scores every checkpoint of a run and picks
    one. Writes generations.jsonl, predictions.json + references.json (the crystal-metrics format), metrics.json and
    metrics.md to --output_dir. docs/flags.md lists every flag."""

    # model
    model: Optional[str] = field(default=None, metadata={"help": "checkpoint folder or hub name"})
    base_url: Optional[str] = field(default=None,
                                    metadata={"help": "OpenAI-compatible server (e.g. vLLM) instead of --model"})
    served_model_name: Optional[str] = None  # model name the --base_url server serves
    api_key: Optional[str] = None  # API key for --base_url; none: $OPENAI_API_KEY, else EMPTY
    request_timeout: float = 300.0  # seconds a request to --base_url or the answer extractor may take, reply included
    max_retries: int = 3  # retries of a request (connection errors, timeouts, 429, 5xx), with exponential backoff
    request_deadline: Optional[float] = None  # seconds for a request and all its retries; none: no bound beyond them
    allow_insecure_api_key: bool = field(default=False, metadata={
        "help": "send --api_key over plain http to a host other than 127.0.0.1 (refused otherwise: it travels in "
                "clear)"})
    dtype: str = choice("auto", "float32", "bfloat16", "float16")  # weights dtype when loading a checkpoint
    attn_implementation: Optional[str] = None  # attention: sdpa, eager, flash_attention_2...; none: the model's default
    # data
    dataset: str = field(default=TINY_DATASET, metadata={"help": "hub name, save_to_disk folder or data file"})
    split: str = "test"  # split of --dataset
    prompt_column: Optional[str] = field(default="prompt", metadata={"help": (
        "column of TRL-style prompts (chat messages or text), used when the data set has it; otherwise the "
        "question/image columns; none: always those columns")})
    image_column: str = "image"  # column with the image(s)
    video_column: str = "video"  # column with the video(s), when present (docs/data.md)
    question_column: str = "question"  # column with the question text
    answer_column: str = "answer"  # column with the ground-truth answer
    steps_column: str = "reference_steps"  # column with the reference steps (needed by --metrics crystal)
    choices_column: Optional[str] = None  # column with answer options; none: 'choices' or 'options' when present
    id_column: Optional[str] = None  # column with sample ids; none: 'id' when present, else the row index
    max_samples: Optional[int] = None  # score the first N rows; none: all
    benchmark: Optional[str] = field(default=None, metadata={
        "help": "mathvista, mathverse or mathvision: --dataset is a local copy of it in its published format "
                "(--split testmini for hub releases), prompted and scored by its official rules"})
    answer_extractor_base_url: Optional[str] = field(default=None, metadata={
        "help": "--benchmark: OpenAI-compatible endpoint of an LLM that extracts each response's answer (as "
                "MathVista's and MathVerse's scorers do); none: rule extraction"})
    answer_extractor_model: Optional[str] = None  # model name the --answer_extractor_base_url server serves
    # generation
    prompt_template: str = choice(*PROMPT_TEMPLATES)  # answer format asked for in the system prompt and parsed
    system_prompt: Optional[str] = None  # replaces the template's system prompt (a prompt column's: added if none)
    chat_template_path: Optional[str] = field(default=None, metadata={"help": (
        "a .jinja file or a tokenizer folder whose chat template replaces the model's (TRL's flag); none: its own")})
    tools: list[str] = field(default_factory=list, metadata={"help": (
        "functions the model may call while it answers, as in training (docs/tools.md); none: one turn")})
    max_tool_calling_iterations: Optional[int] = None  # most rounds of tool calls per answer; none: the token budget
    tool_timeout: float = 10.0  # seconds a tool call may run before the model is told it timed out
    max_new_tokens: int = 512  # max tokens per generated answer
    batch_size: int = 32  # prompts per generation batch (local --model)
    temperature: float = field(default=0.0, metadata={"help": "<= 0: greedy"})
    seed: int = 0  # sampling seed with --temperature > 0 (per row, batch-independent)
    # distributed
    cpu_threads: Optional[int] = field(default=None, metadata={
        "help": "torch threads per process without a GPU; default: the cores shared evenly between this machine's "
                "processes"})
    # scoring
    metrics: list[str] = field(default_factory=lambda: ["crystal", "math", "keywords"], metadata={
        "help": "any of crystal (Match F1, Ordered Match F1, accuracy), accuracy, math, keywords"})
    embedding_model: str = field(default=DEFAULT_EMBEDDING_MODEL, metadata={
        "help": "sentence-transformers model for Match F1; the default is the packaged offline MiniLM"})
    similarity_threshold: Optional[float] = field(default=None, metadata={
        "help": "default: crystal-metrics' threshold for the model"})
    alpha: float = DEFAULT_ALPHA  # order sensitivity of Ordered Match F1; 0: not computed
    order_metric: str = choice("kendall_tau", "lis")  # step-order measure of Ordered Match F1
    group_by: list[str] = field(default_factory=lambda: ["difficulty"])  # break metrics down by these columns
    compare: Optional[str] = field(default=None, metadata={
        "help": "another evaluate.py output (folder, generations.jsonl or predictions.json) for the keyword "
                "comparison"})
    # model: checkpoint selection
    select_best: Optional[str] = field(default=None, metadata={"help": "score every checkpoint-N in this folder"})
    select_metric: str = choice(*SELECT_METRICS)  # metric that picks the --select_best checkpoint
    select_include: list[str] = field(default_factory=list, metadata={
        "help": "models scored with the --select_best checkpoints, before them (step 0, e.g. the run's starting "
                "model: it wins ties)"})
    select_guard_metric: Optional[str] = field(default=None, metadata={
        "help": "--select_best picks only among candidates whose value of this metric (accuracy, match_f1, ...) is not "
                "below the first candidate's (the --select_include model, else the earliest checkpoint) minus "
                "--select_guard_tolerance: CRYSTAL's 'best Match F1 without losing accuracy'"})
    select_guard_tolerance: float = field(default=0.0, metadata={
        "help": "how far below the first candidate's --select_guard_metric a candidate may fall and still be picked"})
    # logging: output
    output_dir: Optional[str] = field(default=None, metadata={
        "help": "default: outputs/eval/<model> (never inside the model's folder), or <select_best>/eval"})


def validate(cfg):
    sources = sum(x is not None for x in (cfg.model, cfg.base_url, cfg.select_best))
    if sources != 1:
        raise ValueError("give exactly one of --model, --base_url (+ --served_model_name) or --select_best")
    if cfg.base_url and not cfg.served_model_name:
        raise ValueError("--base_url needs --served_model_name (the model name the server serves)")
    if cfg.benchmark is not None:
        if cfg.benchmark not in BENCHMARKS:
            raise ValueError(f"--benchmark {cfg.benchmark!r}: choose from {', '.join(BENCHMARKS)}")
        if "crystal" in cfg.metrics:
            raise ValueError("--benchmark rows have no reference steps: drop 'crystal' from --metrics")
    if cfg.answer_extractor_base_url and not (cfg.benchmark and cfg.answer_extractor_model):
        raise ValueError("--answer_extractor_base_url needs --benchmark and --answer_extractor_model")
    from rewards.judge import check_key_transport

    for flag in ("base_url", "answer_extractor_base_url"):
        if getattr(cfg, flag):  # before anything loads: an API key would travel in clear
            try:
                check_key_transport(getattr(cfg, flag), cfg.api_key or os.environ.get("OPENAI_API_KEY"),
                                    cfg.allow_insecure_api_key)
            except ValueError as error:
                raise ValueError(f"--{flag}: {error}") from None
    unknown = [m for m in cfg.metrics if m not in METRICS]
    if unknown or not cfg.metrics:
        raise ValueError(f"--metrics {unknown or cfg.metrics}: choose from {', '.join(METRICS)}")
    if cfg.select_include and not cfg.select_best:
        raise ValueError("--select_include adds candidates to --select_best: give --select_best too")
    if (cfg.select_guard_metric is not None or cfg.select_guard_tolerance) and not cfg.select_best:
        raise ValueError("--select_guard_metric / --select_guard_tolerance guard --select_best's pick: give "
                         "--select_best too")
    if cfg.select_guard_tolerance and cfg.select_guard_metric is None:
        raise ValueError("--select_guard_tolerance is a margin on --select_guard_metric: give --select_guard_metric")
    if cfg.select_guard_tolerance < 0:
        raise ValueError(f"--select_guard_tolerance must be >= 0, got {cfg.select_guard_tolerance}")
    if cfg.select_best:
        if not os.path.isdir(cfg.select_best):
            raise FileNotFoundError(f"--select_best: folder not found: {cfg.select_best}")
        for flag, metric in (("select_metric", cfg.select_metric), ("select_guard_metric", cfg.select_guard_metric)):
            if metric is not None and metric not in SELECT_METRICS:
                raise ValueError(f"--{flag} {metric!r}: choose from {', '.join(SELECT_METRICS)}")
            needs = {"match_f1": "crystal", "ordered_match_f1": "crystal", "math_accuracy": "math"}.get(metric)
            if needs and needs not in cfg.metrics:
                raise ValueError(f"--{flag} {metric} needs '{needs}' in --metrics")
        if cfg.select_guard_metric == cfg.select_metric:
            raise ValueError(f"--select_guard_metric {cfg.select_guard_metric} is --select_metric itself: the best "
                             "by a metric never falls below the first candidate's, so the guard would change nothing")
    if not 0.0 <= cfg.alpha <= 1.0:
        raise ValueError(f"--alpha must be in [0, 1], got {cfg.alpha}")
    if cfg.batch_size < 1 or cfg.max_new_tokens < 1:
        raise ValueError("--batch_size and --max_new_tokens must be >= 1")
    if cfg.request_timeout <= 0 or cfg.max_retries < 0 or (cfg.request_deadline is not None
                                                            and cfg.request_deadline <= 0):
        raise ValueError("--request_timeout and --request_deadline must be > 0, --max_retries >= 0")
    check_config_video_flags(cfg)
    if cfg.tools and cfg.base_url:
        raise ValueError("--tools runs the tool loop on a local --model; a --base_url server parses tool calls itself")
    if not cfg.tools and (cfg.max_tool_calling_iterations is not None or cfg.tool_timeout != EvalConfig.tool_timeout):
        raise ValueError("--max_tool_calling_iterations and --tool_timeout apply to --tools, which is empty")
    if cfg.tools:
        if not cfg.tool_timeout > 0:
            raise ValueError(f"--tool_timeout {cfg.tool_timeout} must be > 0")
        ToolBox(cfg.tools, timeout=cfg.tool_timeout)  # each tool imports and has a schema


def load_rows(cfg):
    if cfg.benchmark:
        return load_benchmark(cfg.benchmark, cfg.dataset, split=cfg.split, max_samples=cfg.max_samples)
    path = resolve_dataset(cfg.dataset)
    # TRL's prompt column when the data set has one, else the question/image columns
    dataset = load_graded_set(path, split=cfg.split, prompt_column=cfg.prompt_column, image_column=cfg.image_column,
                              question_column=cfg.question_column, answer_column=cfg.answer_column,
                              steps_column=cfg.steps_column, choices_column=cfg.choices_column,
                              id_column=cfg.id_column, require_steps="crystal" in cfg.metrics,
                              video_column=cfg.video_column)
    n = min(len(dataset), cfg.max_samples or len(dataset))
    return [dataset[i] for i in range(n)]


def generate(cfg, model_path, rows):
    """Completion texts for rows, from a local checkpoint or from the server."""
    if cfg.base_url:
        return generate_answers_remote(cfg.base_url, cfg.served_model_name, rows, prompt_template=cfg.prompt_template,
                                       system_prompt=cfg.system_prompt, max_new_tokens=cfg.max_new_tokens,
                                       temperature=cfg.temperature, seed=cfg.seed, api_key=cfg.api_key,
                                       prompt_column=cfg.prompt_column, timeout=cfg.request_timeout,
                                       max_retries=cfg.max_retries, deadline=cfg.request_deadline,
                                       allow_insecure_api_key=cfg.allow_insecure_api_key)

    model, processor = load_model_and_processor(model_path, dtype=cfg.dtype,
                                                attn_implementation=cfg.attn_implementation,
                                                max_pixels=cfg.max_pixels, min_pixels=cfg.min_pixels,
                                                max_anyres_num=cfg.max_anyres_num)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    set_chat_template(processor, cfg.chat_template_path)
    budget = budget_from_config(processor, cfg) if any(videos_of(r) for r in rows) else None
    return generate_answers(model, processor, rows, prompt_template=cfg.prompt_template,
                            system_prompt=cfg.system_prompt, batch_size=cfg.batch_size,
                            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed,
                            video_budget=budget, prompt_column=cfg.prompt_column,
                            tools=tool_loop(cfg, model, processor, model_path))


def tool_loop(cfg, model, processor, model_path):
    """--tools: the multi-turn loop of training (utils/core/tool_rollout.py), --max_new_tokens counting the model's
    and the tools' tokens; None without tools."""
    if not cfg.tools:
        return None

    tokenizer = getattr(processor, "tokenizer", processor)
    stop_ids = stop_token_ids(model, tokenizer)
    toolbox = ToolBox(cfg.tools, timeout=cfg.tool_timeout, max_pixels=pixel_budget(processor))
    fmt = tool_format(processor, [tokenizer.decode([i]) for i in stop_ids], model_name=model_path)
    return ToolRollout(processor, toolbox, fmt, stop_ids=stop_ids, max_completion_length=cfg.max_new_tokens,
                       max_iterations=cfg.max_tool_calling_iterations, context_limit=context_limit(model),
                       model_type=model.config.model_type)


def score(cfg, rows, texts, output_dir):
    """Write the prediction files and compute every requested metric; returns the metrics dict."""
    os.makedirs(output_dir, exist_ok=True)
    predictions, references = crystal_files(rows, texts, prompt_template=cfg.prompt_template,
                                            prompt_column=cfg.prompt_column)
    _write_json(os.path.join(output_dir, "predictions.json"), predictions)
    _write_json(os.path.join(output_dir, "references.json"), references)
    grade, judge = AnswerGrader(), benchmark_judge(cfg)
    group_by = list(cfg.group_by) + [c for c in BENCHMARK_GROUPS.get(cfg.benchmark, ()) if c not in cfg.group_by]
    records = []
    for index, (row, text) in enumerate(zip(rows, texts)):
        _, answer = parse_completion(text, prompt_template=cfg.prompt_template)
        question = prompt_question(row, prompt_column=cfg.prompt_column)
        record = {"id": str(row.get("id", index)), "question": question, "completion": text,
                  "predicted_answer": answer, "answer": str(row["answer"])}
        if judge:  # the benchmark's own rules, on the answer block (or, without one, the whole response)
            record["correct"], record["prediction"] = judge(row, answer or text)
        else:
            record["correct"] = grade(question, answer, row["answer"])
        records.append({**record, **{c: row.get(c) for c in group_by if c in row}})

    metrics = {"samples": len(rows), "format": sum(bool(r["predicted_answer"]) for r in records) / max(len(rows), 1)}
    if cfg.benchmark:
        metrics["benchmark"] = cfg.benchmark
    metrics["accuracy"] = sum(r["correct"] for r in records) / max(len(rows), 1)
    metrics.update(group_means(rows, [r["correct"] for r in records], group_by, "accuracy"))
    if "crystal" in cfg.metrics:
        model_name, default_threshold = resolve_embedding_model(cfg.embedding_model)
        threshold = cfg.similarity_threshold if cfg.similarity_threshold is not None else default_threshold
        summary, per_sample = crystal_scores(predictions, references, embedding_model=model_name, threshold=threshold,
                                             alpha=cfg.alpha, order_metric=cfg.order_metric)
        metrics["crystal"] = summary
        metrics.update({k: summary[k] for k in ("match_f1", "ordered_match_f1", "precision", "recall") if k in summary})
        metrics["accuracy"] = summary["accuracy"]  # the same count as above, from the package itself
        for key in ("match_f1", "ordered_match_f1"):
            metrics.update(group_means(rows, [per_sample[r["id"]][key] for r in records], cfg.group_by, key))
    if "math" in cfg.metrics:
        values = get_reward("math_accuracy")(texts, answer=[str(r["answer"]) for r in rows])
        metrics["math_accuracy"] = sum(values) / max(len(values), 1)
        metrics.update(group_means(rows, values, cfg.group_by, "math_accuracy"))
    if "keywords" in cfg.metrics:
        metrics["keywords"] = keyword_frequencies(texts)
        if cfg.compare:
            metrics["keywords_compare"] = compare_keywords(metrics["keywords"],
                                                           keyword_frequencies(load_texts(cfg.compare)))

    with open(os.path.join(output_dir, "generations.jsonl"), "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")
    _write_json(os.path.join(output_dir, "metrics.json"), metrics)
    with open(os.path.join(output_dir, "metrics.md"), "w", encoding="utf-8") as f:
        f.write(markdown_report(metrics))
    return metrics


def benchmark_judge(cfg):
    """(row, response) -> (correct, prediction) by --benchmark's rules, with the LLM extractor when given; None
    without --benchmark."""
    if not cfg.benchmark:
        return None

    extractor = (LLMAnswerExtractor(cfg.answer_extractor_base_url, cfg.answer_extractor_model, api_key=cfg.api_key,
                                    timeout=cfg.request_timeout, max_retries=cfg.max_retries,
                                    deadline=cfg.request_deadline, allow_insecure_api_key=cfg.allow_insecure_api_key)
                 if cfg.answer_extractor_base_url else None)
    return lambda row, response: benchmark_correct(row, response, extractor)


def markdown_report(metrics):
    """The metrics as markdown tables: headline numbers, per-group numbers, keywords."""
    lines = ["| metric | value |", "|---|---|"]
    headline = ("samples", "accuracy", "format", "match_f1", "ordered_match_f1", "precision", "recall", "math_accuracy")
    lines += [f"| {k} | {_fmt(metrics[k])} |" for k in headline if k in metrics]
    grouped = sorted(k for k in metrics if "/" in k)
    if grouped:
        lines += ["", "| metric | group | value |", "|---|---|---|"]
        lines += [f"| {k.split('/', 1)[0]} | {k.split('/', 1)[1]} | {_fmt(metrics[k])} |" for k in grouped]
    if "keywords" in metrics:
        compare = metrics.get("keywords_compare", {})
        head = "| keyword group | per response | responses with one |" + (" other | delta |" if compare else "")
        lines += ["", head, "|---|---|---|" + ("---|---|" if compare else "")]
        for group, stats in metrics["keywords"].items():
            row = f"| {group} | {stats['per_response']:.3f} | {stats['response_rate']:.3f} |"
            if group in compare:
                row += f" {compare[group]['other']:.3f} | {compare[group]['delta']:+.3f} |"
            lines.append(row)
    return "\n".join(lines) + "\n"


def _fmt(value):
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _write_json(path, data):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)


def checkpoints_in(folder):
    """(step, path) of every `checkpoint-N` model folder in `folder`, by step."""
    found = []
    for name in os.listdir(folder):
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        path = os.path.join(folder, name)
        if match and os.path.isfile(os.path.join(path, "config.json")):
            found.append((int(match.group(1)), path))
    if not found:
        raise FileNotFoundError(f"--select_best: no checkpoint-N folder with a config.json in {folder}")
    return sorted(found)


def select_best(cfg, rows):
    """Score every checkpoint; the best by --select_metric (ties: the earliest) -> best_checkpoint.json. With
    --select_guard_metric, only among the candidates that keep that metric (`guarded_pick`)."""
    output_dir = cfg.output_dir or os.path.join(cfg.select_best, "eval")
    scores, steps, guards = {}, {}, {}
    candidates = [(0, path, f"include-{j}") for j, path in enumerate(cfg.select_include)]
    candidates += [(step, path, os.path.basename(path)) for step, path in checkpoints_in(cfg.select_best)]
    for step, path, name in candidates:
        print(f"evaluating {path}", flush=True)
        metrics = score(cfg, rows, generate(cfg, path, rows), os.path.join(output_dir, name))
        scores[path], steps[path] = metrics[cfg.select_metric], step
        guards[path] = metrics[cfg.select_guard_metric] if cfg.select_guard_metric else None
        guard = f", {cfg.select_guard_metric} {guards[path]:.4f}" if cfg.select_guard_metric else ""
        print(f"  {cfg.select_metric} {scores[path]:.4f}{guard}", flush=True)
    result = {"metric": cfg.select_metric, "scores": scores, "steps": steps}
    if cfg.select_guard_metric:
        best, floor = guarded_pick(scores, guards, cfg.select_guard_tolerance)
        result["guard"] = {"metric": cfg.select_guard_metric, "tolerance": cfg.select_guard_tolerance,
                           "floor": floor, "values": guards, "eligible": [p for p in scores if guards[p] >= floor]}
    else:
        best = max(scores, key=lambda p: scores[p])  # max keeps the first (earliest) of equal scores
    result = {"best_checkpoint": best, "best_step": steps[best], "value": scores[best], **result}
    _write_json(os.path.join(output_dir, "best_checkpoint.json"), result)
    kept = f" among those with {cfg.select_guard_metric} >= {result['guard']['floor']:.4f}" if "guard" in result else ""
    print(f"best checkpoint by {cfg.select_metric}{kept}: {best} ({scores[best]:.4f})")
    return result


def guarded_pick(scores, guards, tolerance):
    """The best candidate by `scores` (ties: the earliest) among those whose guard value is at least the first
    candidate's minus `tolerance` (the first candidate itself always qualifies). Returns (best, that floor)."""
    first = next(iter(scores))
    floor = guards[first] - tolerance
    eligible = [p for p in scores if guards[p] >= floor]
    return max(eligible, key=lambda p: scores[p]), floor


def print_table(metrics):
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a requirement
        print(markdown_report(metrics))
        return
    table = Table(title="evaluation")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        if isinstance(value, (int, float)):
            table.add_row(key, _fmt(value))
    for group, stats in metrics.get("keywords", {}).items():
        table.add_row(f"keywords/{group} per response", f"{stats['per_response']:.3f}")
    Console().print(table)


def default_output_dir(cfg):
    """outputs/eval/<name>: the model folder's last two path parts (`grpo-checkpoint-400`), a hub name
    (`Qwen--Qwen2.5-VL-3B-Instruct`) or the served model's name. Never inside the model's own folder: a checkpoint
    folder is what a later push uploads and may be a shared, read-only cache."""
    name = cfg.served_model_name if cfg.base_url else cfg.model
    parts = [p for p in os.path.normpath(name).split(os.sep) if p not in ("", ".", "..")]
    joiner = "--" if not os.path.exists(name) and len(parts) == 2 else "-"  # a hub name: org--model, as the HF cache
    return os.path.join("outputs", "eval", re.sub(r"[^\w.-]", "_", joiner.join(parts[-2:])))


def main(cfg: EvalConfig):
    validate(cfg)
    set_cpu_threads(cfg.cpu_threads)
    rows = load_rows(cfg)
    if cfg.select_best:
        return select_best(cfg, rows)
    output_dir = cfg.output_dir or default_output_dir(cfg)
    start = time.perf_counter()
    texts = generate(cfg, cfg.model, rows)
    metrics = score(cfg, rows, texts, output_dir)
    metrics["eval_seconds"] = time.perf_counter() - start
    metrics["config"] = config_to_dict(cfg)
    _write_json(os.path.join(output_dir, "metrics.json"), metrics)
    print_table(metrics)
    print(f"wrote {output_dir}/metrics.json, metrics.md, predictions.json, references.json, generations.jsonl")
    return metrics


if __name__ == "__main__":
    watch_stage_parent()  # a stage of iterate.py ends with it, however it ends
    with exit_on_bad_input("evaluate.py"):  # bad input (data, model paths) ends in one line
        main(parse_config(EvalConfig, sys.argv[1:]))
