"""The OpenVLThinker cycle, resumable: SFT -> difficulty estimate -> curriculum GRPO (medium, then hard) ->
held-out evaluation -> the next SFT set, written by the improved model -> the next cycle.

    python iterate.py                                             # two tiny cycles on the CPU (tiny_cycles.yaml)
    python iterate.py --config recipes/openvlthinker_cycles.yaml  # the published settings, on GPUs

Each stage runs one of the existing scripts in its own process and writes into output_dir/cycle-i/<stage>/:

    data              cycle 1: distill.py (caption -> text reasoner -> filters). Cycle i > 1: distill.py on the
                      previous cycle's final model (--next_data model: its own correct answers through the same
                      filters; reasoner: the text reasoner again), mixed with --keep_previous of the previous set
    sft               train_sft.py from --base_model (every cycle restarts from the base)
    grpo-medium       train_grpo.py --curriculum medium from the SFT model; it estimates every RL question's
                      difficulty with that model (error rate over k samples, tertiles)
    grpo-hard         train_grpo.py --curriculum hard from the medium stage's model, on the same estimate
    eval-<stage>      evaluate.py on the held-out set after sft, grpo-medium and grpo-hard (and eval-base once)

Training stages go through `accelerate launch` with --accelerate_config (none: your default accelerate
config, the one `accelerate config` wrote). A stage counts as finished once its stage.json exists (written after
its script succeeded); a rerun of the same command skips finished stages and resumes the first unfinished one:
the training scripts from their last checkpoint, distill.py from its append-only files. The run ends with
report.json and report.png: held-out accuracy after every stage of every cycle, reasoning-keyword frequencies,
and the SFT efficacy score. docs/openvlthinker.md has the details.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import yaml

import distill
import evaluate
import train_grpo
import train_sft
from tiny.cache import REPO, TINY_BASE_MODEL, TINY_DATASET, resolve_dataset, resolve_tiny_name, tiny_recipe
from utils.core.checkpoint import latest_checkpoint
from utils.core.config import ConfigError, choice, parse_config, save_config
from utils.core.data import load_vqa
from utils.core.errors import exit_on_bad_input
from utils.core.launch import stage_parent_env
from utils.core.output_dir import hold_lock, release
from utils.core.secrets import literal_secrets
from utils.core.serving import die_with_parent, serving_problem
from utils.eval.keywords import keyword_shares, sft_efficacy_score

TINY_CYCLES_RECIPE = os.path.join(REPO, "recipes", "tiny_cycles.yaml")
STAGE_FILE = "stage.json"
ESTIMATED_DIFFICULTY = "estimated_difficulty"


@dataclass
class IterateConfig:
    """OpenVLThinker's SFT <-> RL cycles, stage by stage: each cycle distils SFT rows (distill.py), fine-tunes the
    base model on them (train_sft.py), runs GRPO on medium, then hard questions (train_grpo.py) and evaluates every
    stage (evaluate.py); a stopped run resumes at its unfinished stage. Flags override the recipe of --config;
    without one, the tiny recipe (recipes/tiny_cycles.yaml) runs under the flags given, unless --base_model names a
    model of its own. docs/flags.md lists every flag."""

    # the cycle
    num_cycles: int = 3  # SFT -> RL cycles
    base_model: str = field(default=TINY_BASE_MODEL, metadata={
        "help": "the model every cycle's SFT starts from; 'tiny-base' is the tiny world's"})
    output_dir: str = "outputs/cycles"  # cycle-i/<stage>/ folders, rl-data/, report.json, report.png
    accelerate_config: Optional[str] = field(default=None, metadata={
        "help": "`accelerate launch --config_file` of every training stage; none: your default accelerate config"})
    seed: int = 0  # seed of every stage (data order, sampling, init); vary it to repeat the whole cycle
    prompt_template: str = choice("think_answer", "crystal_json", "plain",
                                  help="answer format of the SFT rows, the RL prompts and the evaluation")
    # SFT data
    sft_sizes: list[int] = field(default_factory=lambda: [25000, 5000, 5000], metadata={
        "help": "SFT rows of each cycle (the last value repeats)"})
    keep_previous: float = 0.7  # share of cycle i's SFT rows drawn from cycle i-1's set; the rest are new
    next_data: str = choice("model", "reasoner",
                            help="who writes the new rows of cycle i > 1: the previous cycle's model, or the reasoner")
    next_data_serve: bool = field(default=False, metadata={
        "help": "--next_data model: the previous cycle's model answers through `transformers serve` on 127.0.0.1 "
                "(distill.py --model_serve, requests in flight) instead of in-process generate"})
    # RL data
    rl_dataset: str = TINY_DATASET  # VQA rows for GRPO (image, question, answer)
    rl_split: str = "train"  # split of --rl_dataset
    rl_samples: Optional[int] = None  # the first N rows form the RL set (a third each medium, hard); none: all
    rl_image_column: str = "image"  # column of --rl_dataset with the image(s)
    rl_question_column: str = "question"  # column of --rl_dataset with the question
    rl_answer_column: str = "answer"  # column of --rl_dataset with the answer
    difficulty_once: bool = field(default=True, metadata={
        "help": "estimate difficulty once per cycle (with the SFT model) for both RL stages; false: the hard "
                "stage estimates again with its own starting model"})
    # validation-picked checkpoints
    rl_eval_steps: Optional[int] = field(default=None, metadata={
        "help": "each RL stage checkpoints every N steps; its start and every checkpoint are scored on the "
                "validation rows and the cycle continues from the best (ties: the earliest); none: the last"})
    val_samples: int = 128  # validation rows
    val_dataset: Optional[str] = field(default=None, metadata={
        "help": "validation VQA rows of --rl_eval_steps; none: the --val_samples rows of --rl_dataset right after "
                "the RL set (never trained on)"})
    val_split: Optional[str] = None  # split of --val_dataset; none: --rl_split
    val_metric: str = choice("accuracy", "math_accuracy", "format",
                             help="what picks the checkpoint (evaluate.py --select_metric)")
    # resume
    restart_stage: bool = field(default=False, metadata={
        "help": "start over (its folder emptied) the unfinished stage whose flags differ from those it started "
                "with; without it such a stage is refused"})
    # held-out evaluation
    eval_dataset: str = TINY_DATASET  # held-out VQA rows (evaluate.py --dataset)
    eval_split: str = "test"  # split of --eval_dataset
    eval_samples: Optional[int] = None  # evaluate the first N rows; none: all
    eval_benchmark: Optional[str] = field(default=None, metadata={
        "help": "--eval_dataset is a local copy of this benchmark (mathvista, mathverse, mathvision), prompted and "
                "scored by its own rules (evaluate.py --benchmark); none: VQA rows"})
    eval_benchmarks: dict = field(default_factory=dict, metadata={
        "help": "more held-out sets by name, each a mapping of evaluate.py flags over --evaluate (dataset, split, "
                "benchmark, max_samples): the base model and each cycle's final model are scored on each, into "
                "eval-base-<name>/ and cycle-i/eval-grpo-hard-<name>/ (OpenVLThinker reports MathVerse, MathVision)"})
    # the stages: a recipe each (a YAML of that script's flags) and overrides on top of it
    distill_recipe: Optional[str] = None  # distill.py recipe
    distill: dict = field(default_factory=dict)  # distill.py flags over --distill_recipe (JSON on the command line)
    sft_recipe: Optional[str] = "recipes/openvlthinker_sft.yaml"  # train_sft.py recipe
    sft: dict = field(default_factory=dict)  # train_sft.py flags over --sft_recipe
    grpo_medium_recipe: Optional[str] = "recipes/openvlthinker_grpo_medium.yaml"  # train_grpo.py recipe, medium
    grpo_medium: dict = field(default_factory=dict)  # train_grpo.py flags over --grpo_medium_recipe
    grpo_hard_recipe: Optional[str] = "recipes/openvlthinker_grpo_hard.yaml"  # train_grpo.py recipe, hard
    grpo_hard: dict = field(default_factory=dict)  # train_grpo.py flags over --grpo_hard_recipe
    evaluate: dict = field(default_factory=lambda: {"metrics": ["accuracy", "math", "keywords"]}, metadata={
        "help": "evaluate.py flags of every evaluation"})


def parse_args(argv=None):
    """The run's config: flags over --config's recipe, or over the tiny one (tiny.cache.tiny_recipe)."""
    return parse_config(IterateConfig, argv, default_recipe=tiny_recipe(TINY_CYCLES_RECIPE, "base_model"))


def validate(cfg):
    if cfg.num_cycles < 1:
        raise ConfigError(f"--num_cycles must be >= 1, got {cfg.num_cycles}")
    if not cfg.sft_sizes or min(cfg.sft_sizes) < 1:
        raise ConfigError(f"--sft_sizes must be positive row counts, got {cfg.sft_sizes}")
    if not 0.0 <= cfg.keep_previous < 1.0:
        raise ConfigError(f"--keep_previous must be in [0, 1), got {cfg.keep_previous}")
    if cfg.accelerate_config and not os.path.isfile(cfg.accelerate_config):
        raise ConfigError(f"--accelerate_config: file not found: {cfg.accelerate_config}")
    if cfg.rl_eval_steps is not None and (cfg.rl_eval_steps < 1 or cfg.val_samples < 1):
        raise ConfigError(f"--rl_eval_steps ({cfg.rl_eval_steps}) and --val_samples ({cfg.val_samples}) must be >= 1")
    for name, flags in cfg.eval_benchmarks.items():
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", str(name)):
            raise ConfigError(f"--eval_benchmarks: {name!r} names folders (eval-base-<name>): use letters, digits, "
                              "'.', '_' and '-'")
        if not isinstance(flags, dict) or not flags.get("dataset"):
            raise ConfigError(f"--eval_benchmarks {name}: expected a mapping of evaluate.py flags with a dataset, "
                              f"got {flags!r}")
    if cfg.next_data_serve and cfg.next_data != "model":
        raise ConfigError("--next_data_serve serves the previous cycle's model: it needs --next_data model")
    if cfg.next_data_serve and cfg.num_cycles > 1:
        problem = serving_problem("iterate.py --next_data_serve")
        if problem:  # before any stage or tiny-model build
            raise ConfigError(problem)


# --------------------------------------------------------------------------------------------------
# Stage recipes: the stage's recipe file, then the user's overrides, then what the cycle decides


def _recipe_path(path):
    return path if path is None or os.path.isabs(path) or os.path.exists(path) else os.path.join(REPO, path)


def stage_recipe(recipe, overrides, forced, defaults=None, cycle=None):
    """The stage's flags: `defaults` <- the recipe file <- `cycle` (what the cycle sets for every stage: its seed)
    <- the user's overrides <- `forced` (models, data, folders)."""
    merged = dict(defaults or {})
    path = _recipe_path(recipe)
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"recipe file not found: {recipe}")
        with open(path) as f:
            merged.update(yaml.safe_load(f) or {})
    merged.update(cycle or {})
    merged.update(overrides)
    merged.update(forced)
    return merged


