"""Distil reasoning chains into SFT data (OpenVLThinker): caption each image, ask a text reasoner for k chains
from caption + question, keep one correct chain, cut its reflections, and write sharegpt rows for train_sft.py.

    python distill.py                                            # the tiny world (recipes/tiny_distill.yaml)
    python distill.py --dataset my_vqa.jsonl --captioner Qwen/Qwen2.5-VL-3B-Instruct \
        --reasoner_base_url http://127.0.0.1:8000/v1 --reasoner_model deepseek-ai/DeepSeek-R1-Distill-Qwen-14B
    python distill.py --chain_source model --model outputs/cycle-1/grpo-hard/checkpoint-N ...   # the VLM's own

Per question: a caption (a local VLM, an OpenAI-compatible endpoint, or a column of the data), k chains
(`--num_chains`) from the reasoner endpoint (or, with `--chain_source model`, k answers of the VLM itself from
the image), graded (math-verify, then CRYSTAL's answer rules), one correct chain kept (`--select`), reflections
cut ("Wait", "But wait", "But the question"), chains over `--max_words` dropped (utils/eval/chains.py).

Output in --output_dir: `sft.jsonl` (sharegpt rows: system, `<image>` + question, the chain; images saved
under `images/` or referenced where they are), `drops.jsonl` (one line per dropped question and why),
`summary.json` (every drop reason counted), `config.yaml`. Both jsonl files are append-only: a restarted run
skips every question already in either, so a killed run loses only the questions in flight. Questions whose
requests fail after the retries are written nowhere and tried again on the next run (the exit code is 1).
"""

import io
import json
import os
import random
import re
import sys
import time
import zlib
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import PIL.Image

from rewards.judge import JudgeClient, JudgeError
from tiny.cache import REPO, TINY_DATASET, resolve_dataset, resolve_tiny_name, tiny_recipe
from utils.core.config import ConfigError, choice, parse_config, save_config
from utils.core.data import IMAGE_MARKER, images_of, load_vqa, render_question
from utils.core.errors import exit_on_bad_input
from utils.core.launch import set_cpu_threads, watch_stage_parent
from utils.core.models import load_model_and_processor
from utils.core.prompts import CAPTION_PROMPT, REASONER_PROMPT, SYSTEM_PROMPTS
from utils.core.serving import LocalServer, serving_problem
from utils.eval.chains import DROP_REASONS, REFLECTION_MARKERS, SELECT_RULES, Grader, filter_chains
from utils.eval.heldout import generate_answers

TINY_DISTILL_RECIPE = os.path.join(REPO, "recipes", "tiny_distill.yaml")
SFT_FILE, DROPS_FILE, SUMMARY_FILE = "sft.jsonl", "drops.jsonl", "summary.json"


