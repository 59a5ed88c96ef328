"""utils/core/run.py, the run skeleton of the train scripts: the scripts call it in one order, refuse bad flags one way
(ConfigError naming the flag), checkpoint and report held-out results through it, keep their loops three deep, and
the skeleton itself resumes a plain torch model exactly."""

import ast
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from tests.launch_helpers import fresh_accelerate_state
from utils.core.checkpoint import save_checkpoint
from utils.core.config import ConfigError
from utils.core.run import (
    finish_run,
    is_due,
    make_accelerator,
    prepare_training,
    resume_run,
    seed_run,
    start_logging,
    train_summary,
)
from utils.eval.heldout import evaluate_after, evaluate_before

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("train_grpo.py", "train_sft.py", "train_mixgrpo.py")
SKELETON = ["make_accelerator", "validate", "seed_run", "prepare_training", "resume_run", "start_logging",
            "train_summary", "finish_run"]


def tree(script):
    with open(os.path.join(REPO, script), encoding="utf-8") as f:
        return ast.parse(f.read())


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_calls_the_skeleton_once_in_the_same_order(script):
    main = next(n for n in tree(script).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    calls = [(n.lineno, n.func.id) for n in ast.walk(main)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in SKELETON]
    assert [name for _, name in sorted(calls)] == SKELETON


COMPOUND = (ast.For, ast.While, ast.If, ast.With, ast.Try)


def depth(node):
    """How deep compound statements nest from `node` down (`node` itself counting one)."""
    below = max((depth(child) for child in ast.iter_child_nodes(node)), default=0)
    return below + (1 if isinstance(node, COMPOUND) else 0)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_training_loop_reads_top_to_bottom_at_most_three_deep(script):
    main = next(n for n in tree(script).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.While))
    assert depth(loop) <= 3 and loop.end_lineno - loop.lineno < 80


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_checkpoints_and_reports_held_out_results_through_the_skeleton(script):
    called = {n.func.id for n in ast.walk(tree(script)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"is_due", "save_and_push", "evaluate_after"} <= called and "save_checkpoint" not in called


def test_zero3_is_tested_in_one_place():
    """Every ZeRO-3 test goes through utils.core.zero3.is_zero3: no script or module reads the stage itself."""
    spelled = []
    for folder, _, files in os.walk(REPO):
        if any(part in folder for part in ("/tests", "/.", "/outputs")):
            continue
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != os.path.join(REPO, "utils", "core", "zero3.py"):
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                if "zero_stage == 3" in text or "zero_stage != 3" in text or "zero_optimization_stage()" in text:
                    spelled.append(os.path.relpath(path, REPO))
    assert not spelled


def test_held_out_results_before_and_after_in_one_shape():
    printed, calls = [], []

    def evaluate(tag):
        calls.append(tag)
        return {"accuracy": 0.5 if tag == "before" else 0.75}

    accelerator, cfg = SimpleNamespace(print=printed.append), SimpleNamespace(eval_before=True)
    before = evaluate_before(accelerator, evaluate, {}, cfg, 0, describe=lambda r: f"before {r['accuracy']}")
    assert before == {"accuracy": 0.5} and printed == ["before 0.5"]
    # a resumed run keeps its checkpoint's; without an evaluation, or with --eval_before false, there is none
    kept = {"heldout_before": {"accuracy": 0.25}}
    assert evaluate_before(accelerator, evaluate, kept, cfg, 7, describe=str) == {"accuracy": 0.25}
    assert evaluate_before(accelerator, None, {}, cfg, 0, describe=str) is None
    assert evaluate_before(accelerator, evaluate, {}, SimpleNamespace(eval_before=False), 0, describe=str) is None
    summary = {"global_step": 3}
    after = evaluate_after(accelerator, evaluate, summary, before,
                           summarize=lambda a, b: {"after": a["accuracy"], "before": b["accuracy"]},
                           describe=lambda a, b: [f"{b['accuracy']} -> {a['accuracy']}"])
    assert after == {"accuracy": 0.75} and summary == {"global_step": 3, "after": 0.75, "before": 0.5}
    assert printed[-1] == "0.5 -> 0.75" and calls == ["before", "after"]
    assert evaluate_after(accelerator, None, summary, before, summarize=dict, describe=list) is None


def test_logging_and_saving_are_due_every_n_steps_and_at_the_last():
    assert [s for s in range(1, 11) if is_due(s, 4, 10)] == [4, 8, 10]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_refusal_is_a_config_error(script):
    """A raise whose message names a flag (`--...`) raises ConfigError, whatever function it is in, and `validate`
    raises where it checks (no helper of its own in between)."""
    module = tree(script)
    validate = next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "validate")
    assert not [n.name for n in ast.walk(validate) if isinstance(n, ast.FunctionDef) and n is not validate]
    refusals = []
    for node in ast.walk(module):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            text = "".join(part.value for part in ast.walk(node.exc.args[0])
                           if isinstance(part, ast.Constant) and isinstance(part.value, str))
            if "--" in text:
                refusals.append((node.lineno, node.exc.func.id))
    assert refusals and all(kind == "ConfigError" for _, kind in refusals), refusals