def write_recipe(values, path, config_cls):
    """Write a stage's recipe and check it parses with the script's own config class (an unknown key or a bad
    value fails here, naming the stage, before any compute)."""
    secrets = literal_secrets(values)
    if secrets:  # refused before it is written: the stage would refuse its recipe anyway
        raise ConfigError(f"{path}: the stage's flag {secrets[0]!r} holds a secret in clear, and a stage reads its "
                          "flags from this recipe file: put it in the environment (judges and endpoints read "
                          "OPENAI_API_KEY), which the stages inherit")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        yaml.safe_dump(values, f, sort_keys=False, allow_unicode=True)
    os.replace(path + ".tmp", path)
    try:
        return parse_config(config_cls, ["--config", path])
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def recipe_changes(old, new):
    """`--flag: old -> new` for every flag whose value differs between two recipes (dicts)."""
    return [f"--{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def start_stage(name, folder, values, config_cls, restart=False):
    """Write an unfinished stage's recipe (folder/recipe.yaml) and check it parses. A stage that started earlier
    (its recipe is there) with other flags holds half a run of those: it is refused, naming the flags, or with
    `restart` (--restart_stage) emptied and started over."""
    path = os.path.join(folder, "recipe.yaml")
    if os.path.exists(path):
        with open(path) as f:
            changes = recipe_changes(yaml.safe_load(f) or {}, values)
        if changes and not restart:
            raise ConfigError(f"iterate: stage {name} ({folder}) started earlier with other flags and is unfinished; "
                              f"resuming would mix two runs. Changed: {'; '.join(changes)}. Run with the flags it "
                              "started with, or --restart_stage true to start it over")
        if changes:
            print(f"[iterate] {name}: flags changed ({'; '.join(changes)}): --restart_stage, started over", flush=True)
            shutil.rmtree(folder)
    return write_recipe(values, path, config_cls)


def script_configs():
    """The config classes of the stage scripts."""
    return {"distill": distill.DistillConfig, "sft": train_sft.SFTConfig, "grpo": train_grpo.GRPOConfig,
            "evaluate": evaluate.EvalConfig}


# --------------------------------------------------------------------------------------------------
# Running a stage once


class Runner:
    """Runs each stage's command once: a finished stage (its stage.json) is never run again."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.child = None
        self.lock = None
        # `accelerate launch` of this interpreter (not whichever `accelerate` is first on PATH): every stage runs in
        # the environment iterate.py runs in
        self.accelerate = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]

    def hold(self, folder):
        """Take folder's lock for as long as this process lives (the OS drops it on any exit, a kill included), or
        stop, naming the holder's pid and host: a second runner on the same folder would run the same stage twice
        at once (utils/core/output_dir.py)."""
        self.lock = folder
        hold_lock(folder, what="iterate run")

    def release(self):
        """Drop the lock `hold` took (the file stays: another runner may already have it open)."""
        if self.lock is not None:
            release(self.lock)
            self.lock = None

    def forward_signals(self):
        """SIGTERM / SIGINT to iterate stop the running stage too (its whole process group)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)

    def _forward(self, signum, frame):
        if self.child is not None and self.child.poll() is None:
            try:
                os.killpg(self.child.pid, signum)  # the stage's launcher and every worker
            except ProcessLookupError:
                pass
        raise SystemExit(128 + signum)

    def launch(self, script, recipe):
        cmd = self.accelerate + ["launch"]
        if self.cfg.accelerate_config:
            cmd += ["--config_file", self.cfg.accelerate_config]
        return cmd + [os.path.join(REPO, script), "--config", recipe]

    def python(self, script, recipe):
        return [sys.executable, os.path.join(REPO, script), "--config", recipe]

    @staticmethod
    def done(folder):
        path = os.path.join(folder, STAGE_FILE)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def run(self, name, folder, command, result=lambda: {}):
        """Run `command` unless the stage is finished; then record it (and `result()`) in folder/stage.json."""
        record = self.done(folder)
        if record is not None:
            print(f"[iterate] {name}: finished earlier ({record['seconds']:.0f} s), skipped", flush=True)
            return record
        os.makedirs(folder, exist_ok=True)
        print(f"[iterate] {name}: {' '.join(command)}", flush=True)
        start = time.monotonic()
        with open(os.path.join(folder, "stage.log"), "a", encoding="utf-8") as log:
            # the stage runs where iterate.py was started: --output_dir, the data and the configs are the caller's
            # relative paths (the scripts themselves are given by absolute path)
            # its own process group (signals reach all of it), and the runner's pid in its environment: however this
            # runner ends, even by SIGKILL, the stage's processes end with it (utils.core.launch.watch_stage_parent)
            self.child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, bufsize=1, preexec_fn=die_with_parent, start_new_session=True,
                                          env={**os.environ, **stage_parent_env()})
            for line in self.child.stdout:
                sys.stdout.write(line)
                log.write(line)
            code = self.child.wait()
        self.child = None
        if code != 0:
            raise SystemExit(f"iterate: stage {name} failed (exit code {code}); its log is "
                             f"{os.path.join(folder, 'stage.log')}. Fix the cause and run the same command again: "
                             "finished stages are kept and this one resumes")
        return self.mark(name, folder, time.monotonic() - start, {"command": command, **result()})

    @staticmethod
    def mark(name, folder, seconds, result):
        """Record a stage as finished (atomically): folder/stage.json."""
        record = {"stage": name, "seconds": seconds, **result}
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, STAGE_FILE + ".tmp"), "w") as f:
            json.dump(record, f, indent=2)
        os.replace(os.path.join(folder, STAGE_FILE + ".tmp"), os.path.join(folder, STAGE_FILE))
        return record