@dataclass
class DistillConfig:
    """Reasoning chains for SFT, distilled: a text reasoner answers each question from a caption of its image (or a
    VLM answers from the image itself), k chains per question; the filters keep one correct chain per question, its
    reflection cut, and write sharegpt rows for train_sft.py. Flags override the recipe of --config; without one,
    the tiny recipe (recipes/tiny_distill.yaml: tiny-base captions, tiny-reasoner served on 127.0.0.1) runs under
    the flags given, unless they name models or endpoints of their own. docs/flags.md lists every flag."""

    # questions
    dataset: str = field(default=TINY_DATASET, metadata={"help": "VQA rows (image, question, answer): hub name, "
                                                                 "save_to_disk folder or data file"})
    split: str = "train"  # split of --dataset
    image_column: str = "image"  # column with the image(s)
    question_column: str = "question"  # column with the question
    answer_column: str = "answer"  # column with the gold answer the chains are graded against
    choices_column: Optional[str] = None  # column with answer options; none: 'choices' or 'options' when present
    id_column: Optional[str] = None  # column with question ids; none: 'id' when present, else the row index
    shuffle_seed: Optional[int] = None  # visit the questions in this seeded order; none: data order
    max_samples: Optional[int] = None  # questions to try (after --shuffle_seed); none: all
    max_kept: Optional[int] = field(default=None, metadata={
        "help": "stop once this many rows are kept (questions still in flight are not written); none: no limit"})
    # where the chains come from
    chain_source: str = choice("reasoner", "model",
                               help="reasoner: caption + question to a text reasoner; model: a VLM answers the image")
    # captions (--chain_source reasoner): a local VLM, an endpoint, or a column
    captioner: Optional[str] = field(default="tiny-base", metadata={
        "help": "local VLM (folder or hub name) that captions; 'tiny-base' is the tiny world's"})
    captioner_base_url: Optional[str] = None  # OpenAI-compatible endpoint that captions (instead of --captioner)
    captioner_model: Optional[str] = None  # model name the --captioner_base_url server serves
    caption_column: Optional[str] = None  # take captions from this column instead of captioning
    caption_prompt: str = CAPTION_PROMPT  # what the captioner is asked
    caption_max_new_tokens: int = 512  # max tokens per caption
    # the text reasoner (--chain_source reasoner)
    reasoner_base_url: Optional[str] = None  # OpenAI-compatible endpoint of the reasoner (e.g. a vLLM server)
    reasoner_model: str = field(default="tiny-reasoner", metadata={
        "help": "model name the reasoner endpoint serves; with --reasoner_serve a local folder or hub name"})
    reasoner_serve: bool = field(default=False, metadata={
        "help": "start `transformers serve` for --reasoner_model on 127.0.0.1 for this run"})
    reasoner_prompt: str = field(default=REASONER_PROMPT, metadata={
        "help": "the reasoner's user turn, with {caption} and {question}"})
    # the model's own chains (--chain_source model)
    model: Optional[str] = None  # local VLM checkpoint whose answers become chains
    model_base_url: Optional[str] = None  # OpenAI-compatible endpoint serving that VLM (instead of --model)
    model_serve: bool = field(default=False, metadata={
        "help": "--model answers through `transformers serve` started on 127.0.0.1 for this run (requests, "
                "--max_concurrency in flight) instead of in-process batched generate"})
    served_model_name: Optional[str] = None  # model name the --model_base_url server serves
    prompt_template: str = choice("think_answer", "crystal_json", "plain",
                                  help="system prompt of the SFT rows, and of --chain_source model")
    # sampling
    num_chains: int = 4  # k chains per question
    temperature: float = 0.6  # sampling temperature of the chains
    top_p: float = 0.95  # nucleus sampling of the chains
    max_new_tokens: int = 4096  # max tokens per chain
    seed: int = 0  # sampling seed (one per question and chain)
    batch_size: int = 32  # prompts per local generation batch (--captioner, --model)
    cpu_threads: Optional[int] = None  # torch threads without a GPU; none: all cores
    # requests
    api_key: Optional[str] = None  # API key of the endpoints; none: $OPENAI_API_KEY or EMPTY
    request_timeout: float = 600.0  # seconds per request (wall clock, the reply included)
    request_deadline: Optional[float] = None  # seconds for a request and all its retries; none: no bound beyond them
    allow_insecure_api_key: bool = field(default=False, metadata={
        "help": "send the API key over plain http to a host other than 127.0.0.1 (refused otherwise: it travels in "
                "clear)"})
    max_retries: int = 3  # retries per request (connection errors, timeouts, 429, 5xx), with exponential backoff
    retry_backoff: float = 1.0  # seconds before the first retry (doubled each time)
    max_concurrency: int = 8  # questions in flight at once
    # filters
    select: str = choice(*SELECT_RULES, help="which correct chain is kept (lengths in words)")
    cut_reflections: bool = True  # cut each kept chain at its first reflection marker
    reflection_markers: list[str] = field(default_factory=lambda: list(REFLECTION_MARKERS))  # where chains are cut
    max_words: Optional[int] = 500  # drop a kept chain whose reasoning is longer than this (after the cut); none: off
    # output
    output_dir: str = "outputs/distill"  # sft.jsonl, drops.jsonl, images/, summary.json, config.yaml