@dataclass
class RunConfig:  # the flags the skeleton reads
    output_dir: str
    report_to: str = "none"
    cpu_threads: Optional[int] = 1
    seed: int = 3
    learning_rate: float = 0.1
    weight_decay: float = 0.0
    lr_scheduler_type: str = "linear"
    max_grad_norm: float = 1.0
    resume_from_checkpoint: Optional[str] = None
    push_to_hub: bool = False
    hub_model_id: Optional[str] = None
    hub_private_repo: bool = False
    overwrite_output_dir: bool = False
    ddp_timeout: int = 1800
    max_skipped_steps: int = 3


def config(out, **overrides):
    return RunConfig(output_dir=str(out), **overrides)


def run(out, steps, **overrides):
    """The skeleton around a loop that fits a linear layer to random targets: `steps` steps, a checkpoint each."""
    cfg = config(out, **overrides)
    try:
        accelerator = make_accelerator(cfg)
        seed_run(cfg)
        layer = torch.nn.Linear(3, 1)
        layer, optimizer, scheduler = prepare_training(accelerator, cfg, layer, list(layer.parameters()), max_steps=4,
                                                       num_warmup_steps=1, micro_batch_size=2)
        state, path = resume_run(accelerator, cfg)
        step = state.get("global_step", 0)
        logger, uploader = start_logging(accelerator, cfg, total_steps=4, start_step=step)
        start = 0.0
        while step < steps:
            x = torch.randn(2, 3)  # the restored RNG makes a resumed run draw what the full one drew
            loss = (layer(x) - x.sum(-1, keepdim=True)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
            logger.log(step, {"loss": loss.item(), "learning_rate": scheduler.get_last_lr()[0]})
            save_checkpoint(accelerator, cfg.output_dir, step, model=layer, extra_state={})
        finish_run(accelerator, cfg, logger, uploader, dict(train_summary(step, start, logger), resumed=path),
                   curves=[("loss_curve.png", ["loss"], 0.0)])
        return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    finally:
        fresh_accelerate_state()


def test_the_skeleton_resumes_a_run_exactly_and_writes_its_summary_and_curves(tmp_path):
    full = run(tmp_path / "full", 4)
    assert [m["learning_rate"] for m in full] == pytest.approx([0.1, 2 / 30, 1 / 30, 0.0])  # warm-up, then linear
    resumed = run(tmp_path / "resumed", 4, resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed == full[2:]  # bit for bit: weights, optimizer, scheduler and RNG came back
    summary = json.loads((tmp_path / "resumed" / "train_summary.json").read_text())
    assert summary["global_step"] == 4 and summary["loss"] == full[-1]["loss"] and summary["resumed"].endswith("-2")
    assert (tmp_path / "resumed" / "loss_curve.png").is_file() and (tmp_path / "full" / "config.yaml").is_file()


def test_a_bad_thread_count_is_refused_as_a_flag(tmp_path):
    with pytest.raises(ConfigError, match="--cpu_threads 0"):
        seed_run(config(tmp_path, cpu_threads=0))