def final_checkpoint(folder):
    path = latest_checkpoint(folder)
    if path is None:
        raise SystemExit(f"iterate: {folder} has no complete checkpoint although its script succeeded")
    return path


# --------------------------------------------------------------------------------------------------
# Data: the RL set, the estimated difficulty, the next cycle's SFT set


SOURCE_FILE = "iterate_source.json"  # inside rl-data/ and val-data/: the flags that chose their rows
RL_SOURCE_FLAGS = ("rl_dataset", "rl_split", "rl_samples", "rl_image_column", "rl_question_column",
                   "rl_answer_column")


def write_rows_once(out, source, make):
    """A save_to_disk folder of `make()`'s rows, written once. `source` (the flags that choose the rows) is kept in
    it; a later run that would choose other rows is refused, naming the flags, rather than reusing the folder."""
    record = os.path.join(out, SOURCE_FILE)
    if os.path.isdir(out):
        old = {}
        if os.path.exists(record):
            with open(record) as f:
                old = json.load(f)
        changes = recipe_changes(old, source) if old else []
        if changes:
            raise ConfigError(f"iterate: {out} holds rows chosen with other flags ({'; '.join(changes)}); every "
                              "stage of this run was trained on them. Run with those flags, or give another "
                              "--output_dir")
        return out
    make().save_to_disk(out + ".tmp")
    with open(os.path.join(out + ".tmp", SOURCE_FILE), "w") as f:
        json.dump(source, f, indent=2)
    os.replace(out + ".tmp", out)
    return out