def parse_args(argv=None):
    """The run's config: flags over --config's recipe, or over the tiny one (tiny.cache.tiny_recipe)."""
    models = ("captioner", "captioner_base_url", "reasoner_model", "reasoner_base_url", "model", "model_base_url")
    return parse_config(DistillConfig, argv, default_recipe=tiny_recipe(TINY_DISTILL_RECIPE, *models))


def validate(cfg):
    """Every flag combination that cannot work fails here, before a model is loaded or a request sent."""
    if cfg.num_chains < 1:
        raise ConfigError(f"--num_chains must be >= 1, got {cfg.num_chains}")
    for flag in ("batch_size", "max_concurrency", "caption_max_new_tokens", "max_new_tokens"):
        if getattr(cfg, flag) < 1:
            raise ConfigError(f"--{flag} must be >= 1, got {getattr(cfg, flag)}")
    if cfg.max_retries < 0 or cfg.request_timeout <= 0 or (cfg.request_deadline is not None
                                                            and cfg.request_deadline <= 0):
        raise ConfigError("--max_retries must be >= 0, --request_timeout and --request_deadline > 0")
    if cfg.chain_source == "reasoner":
        sources = [cfg.caption_column, cfg.captioner_base_url]
        if sum(s is not None for s in sources) > 1:
            raise ConfigError("give one caption source: --caption_column, --captioner_base_url or --captioner")
        if cfg.captioner_base_url and not cfg.captioner_model:
            raise ConfigError("--captioner_base_url needs --captioner_model (the model name the server serves)")
        if not (cfg.caption_column or cfg.captioner_base_url or cfg.captioner):
            raise ConfigError("--chain_source reasoner needs captions: --captioner, --captioner_base_url or "
                              "--caption_column")
        if bool(cfg.reasoner_base_url) == cfg.reasoner_serve:
            raise ConfigError("--chain_source reasoner needs exactly one of --reasoner_base_url (a running server) "
                              "or --reasoner_serve (start transformers serve for --reasoner_model)")
        missing = [k for k in ("caption", "question") if "{" + k + "}" not in cfg.reasoner_prompt]
        if missing:
            raise ConfigError(f"--reasoner_prompt must contain {', '.join('{' + k + '}' for k in missing)}")
    elif bool(cfg.model) == bool(cfg.model_base_url):
        raise ConfigError("--chain_source model needs exactly one of --model or --model_base_url")
    elif cfg.model_base_url and not cfg.served_model_name:
        raise ConfigError("--model_base_url needs --served_model_name (the model name the server serves)")
    elif cfg.model_serve and not cfg.model:
        raise ConfigError("--model_serve serves --model: give --model (a local checkpoint), not --model_base_url")
    from rewards.judge import check_key_transport

    for flag in ("reasoner_base_url", "captioner_base_url", "model_base_url"):
        if getattr(cfg, flag):  # before a model loads: an API key would travel in clear
            try:
                check_key_transport(getattr(cfg, flag), cfg.api_key or os.environ.get("OPENAI_API_KEY"),
                                    cfg.allow_insecure_api_key)
            except ValueError as error:
                raise ConfigError(f"--{flag}: {error}") from None
    serve = ("--reasoner_serve" if cfg.chain_source == "reasoner" and cfg.reasoner_serve else
             "--model_serve" if cfg.chain_source == "model" and cfg.model_serve else None)
    if serve:
        problem = serving_problem(f"distill.py {serve}")
        if problem:  # refused here, before any model is built or loaded
            raise ConfigError(problem)


# --------------------------------------------------------------------------------------------------
# Output files: append-only, so a restart knows which questions are finished


def read_records(path):
    """The complete lines of an append-only jsonl file; a last line cut short by a kill is removed from it."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # a partial last line: drop it so the next append starts on a fresh line
        with open(path, "r+b") as f:
            f.truncate(end)
    return [json.loads(line) for line in data[:end].decode("utf-8").splitlines() if line.strip()]


def append_record(handle, record):
    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def image_stem(row_id):
    """The file name (without `-j.ext`) of a row's written images: its id with anything but letters, digits, '.', '-'
    and '_' made '_'."""
    return re.sub(r"[^\w.-]", "_", str(row_id))


def check_image_stems(dataset, ids):
    """Two ids whose image files would share a name ("q 1" and "q_1") are refused, naming both rows: the second row
    would silently get the first one's image."""
    seen = {}
    for row, row_id in enumerate(ids):
        stem = image_stem(row_id)
        if stem in seen:
            first = seen[stem]
            raise ConfigError(f"{dataset}: rows {first} and {row} have ids {ids[first]!r} and {row_id!r}, whose image "
                              f"files would both be named {stem!r}-j: make the ids differ in letters, digits, '.', '-' "
                              "or '_' (or set --id_column)")
        seen[stem] = row


def sft_row(cfg, row, image_paths, outcome, caption):
    system = SYSTEM_PROMPTS[cfg.prompt_template]
    user = IMAGE_MARKER * len(image_paths) + render_question(row["question"], row.get("choices"))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": outcome.target}]
    return {"id": row["id"], "messages": messages, "images": image_paths, "answer": str(row["answer"]),
            "caption": caption, "source": cfg.chain_source, "chains": len(outcome.answers),
            "correct_chains": sum(outcome.correct), "no_answer_chains": sum(a is None for a in outcome.answers),
            "reflection_cut": outcome.cut, "words": outcome.words}


class Writer:
    """Filters each finished question's chains and appends it to sft.jsonl or drops.jsonl (main thread only)."""

    def __init__(self, cfg, dataset, kept_so_far, todo):
        import datasets

        self.cfg, self.dataset, self.grade = cfg, dataset, Grader()
        # the stored image cells, undecoded: original paths are referenced, bytes written once
        undecoded = (datasets.List(datasets.Image(decode=False)) if isinstance(dataset.features["image"], datasets.List)
                     else datasets.Image(decode=False))
        self.images = dataset.select_columns(["image"]).cast_column("image", undecoded)
        self.kept, self.done, self.failed = kept_so_far, 0, 0
        self.start = time.monotonic()
        self.progress = Progress(len(todo), self.start)
        self.sft = open(os.path.join(cfg.output_dir, SFT_FILE), "a", encoding="utf-8")
        self.drops = open(os.path.join(cfg.output_dir, DROPS_FILE), "a", encoding="utf-8")

    def enough(self):
        return self.cfg.max_kept is not None and self.kept >= self.cfg.max_kept

    def image_refs(self, index, row_id):
        """Paths of a row's images (relative to the output folder when inside it): the original file where the data
        references one, else its bytes written once to images/."""
        cell = self.images[index]["image"]
        refs, out_dir = [], self.cfg.output_dir
        for j, cell in enumerate(cell if isinstance(cell, list) else [cell]):
            if cell.get("path") and not cell.get("bytes") and os.path.isfile(cell["path"]):
                path = os.path.abspath(cell["path"])
            else:
                ext = (PIL.Image.open(io.BytesIO(cell["bytes"])).format or "png").lower()
                path = os.path.join(out_dir, "images", image_stem(row_id) + f"-{j}.{ext}")
                if not os.path.exists(path):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path + ".tmp", "wb") as f:
                        f.write(cell["bytes"])
                    os.replace(path + ".tmp", path)
            inside = os.path.abspath(path).startswith(os.path.abspath(out_dir) + os.sep)
            refs.append(os.path.relpath(path, out_dir) if inside else path)
        return refs

    def finish(self, index, chains, caption):
        if self.enough():  # --max_kept reached: questions still in flight are left for another run
            return
        cfg, row = self.cfg, self.dataset[index]
        outcome = filter_chains(chains, question=render_question(row["question"], row.get("choices")),
                                gold=row["answer"], grade=self.grade, select=cfg.select,
                                cut_reflections=cfg.cut_reflections, markers=cfg.reflection_markers,
                                max_words=cfg.max_words)
        if outcome.target is not None:
            append_record(self.sft, sft_row(cfg, row, self.image_refs(index, row["id"]), outcome, caption))
            self.kept += 1
        else:
            append_record(self.drops, {"id": row["id"], "reason": outcome.reason, "chains": len(chains),
                                       "correct_chains": sum(outcome.correct),
                                       "no_answer_chains": sum(a is None for a in outcome.answers),
                                       "answers": outcome.answers, "answer": str(row["answer"]), "caption": caption})
        self.done += 1
        self.progress.update(self.done, self.kept)

    def collect(self, index, future):
        """Wait for one question's requests, then write it; a question whose requests failed is only counted."""
        try:
            chains, caption = future.result()
        except JudgeError as error:
            print(f"distill: question {self.dataset[index]['id']!r} failed: {error}", file=sys.stderr, flush=True)
            self.failed += 1
            return
        self.finish(index, chains, caption)

    def close(self):
        self.sft.close()
        self.drops.close()
        self.progress.close()