def _load_rows(dataset, split, cfg):
    path = resolve_dataset(dataset)
    return load_vqa(path, split=split, image_column=cfg.rl_image_column, question_column=cfg.rl_question_column,
                    answer_column=cfg.rl_answer_column, require_steps=False)


def write_rl_data(cfg, out):
    """The RL rows (the first --rl_samples of --rl_dataset) in the standard columns, written once."""
    def make():
        rows = _load_rows(cfg.rl_dataset, cfg.rl_split, cfg)
        return rows.select(range(min(cfg.rl_samples, len(rows)))) if cfg.rl_samples else rows

    return write_rows_once(out, {k: getattr(cfg, k) for k in RL_SOURCE_FLAGS}, make)


def write_val_data(cfg, out):
    """The validation rows of --rl_eval_steps: --val_samples of --val_dataset, or of --rl_dataset right after the
    RL set (rows the RL stages never see)."""
    def make():
        if cfg.val_dataset:
            rows = _load_rows(cfg.val_dataset, cfg.val_split or cfg.rl_split, cfg)
            start = 0
        else:
            rows = _load_rows(cfg.rl_dataset, cfg.rl_split, cfg)
            start = cfg.rl_samples or len(rows)
        if start + 1 > len(rows):
            raise ConfigError(f"--rl_eval_steps: {cfg.rl_dataset} ({cfg.rl_split}) has {len(rows)} rows, all in the "
                              "RL set (--rl_samples); give --val_dataset or a smaller --rl_samples")
        return rows.select(range(start, min(start + cfg.val_samples, len(rows))))

    flags = RL_SOURCE_FLAGS + ("val_dataset", "val_split", "val_samples")
    return write_rows_once(out, {k: getattr(cfg, k) for k in flags}, make)


def write_estimated_difficulty(rl_data, checkpoint, out):
    """The RL rows with the difficulty the medium stage estimated (saved in its checkpoints) as a column."""
    if os.path.isdir(out):
        return out
    import datasets

    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        levels = json.load(f).get("difficulty_levels")
    rows = datasets.load_from_disk(rl_data)
    if not levels or len(levels) != len(rows):
        raise SystemExit(f"iterate: {checkpoint} holds no difficulty estimate for the {len(rows)} RL rows")
    rows.remove_columns([c for c in (ESTIMATED_DIFFICULTY,) if c in rows.column_names]).add_column(
        ESTIMATED_DIFFICULTY, levels).save_to_disk(out + ".tmp")
    os.replace(out + ".tmp", out)
    return out


def read_rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mix_sft_sets(previous, new, size, keep_previous, seed, out_file):
    """`round(keep_previous * size)` rows drawn (seeded) from the previous set, then new rows up to `size`;
    image paths rewritten relative to the new file. Returns counts."""
    old_rows, new_rows = read_rows(previous), read_rows(new)
    n_old = min(len(old_rows), round(keep_previous * size))
    chosen = random.Random(seed).sample(range(len(old_rows)), n_old)
    taken = {old_rows[i]["id"] for i in chosen}
    fresh = [r for r in new_rows if r["id"] not in taken][:size - n_old]
    out_dir = os.path.dirname(os.path.abspath(out_file))

    def rebase(row, source_file):
        base = os.path.dirname(os.path.abspath(source_file))
        images = [p if os.path.isabs(p) else os.path.relpath(os.path.join(base, p), out_dir) for p in row["images"]]
        return {**row, "images": images}

    rows = [rebase(old_rows[i], previous) for i in sorted(chosen)] + [rebase(r, new) for r in fresh]
    with open(out_file + ".tmp", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(out_file + ".tmp", out_file)
    return {"rows": len(rows), "from_previous": n_old, "new": len(fresh)}


def eval_recipe(cfg, evaluation, model, folder, bench=None):
    """evaluate.py's flags for a held-out evaluation: --evaluate, then the held-out set (--eval_dataset as
    --eval_benchmark, if set) or --eval_benchmarks' `bench` (its own flags over --evaluate), then the model, the
    folder and the cycle's prompt template."""
    if bench is None:
        data = {"dataset": cfg.eval_dataset, "split": cfg.eval_split, "max_samples": cfg.eval_samples}
        data.update({"benchmark": cfg.eval_benchmark} if cfg.eval_benchmark else {})
    else:
        data = {"max_samples": None, **cfg.eval_benchmarks[bench]}
    return stage_recipe(None, {**evaluation, **data}, {"model": model, "output_dir": folder,
                                                        "prompt_template": cfg.prompt_template})


def picked(pick_dir):
    """evaluate.py --select_best's choice as the cycle records it: the checkpoint, its step (0: the stage's
    starting model) and every candidate's validation score by step."""
    with open(os.path.join(pick_dir, "best_checkpoint.json")) as f:
        best = json.load(f)
    return {"best_checkpoint": best["best_checkpoint"], "step": best["best_step"], "value": best["value"],
            "steps": {str(best["steps"][path]): value for path, value in best["scores"].items()}}


def distill_summary(folder):
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------------
# The report


def eval_metrics(folder):
    with open(os.path.join(folder, "metrics.json")) as f:
        metrics = json.load(f)
    keep = {k: v for k, v in metrics.items() if k.startswith(("accuracy", "format", "math_accuracy", "samples"))}
    keep["keywords"] = {g: s["per_response"] for g, s in metrics.get("keywords", {}).items()}
    return keep


def completions(folder):
    return [r["completion"] for r in read_rows(os.path.join(folder, "generations.jsonl"))]


def keyword_summary(base_texts, sft_texts):
    """Keyword hits per response of the base and the SFT model, and each used keyword's share of all hits."""
    out = {}
    for name, texts in (("base", base_texts), ("sft", sft_texts)):
        counted = keyword_shares(texts)
        out[name] = {"hits_per_response": counted["hits"] / max(len(texts), 1),
                     "shares": {w: round(v, 4) for w, v in counted["shares"].items() if v > 0}}
    return out


def write_report(cfg, base_eval, cycles, base_benchmarks=None):
    """report.json (every number) and report.png (accuracy after each stage, keyword frequencies). With
    --eval_benchmarks, the base model's and each cycle's final model's metrics on each (`benchmarks`)."""
    base_texts = completions(base_eval)
    report = {"base_model": cfg.base_model, "seed": cfg.seed, "base": eval_metrics(base_eval), "cycles": []}
    report["base"]["benchmarks"] = {b: eval_metrics(folder) for b, folder in (base_benchmarks or {}).items()}
    for c in cycles:
        stages = {name: eval_metrics(folder) for name, folder in c["evals"].items()}
        report["cycles"].append({
            "cycle": c["cycle"], "data": c["data"], "stages": stages, "picked": c.get("picked", {}),
            "benchmarks": {b: eval_metrics(folder) for b, folder in c.get("benchmarks", {}).items()},
            "sft_efficacy": sft_efficacy_score(base_texts, completions(c["evals"]["sft"])),
            # the score saturates at its cap of 2 when the base uses no keyword: what stands behind it
            "sft_keywords": keyword_summary(base_texts, completions(c["evals"]["sft"])),
            "seconds": c["seconds"]})
    acc = lambda c, s: report["cycles"][c]["stages"][s]["accuracy"]  # noqa: E731
    claims = {"each_sft_above_base": all(acc(i, "sft") > report["base"]["accuracy"]
                                         for i in range(len(cycles)))}
    if len(cycles) > 1:
        claims["last_rl_above_first_rl"] = acc(-1, "grpo-hard") > acc(0, "grpo-hard")
        claims["rl_above_previous_cycle_rl"] = [acc(i, "grpo-hard") > acc(i - 1, "grpo-hard")
                                                for i in range(1, len(cycles))]
    report["claims"] = claims
    report["accuracy_after_each_stage"] = [("base", report["base"]["accuracy"])] + [
        (f"cycle {c['cycle']} {s}", c["stages"][s]["accuracy"]) for c in report["cycles"] for s in c["stages"]]
    path = os.path.join(cfg.output_dir, "report.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(path + ".tmp", path)
    plot_report(report, os.path.join(cfg.output_dir, "report.png"))
    return report


def plot_report(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [name for name, _ in report["accuracy_after_each_stage"]]
    values = [value for _, value in report["accuracy_after_each_stage"]]
    points = [report["base"]] + [s for c in report["cycles"] for s in c["stages"].values()]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(labels)), 7), sharex=True)
    top.plot(range(len(values)), values, marker="o")
    for x, v in enumerate(values):
        top.annotate(f"{v:.3f}", (x, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    top.set_ylabel("held-out accuracy")
    top.set_title(f"OpenVLThinker cycle: {report['base_model']} (seed {report['seed']})")
    top.grid(alpha=0.3)
    for group in (points[0].get("keywords") or {}):
        bottom.plot(range(len(points)), [p["keywords"].get(group, 0.0) for p in points], marker=".", label=group)
    bottom.set_ylabel("keyword hits per response")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    bottom.set_xticks(range(len(labels)))
    bottom.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# The cycle


def main(cfg: IterateConfig):
    validate(cfg)
    runner = Runner(cfg)
    runner.hold(cfg.output_dir)  # before anything is written: a second iterate.py on this folder stops here
    try:
        return run_cycles(cfg, runner)
    finally:
        runner.release()


def run_cycles(cfg: IterateConfig, runner):
    configs = script_configs()
    out = cfg.output_dir
    save_config(cfg, os.path.join(out, "config.yaml"))
    runner.forward_signals()
    seed = {"seed": cfg.seed}
    template = {"prompt_template": cfg.prompt_template}
    evaluation = dict(cfg.evaluate)

    def stage(name, folder, values, config_cls):
        """The stage's recipe path; an unfinished stage's recipe is (re)written and checked against how it began."""
        if not runner.done(folder):
            start_stage(name, folder, values, config_cls, restart=cfg.restart_stage)
        return os.path.join(folder, "recipe.yaml")

    def evaluated(name, folder, model, bench=None):
        """evaluate.py of `model` on the held-out set, or on --eval_benchmarks' `bench`."""
        recipe = eval_recipe(cfg, evaluation, model, folder, bench)
        runner.run(name, folder, runner.python("evaluate.py", stage(name, folder, recipe, configs["evaluate"])))
        return folder

    def benchmarks(name, folder, model):
        """{benchmark name: its evaluation folder} of `model` on every --eval_benchmarks set."""
        return {bench: evaluated(f"{name}-{bench}", f"{folder}-{bench}", model, bench) for bench in cfg.eval_benchmarks}

    def train(name, folder, script, config_cls, recipe, overrides, forced, defaults=None):
        values = stage_recipe(recipe, overrides, {**forced, "output_dir": folder, "resume_from_checkpoint": "latest"},
                              defaults={"eval_dataset_name": None, **(defaults or {})}, cycle=seed)
        record = runner.run(name, folder, runner.launch(script, stage(name, folder, values, config_cls)),
                            result=lambda: {"checkpoint": final_checkpoint(folder)})
        return record["checkpoint"]

    def rl_stage(name, folder, recipe, overrides, forced):
        """A GRPO stage, then (--rl_eval_steps) the pick among its start and checkpoints on the validation rows.
        Returns (the model the cycle continues from, its last checkpoint, the pick or None)."""
        every = {"save_steps": cfg.rl_eval_steps, "save_total_limit": None} if cfg.rl_eval_steps else {}
        last = train(name, folder, "train_grpo.py", configs["grpo"], recipe, overrides, {**forced, **every})
        if not cfg.rl_eval_steps:
            return last, last, None
        pick_dir = folder + "-pick"
        values = stage_recipe(None, evaluation, {
            "select_best": folder, "select_include": [forced["model_name_or_path"]], "select_metric": cfg.val_metric,
            "dataset": val_data, "split": "train", "max_samples": None, "output_dir": pick_dir, **template})
        if cfg.val_metric == "math_accuracy" and "math" not in values.get("metrics", []):
            values["metrics"] = list(values.get("metrics", [])) + ["math"]
        pick = runner.run(f"{name} pick", pick_dir, runner.python("evaluate.py", stage(f"{name} pick", pick_dir, values,
                                                                                      configs["evaluate"])),
                          result=lambda: picked(pick_dir))
        print(f"[iterate] {name}: continues from step {pick['step']} ({cfg.val_metric} {pick['value']:.3f} on "
              f"{cfg.val_samples} validation rows)", flush=True)
        return pick["best_checkpoint"], last, {k: pick[k] for k in ("step", "best_checkpoint", "value", "steps")}

    def distill_stage(name, folder, forced):
        values = stage_recipe(cfg.distill_recipe, cfg.distill, {**template, "output_dir": folder, **forced},
                              cycle=seed)
        runner.run(name, folder, runner.python("distill.py", stage(name, folder, values, configs["distill"])),
                   result=lambda: distill_summary(folder))
        return os.path.join(folder, "sft.jsonl")

    # Every stage recipe is checked before the first stage runs (later cycles differ from these only in paths).
    check_dir = os.path.join(out, ".recipe-check")
    try:
        for script, recipe, overrides in (("sft", cfg.sft_recipe, cfg.sft),
                                          ("grpo", cfg.grpo_medium_recipe, cfg.grpo_medium),
                                          ("grpo", cfg.grpo_hard_recipe, cfg.grpo_hard)):
            write_recipe(stage_recipe(recipe, overrides, {"output_dir": check_dir}),
                         os.path.join(check_dir, "r.yaml"), configs[script])
        distill.validate(write_recipe(stage_recipe(cfg.distill_recipe, cfg.distill,
                                                   {"output_dir": check_dir, **template}),
                                      os.path.join(check_dir, "r.yaml"), configs["distill"]))
        for bench in [None, *cfg.eval_benchmarks]:  # the held-out set and each benchmark (a misspelt name, a typo)
            evaluate.validate(write_recipe(eval_recipe(cfg, evaluation, cfg.base_model, check_dir, bench),
                                                  os.path.join(check_dir, "r.yaml"), configs["evaluate"]))
    finally:
        shutil.rmtree(check_dir, ignore_errors=True)
    rl_data = os.path.join(out, "rl-data")

    base_model = resolve_tiny_name(cfg.base_model)
    write_rl_data(cfg, rl_data)
    val_data = write_val_data(cfg, os.path.join(out, "val-data")) if cfg.rl_eval_steps else None
    base_eval = evaluated("eval-base", os.path.join(out, "eval-base"), base_model)
    base_benchmarks = benchmarks("eval-base", os.path.join(out, "eval-base"), base_model)
    rl_columns = {"dataset_name": rl_data, "dataset_split": "train", "image_column": "image",
                  "question_column": "question", "answer_column": "answer", **template}
    cycles, previous_set, previous_model = [], None, None
    for i in range(1, cfg.num_cycles + 1):
        start = time.monotonic()
        folder = os.path.join(out, f"cycle-{i}")
        size = cfg.sft_sizes[min(i - 1, len(cfg.sft_sizes) - 1)]

        # ---- the SFT set: distilled by the reasoner (cycle 1), then by the improved model, mixed with the last ----
        data_dir = os.path.join(folder, "data")
        if i == 1:
            sft_set = distill_stage(f"cycle-{i}/data", data_dir, {"max_kept": size, "shuffle_seed": cfg.seed})
            data = distill_summary(data_dir)
        else:
            new_rows = size - round(cfg.keep_previous * size)
            source = {"chain_source": "reasoner"}
            if cfg.next_data == "model":
                source = {"chain_source": "model", "model": previous_model, "model_base_url": None,
                          "model_serve": cfg.next_data_serve}
            new_set = distill_stage(f"cycle-{i}/data (new rows)", os.path.join(data_dir, "new"),
                                    {**source, "max_kept": new_rows, "shuffle_seed": cfg.seed * 1000 + i})
            sft_set = os.path.join(data_dir, "sft.jsonl")
            mixed = runner.done(data_dir)
            if mixed is None:
                t0 = time.monotonic()
                counts = mix_sft_sets(previous_set, new_set, size, cfg.keep_previous, cfg.seed * 1000 + i, sft_set)
                mixed = runner.mark(f"cycle-{i}/data (mix)", data_dir, time.monotonic() - t0, counts)
            data = {"new": distill_summary(os.path.join(data_dir, "new")),
                    "mix": {k: mixed[k] for k in ("rows", "from_previous", "new")}}

        # ---- SFT from the base, difficulty estimate + medium stage, hard stage; each evaluated ----
        sft_model = train(f"cycle-{i}/sft", os.path.join(folder, "sft"), "train_sft.py", configs["sft"],
                          cfg.sft_recipe, cfg.sft, {"model_name_or_path": base_model, "dataset_name": sft_set,
                                                     "dataset_format": "sharegpt", "dataset_split": "train"})
        evals = {"sft": evaluated(f"cycle-{i}/eval-sft", os.path.join(folder, "eval-sft"), sft_model)}
        medium, medium_last, medium_pick = rl_stage(
            f"cycle-{i}/grpo-medium", os.path.join(folder, "grpo-medium"), cfg.grpo_medium_recipe, cfg.grpo_medium,
            {"model_name_or_path": sft_model, "curriculum": ["medium"], **rl_columns})
        evals["grpo-medium"] = evaluated(f"cycle-{i}/eval-grpo-medium", os.path.join(folder, "eval-grpo-medium"),
                                        medium)
        hard_data = {}
        medium_cfg = parse_config(configs["grpo"], ["--config", os.path.join(folder, "grpo-medium", "recipe.yaml")])
        if cfg.difficulty_once and medium_cfg.difficulty_samples > 0:
            hard_rows = write_estimated_difficulty(rl_data, medium_last, os.path.join(folder, "grpo-hard-data"))
            hard_data = {"dataset_name": hard_rows, "difficulty_samples": 0, "difficulty_column": ESTIMATED_DIFFICULTY}
        hard, _, hard_pick = rl_stage(f"cycle-{i}/grpo-hard", os.path.join(folder, "grpo-hard"), cfg.grpo_hard_recipe,
                                      cfg.grpo_hard, {"model_name_or_path": medium, "curriculum": ["hard"],
                                                      **rl_columns, **hard_data})
        evals["grpo-hard"] = evaluated(f"cycle-{i}/eval-grpo-hard", os.path.join(folder, "eval-grpo-hard"), hard)
        finals = benchmarks(f"cycle-{i}/eval-grpo-hard", os.path.join(folder, "eval-grpo-hard"), hard)

        seconds = sum((Runner.done(f) or {}).get("seconds", 0.0) for f in _stage_folders(folder))
        picks = {k: v for k, v in (("grpo-medium", medium_pick), ("grpo-hard", hard_pick)) if v}
        cycles.append({"cycle": i, "data": data, "evals": evals, "picked": picks, "benchmarks": finals,
                       "seconds": seconds or time.monotonic() - start})
        previous_set, previous_model = sft_set, hard
        report = write_report(cfg, base_eval, cycles, base_benchmarks)
        print(f"[iterate] cycle {i}: held-out accuracy " + ", ".join(
            f"{s} {m['accuracy']:.3f}" for s, m in report["cycles"][-1]["stages"].items()) +
            f" (base {report['base']['accuracy']:.3f})" + "".join(
            f"; {s} picked step {p['step']}" for s, p in report["cycles"][-1]["picked"].items()) + "".join(
            f"; {b} {m['accuracy']:.3f} (base {report['base']['benchmarks'][b]['accuracy']:.3f})"
            for b, m in report["cycles"][-1]["benchmarks"].items()), flush=True)
    print(f"[iterate] wrote {os.path.join(out, 'report.json')} and report.png; claims: {report['claims']}", flush=True)
    return report


def _stage_folders(cycle_folder):
    for root, dirs, files in os.walk(cycle_folder):
        if STAGE_FILE in files:
            yield root
        dirs[:] = [d for d in dirs if not d.startswith(("checkpoint-", "images", "."))]


if __name__ == "__main__":
    with exit_on_bad_input("iterate.py"):
        main(parse_args())