def summarise(cfg, kept, drops, failed, seconds):
    """Counts over everything in the output files (this run and earlier ones)."""
    reasons = Counter(d["reason"] for d in drops)
    rows = kept + drops
    return {"questions": len(rows), "kept": len(kept), "dropped": len(drops),
            "drop_reasons": {r: reasons.get(r, 0) for r in DROP_REASONS}, "failed_this_run": failed,
            "chains": sum(r["chains"] for r in rows), "correct_chains": sum(r["correct_chains"] for r in rows),
            "no_answer_chains": sum(r["no_answer_chains"] for r in rows),
            "reflections_cut": sum(r["reflection_cut"] for r in kept),
            "mean_words_kept": sum(r["words"] for r in kept) / max(len(kept), 1),
            "yield": len(kept) / max(len(rows), 1), "chain_source": cfg.chain_source, "select": cfg.select,
            "seconds_this_run": seconds}


# --------------------------------------------------------------------------------------------------
# Where captions and chains come from


def client(cfg, base_url, model, *, temperature, max_tokens):
    return JudgeClient(base_url, model, api_key=cfg.api_key, timeout=cfg.request_timeout, max_retries=cfg.max_retries,
                       max_concurrency=cfg.max_concurrency, temperature=temperature, max_tokens=max_tokens,
                       backoff=cfg.retry_backoff, deadline=cfg.request_deadline,
                       allow_insecure_api_key=cfg.allow_insecure_api_key)


def load_local(name):
    import torch

    model, processor = load_model_and_processor(resolve_tiny_name(name))
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    return model, processor


def local_answers(model, processor, rows, *, prompt_template, max_new_tokens, batch_size, k=1, temperature=0.0,
                  seed=0, question=None):
    """k completions per row from a local model (greedy when temperature <= 0), rows in order; `question`
    replaces every row's question (and drops its choices), e.g. the caption prompt."""
    repeated = [dict(r, question=question, choices=None) if question else r for r in rows for _ in range(k)]
    texts = generate_answers(model, processor, repeated, prompt_template=prompt_template, batch_size=batch_size,
                             max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    return [texts[i * k:(i + 1) * k] for i in range(len(rows))]


def request_seed(cfg, row_id, j):
    """The sampling seed of chain j of a question: the same on every run, whatever the order of requests."""
    return (cfg.seed * 1_000_003 + zlib.crc32(f"{row_id}/{j}".encode())) % 2**31


def distill_with_local_model(cfg, dataset, todo, writer):
    """--chain_source model --model: k sampled answers per question from the VLM, in local batches."""
    model, processor = load_local(cfg.model)
    for at in range(0, len(todo), cfg.batch_size):
        if writer.enough():
            return
        chunk = todo[at:at + cfg.batch_size]
        texts = local_answers(model, processor, [dataset[i] for i in chunk], prompt_template=cfg.prompt_template,
                              max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, k=cfg.num_chains,
                              temperature=cfg.temperature, seed=cfg.seed * 1_000_003 + at)
        for index, chains in zip(chunk, texts):
            writer.finish(index, chains, None)


def distill_with_endpoint(cfg, dataset, todo, writer, base_url, served):
    """Chains from an OpenAI-compatible endpoint, `--max_concurrency` questions in flight: the text reasoner
    given caption + question, or (--chain_source model) the served VLM given image + question. A local captioner
    captions the next chunk of questions while the endpoint works on the current one."""
    chat = client(cfg, base_url, served, temperature=cfg.temperature, max_tokens=cfg.max_new_tokens)
    reasoner = cfg.chain_source == "reasoner"
    local_captioner = remote_captioner = None
    if reasoner and cfg.captioner_base_url:
        remote_captioner = client(cfg, cfg.captioner_base_url, cfg.captioner_model, temperature=0.0,
                                  max_tokens=cfg.caption_max_new_tokens)
    elif reasoner and not cfg.caption_column:
        local_captioner = load_local(cfg.captioner)

    def chains_for(index, caption):
        row = dataset[index]
        question = render_question(row["question"], row.get("choices"))
        system = None
        if not reasoner:  # the VLM is asked as it was trained and is evaluated: its template's system turn first
            prompt, image, system = question, images_of(row)[0], SYSTEM_PROMPTS[cfg.prompt_template]
        else:
            if caption is None:  # captioned by the endpoint, in this worker
                caption = remote_captioner.chat(cfg.caption_prompt, images_of(row)[0]).strip()
            prompt, image = cfg.reasoner_prompt.format(caption=caption, question=question), None
        return [chat.chat(prompt, image, reasoning=True, system=system, top_p=cfg.top_p,
                          seed=request_seed(cfg, row["id"], j))
                for j in range(cfg.num_chains)], caption

    step = cfg.batch_size if local_captioner else cfg.max_concurrency
    pending = deque()
    with ThreadPoolExecutor(max_workers=cfg.max_concurrency) as pool:
        for at in range(0, len(todo), step):
            if writer.enough():
                break
            chunk = todo[at:at + step]
            if reasoner and cfg.caption_column:
                captions = [str(dataset[i][cfg.caption_column]) for i in chunk]
            elif local_captioner:
                texts = local_answers(*local_captioner, [dataset[i] for i in chunk], prompt_template="plain",
                                      question=cfg.caption_prompt, max_new_tokens=cfg.caption_max_new_tokens,
                                      batch_size=cfg.batch_size)
                captions = [t[0].strip() for t in texts]
            else:
                captions = [None] * len(chunk)
            pending.extend((i, pool.submit(chains_for, i, c)) for i, c in zip(chunk, captions))
            # at most two chunks in flight: the pool stays busy while the next chunk is captioned
            while len(pending) > step or (pending and pending[0][1].done()):
                writer.collect(*pending.popleft())
        while pending:
            writer.collect(*pending.popleft())


def serve(cfg, model, log_name):
    """`transformers serve` of a local model folder on 127.0.0.1 for this run (its log in --output_dir)."""
    return LocalServer(resolve_tiny_name(model), threads=cfg.cpu_threads,
                       log_path=os.path.join(cfg.output_dir, log_name)).start()


def main(cfg: DistillConfig):
    validate(cfg)
    set_cpu_threads(cfg.cpu_threads)
    os.makedirs(cfg.output_dir, exist_ok=True)
    save_config(cfg, os.path.join(cfg.output_dir, "config.yaml"))

    # ---- questions (validated before any model is loaded or request sent), minus those finished earlier ----
    path = resolve_dataset(cfg.dataset)
    dataset = load_vqa(path, split=cfg.split, image_column=cfg.image_column, question_column=cfg.question_column,
                       answer_column=cfg.answer_column, choices_column=cfg.choices_column, id_column=cfg.id_column,
                       require_steps=False)
    if cfg.caption_column and cfg.caption_column not in dataset.column_names:
        raise ConfigError(f"--caption_column {cfg.caption_column!r} is not a column of {cfg.dataset}; columns: "
                          f"{dataset.column_names}")
    ids = dataset["id"]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{cfg.dataset}: question ids are not unique (set --id_column)")
    check_image_stems(cfg.dataset, ids)
    order = list(range(len(dataset)))
    if cfg.shuffle_seed is not None:
        random.Random(cfg.shuffle_seed).shuffle(order)
    order = order[:cfg.max_samples] if cfg.max_samples else order
    sft_path, drops_path = os.path.join(cfg.output_dir, SFT_FILE), os.path.join(cfg.output_dir, DROPS_FILE)
    kept, drops = read_records(sft_path), read_records(drops_path)
    finished = {r["id"] for r in kept} | {d["id"] for d in drops}
    todo = [i for i in order if ids[i] not in finished]
    print(f"distill: {len(order)} questions, {len(order) - len(todo)} finished earlier, {len(todo)} to do "
          f"({len(kept)} kept so far)", flush=True)

    writer = Writer(cfg, dataset, len(kept), todo)
    server = None
    try:
        if cfg.chain_source == "model" and cfg.model and not cfg.model_serve:
            distill_with_local_model(cfg, dataset, todo, writer)
        else:
            if cfg.chain_source == "model" and cfg.model_serve:
                server = serve(cfg, cfg.model, "model_server.log")
                base_url, served = server.base_url, server.model_name
            elif cfg.chain_source == "model":
                base_url, served = cfg.model_base_url, cfg.served_model_name
            elif cfg.reasoner_serve:
                server = serve(cfg, cfg.reasoner_model, "reasoner_server.log")
                base_url, served = server.base_url, server.model_name
            else:
                base_url, served = cfg.reasoner_base_url, cfg.reasoner_model
            distill_with_endpoint(cfg, dataset, todo, writer, base_url, served)
    finally:
        writer.close()
        if server is not None:
            server.stop()

    summary = summarise(cfg, read_records(sft_path), read_records(drops_path), writer.failed,
                        time.monotonic() - writer.start)
    with open(os.path.join(cfg.output_dir, SUMMARY_FILE), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"distill: kept {summary['kept']} of {summary['questions']} questions (yield {summary['yield']:.3f}); "
          f"dropped {summary['drop_reasons']}; {summary['reflections_cut']} reflections cut", flush=True)
    if writer.failed:
        print(f"distill: {writer.failed} questions failed after {cfg.max_retries} retries and were not written; "
              "run the same command again to retry them", file=sys.stderr)
        raise SystemExit(1)
    return summary


class Progress:
    """A progress bar with ETA on a terminal (rich), a line every 10 s otherwise."""

    def __init__(self, total, start):
        self.total, self.start, self.last = total, start, 0.0
        self.bar = None
        if sys.stdout.isatty() and not os.environ.get("CI"):
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn("[bold]distill"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                    TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.task = self.bar.add_task("distill", total=total, info="")
            self.bar.start()

    def update(self, done, kept):
        if self.bar is not None:
            self.bar.update(self.task, completed=done, info=f"kept {kept}")
            return
        now = time.monotonic()
        if now - self.last >= 10 or done == self.total:
            self.last = now
            rate = done / max(now - self.start, 1e-9)
            eta = (self.total - done) / rate if rate else float("inf")
            print(f"distill {done}/{self.total} questions, kept {kept}, {rate:.2f} questions/s, "
                  f"eta {eta:.0f} s", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()


if __name__ == "__main__":
    watch_stage_parent()  # a stage of iterate.py ends with it, however it ends
    with exit_on_bad_input("distill.py"):  # bad input (data, model paths) ends in one line
        main(parse_args())
